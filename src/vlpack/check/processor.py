"""transformers' processor built from a checkpoint folder (`build_processor`) and its encoding of
a conversation (`_hf_inputs`): the reference side of `vlpack check --data`'s encoding check
(check/encoding.py), which the export and tool-call tests also encode with.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vlpack.data.types import Conversation, VideoRef


def _videos(conv: Conversation) -> list[VideoRef]:
    return [c for m in conv.messages for c in m.content if isinstance(c, VideoRef)]


def _image_only(cls: type) -> type:
    """`cls` (a Qwen-VL processor class) accepting no video processor: transformers' video
    processors need torchvision; its image processor and tokenizer work without it."""

    class ImageOnly(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImageOnly.__name__ = f"{cls.__name__}WithoutVideo"
    return ImageOnly


def build_processor(folder: Path) -> tuple[object | None, str | None, str | None]:
    """(processor, why its videos are not compared or None, why nothing is compared or None)
    for a checkpoint folder."""
    import transformers
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    from vlpack.data.template import find_template

    if not (folder / "config.json").is_file():
        return None, None, f"{folder} has no config.json"
    template = find_template(folder)
    if template is None:
        return None, None, (f"{folder} has no chat template, so transformers' processor cannot "
                            "render the conversations")
    try:
        proc = AutoProcessor.from_pretrained(folder, local_files_only=True)
        if getattr(proc, "image_processor", None) is None:
            return None, None, f"transformers builds no image processor from {folder}"
        return proc, None, None
    except ImportError as e:  # the video processor's torchvision
        why = " ".join(str(e).split())
        no_video = ("transformers' video processor needs torchvision, which does not import "
                    "here" if "torchvision" in why.lower() else
                    f"transformers' video processor cannot be built here ({why[:160]})")
    except Exception as e:  # any reason is reported; none is a check failure
        return None, None, f"transformers cannot build a processor from {folder}: {e}"
    try:
        name = PROCESSOR_MAPPING_NAMES[AutoConfig.from_pretrained(folder).model_type]
        cls = _image_only(getattr(transformers, name))
        proc = cls(image_processor=AutoImageProcessor.from_pretrained(folder, local_files_only=True),
                   tokenizer=AutoTokenizer.from_pretrained(folder, local_files_only=True),
                   video_processor=None, chat_template=template.source)
    except Exception as e:
        return None, None, f"transformers cannot build a processor from {folder}: {e}"
    return proc, no_video, None


def _hf_inputs(proc, conv: Conversation) -> dict:
    """transformers' encoding of `conv`: the template rendered by the processor, its images
    loaded by transformers, its videos handed over as files or frame lists."""
    from transformers.image_utils import load_image

    from vlpack.data.template import hf_messages

    text = proc.apply_chat_template(hf_messages(conv.messages), tools=list(conv.tools) or None,
                                    tokenize=False, add_generation_prompt=False)
    images = [load_image(str(ref.path)) for ref in conv.images]
    refs = _videos(conv)
    kwargs: dict = dict(text=[text], return_tensors="pt", return_mm_token_type_ids=True)
    if images:
        kwargs["images"] = images
    if refs and all(v.path is not None for v in refs):  # files: decoded and sampled there
        kwargs["videos"] = [str(v.path) for v in refs]
    elif refs and all(v.path is None for v in refs):  # frame lists: already sampled at fps
        frames = [np.stack([np.asarray(load_image(str(f))) for f in v.frames]) for v in refs]
        kwargs["videos"] = frames
        kwargs["videos_kwargs"] = dict(do_sample_frames=False, return_metadata=True, video_metadata=[
            {"total_num_frames": len(f), "fps": float(v.fps or 2.0),
             "frames_indices": list(range(len(f)))} for f, v in zip(frames, refs, strict=True)])
    elif refs:
        raise ValueError("a sample mixing video files and frame lists is not handed over")
    return dict(proc(**kwargs))
