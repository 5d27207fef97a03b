"""`vlpack check --data`'s encoding check: vlpack's encoding of each sample against what
transformers' own processor makes of it.

Both sides read the same checkpoint folder: vlpack's `Encoder` with its tokenizer, chat template,
image and video settings (what `vlpack train` uses with `model.name=FOLDER`), and the processor
transformers builds from it (`AutoProcessor.from_pretrained`), which renders the conversation
with `apply_chat_template` and encodes the text, the images (loaded by transformers'
`load_image`) and the videos. Compared per sample, each difference a named failure: input ids,
token types, image and video grids, the video timestamps written into the text (qwen3
families), Qwen2.5-VL's `second_per_grid_ts`, and the MRoPE positions (vlpack's
`mrope_positions`, which the packed row uses, against the model's own `get_rope_index` on the
processor's output).

Not compared, with the reason in the report: every sample when the folder has no processor
transformers can build or no chat template; the video samples when transformers' video
processor cannot be built (it needs torchvision: the image processor and the tokenizer are then
used alone), or when the processor refuses the video.

Legend: L = tokens of one sample.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from torch import nn

from vlpack.data.rope import mrope_positions
from vlpack.data.types import Conversation, EncodedSample, VideoRef
from vlpack.model.build import ModelSpec

_TIMESTAMP = re.compile(r"<(\d+(?:\.\d+)?) seconds>")


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


def _snippet(tok, ids: np.ndarray, i: int) -> str:
    return tok.decode(ids[max(0, i - 6) : i + 6].tolist())


def _grid(x) -> list:
    return [] if x is None else np.asarray(x).reshape(-1, 3).tolist()


def _hf_positions(model: nn.Module, spec: ModelSpec, hf: dict) -> np.ndarray:
    """[3, L] positions of the model's own `get_rope_index` on the processor's output."""
    kwargs = dict(input_ids=hf["input_ids"], mm_token_type_ids=hf["mm_token_type_ids"],
                  image_grid_thw=hf.get("image_grid_thw"), video_grid_thw=hf.get("video_grid_thw"),
                  attention_mask=torch.ones_like(hf["input_ids"]))
    if spec.tokens_per_second and hf.get("second_per_grid_ts") is not None:
        kwargs["second_per_grid_ts"] = torch.as_tensor(hf["second_per_grid_ts"])
    with torch.no_grad():
        pos, _ = model.model.get_rope_index(**kwargs)
    model.model.rope_deltas = None
    return pos[:, 0].cpu().numpy()


def differences(ours: EncodedSample, hf: dict, tok, spec: ModelSpec,
                model: nn.Module) -> list[str]:
    """Each way vlpack's encoding `ours` differs from transformers' `hf` (processor output)."""
    out = []
    theirs = hf["input_ids"][0].numpy()
    mine = ours.input_ids
    if not np.array_equal(mine, theirs):
        n = min(len(mine), len(theirs))
        i = int(np.flatnonzero(mine[:n] != theirs[:n])[0]) if (mine[:n] != theirs[:n]).any() else n
        out.append(f"input ids differ at token {i} (vlpack {len(mine)} tokens, transformers "
                   f"{len(theirs)}): vlpack {_snippet(tok, mine, i)!r}, transformers "
                   f"{_snippet(tok, theirs, i)!r}")
    stamps = [_TIMESTAMP.findall(tok.decode(x.tolist())) for x in (mine, theirs)]
    if stamps[0] != stamps[1]:
        out.append(f"video timestamps (seconds) {stamps[0]} != transformers' {stamps[1]}")
    vis = ours.hf_visuals()
    for key, name in (("image_grid_thw", "image grids"), ("video_grid_thw", "video grids")):
        if _grid(vis[key]) != _grid(hf.get(key)):
            out.append(f"{name} {_grid(vis[key])} != transformers' {_grid(hf.get(key))}")
    if spec.tokens_per_second:
        a = [] if vis["second_per_grid_ts"] is None else np.asarray(vis["second_per_grid_ts"])
        b = hf.get("second_per_grid_ts")
        b = [] if b is None else np.asarray(b, dtype=np.float32)
        if len(a) != len(b) or not np.allclose(a, b, rtol=1e-6, atol=1e-6):
            out.append(f"second_per_grid {np.round(a, 6).tolist()} != transformers' "
                       f"second_per_grid_ts {np.round(b, 6).tolist()}")
    if out:
        return out  # positions compare only encodings that agree
    types = hf["mm_token_type_ids"][0].numpy()
    if not np.array_equal(ours.mm_token_type_ids, types):
        return ["token types (text/image/video) differ from transformers' mm_token_type_ids"]
    pos = mrope_positions(ours.mm_token_type_ids, ours.image_grid_thw, spec.merge_size,
                          ours.temporal_step)
    ref = _hf_positions(model, spec, hf)
    if not np.array_equal(pos, ref):
        i = int(np.flatnonzero((pos != ref).any(axis=0))[0])
        out.append(f"MRoPE positions differ from transformers' get_rope_index at token {i}: "
                   f"vlpack (t, h, w) {pos[:, i].tolist()}, transformers {ref[:, i].tolist()}")
    return out


def compare_encoding(folder: Path, convs: list[Conversation], spec: ModelSpec,
                     model: nn.Module) -> dict:
    """Each conversation encoded by vlpack (the folder's settings) and by transformers'
    processor, compared (`differences`). Returns `compared` (keys), `not_compared` (key →
    reason), `skipped` (why nothing was compared, or None) and `failures` (named lines)."""
    from vlpack.data.encode import Encoder
    from vlpack.data.template import load_template

    proc, no_video, skipped = build_processor(folder)
    report: dict = dict(compared=[], not_compared={}, skipped=skipped, failures=[])
    if proc is None:
        return report
    enc = Encoder(spec.family, tokenizer_path=str(folder), processor_path=str(folder),
                  chat_template=load_template("auto", folder),
                  tokens_per_second=spec.tokens_per_second)
    for conv in convs:
        if no_video and _videos(conv):
            report["not_compared"][conv.key] = no_video
            continue
        ours = enc.encode(conv)
        try:
            hf = _hf_inputs(proc, conv)
        except Exception as e:  # transformers refusing a sample is reported
            report["not_compared"][conv.key] = f"transformers' processor refused it: {e}"
            continue
        report["compared"].append(conv.key)
        report["failures"] += [f"encoding vs transformers: sample {conv.name}: {d}"
                               for d in differences(ours, hf, proc.tokenizer, spec, model)]
    return report
