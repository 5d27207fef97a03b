"""`vlpack check --data`'s encoding check: vlpack's encoding of each sample against what
transformers' own processor makes of it.

For a checkpoint folder both sides read it: vlpack's `Encoder` with its tokenizer, chat
template, image and video settings (what `vlpack train` uses with `model.name=FOLDER`), and the
processor transformers builds from it (`AutoProcessor.from_pretrained`). For a preset, vlpack's
side is the check's encoder and the reference is the family's transformers processor class
built from vlpack's tokenizer, its image processor and the family's template
(`check/templates.py`); nothing is downloaded. The reference renders the conversation with
`apply_chat_template` (its tools included) and encodes the text, the images (loaded by
transformers' `load_image`) and the videos. Compared per sample, each difference a named
failure: input ids (tool-call text included), token types, image and video grids, the video
timestamps written into the text (qwen3 families), Qwen2.5-VL's `second_per_grid_ts`, the labels
(`chatml_labels` on the reference's ids: what a `"loss": false` turn leaves out included), and
the MRoPE positions (vlpack's `mrope_positions`, which the packed row uses) under both
`data.mrope_after_video` rules: against the model's own `get_rope_index` on the processor's
output, and that moved to Qwen's rule (`qwen_rule`).

Compared in part (labels and positions on vlpack's own ids and grids, and the timestamps of
qwen3-family frame lists against the processor's `_calculate_timestamps`; the report says why):
video samples where transformers' video processor cannot be built (it needs torchvision), and a
preset's video samples (its video settings are not handed to transformers' video processor).
Not compared, with the reason in the report: every sample when a folder has no processor
transformers can build or no chat template; a sample the processor refuses.

Legend: L = tokens of one sample.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from vlpack.check.processor import _hf_inputs, _image_only, _videos, build_processor
from vlpack.data.rope import mrope_positions
from vlpack.data.types import Conversation, EncodedSample
from vlpack.model.build import ModelSpec

if TYPE_CHECKING:
    from vlpack.data.encode import Encoder

_TIMESTAMP = re.compile(r"<(\d+(?:\.\d+)?) seconds>")


def _snippet(tok, ids: np.ndarray, i: int) -> str:
    return tok.decode(ids[max(0, i - 6) : i + 6].tolist())


def _grid(x) -> list:
    return [] if x is None else np.asarray(x).reshape(-1, 3).tolist()


def _vlpack_inputs(ours: EncodedSample) -> dict:
    """vlpack's encoding as the processor's output keys (for `get_rope_index`)."""
    vis = ours.hf_visuals()
    out = dict(input_ids=torch.as_tensor(ours.input_ids)[None],
               mm_token_type_ids=torch.as_tensor(ours.mm_token_type_ids.astype(np.int64))[None])
    for key in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts"):
        if vis[key] is not None:
            out[key] = torch.as_tensor(vis[key])
    return out


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


def qwen_rule(ref_3L: np.ndarray, types_L: np.ndarray) -> np.ndarray:
    """`ref_3L` (positions by transformers' rule) moved to Qwen's rule: each run of one token
    type starts one past the largest position before it (the released `get_rope_index` starts
    each text run at `llm_pos_ids_list[-1].max() + 1`); the two differ only after a span whose
    temporal extent exceeds its height and width."""
    out = ref_3L.copy()
    change = np.flatnonzero(np.diff(types_L)) + 1
    top = None
    for s, e in zip(np.concatenate(([0], change)).tolist(), np.concatenate((change, [len(types_L)])).tolist(),
                    strict=True):
        if top is not None:
            out[:, s:e] += top + 1 - out[:, s:e].min()
        top = int(out[:, s:e].max())
    return out


def chatml_labels(ids_L: np.ndarray, tok, losses: list[bool], supervise_empty_think: bool,
                  ) -> np.ndarray:
    """[L] labels by the ChatML rule, found on the token ids alone: after each
    `<|im_start|>assistant\\n` header up to and including its `<|im_end|>`, for the assistant
    turns whose `losses` entry is true (a `"loss": false` turn has none); without
    `supervise_empty_think` an empty think block opening the turn is left out."""
    from vlpack.data.template import EMPTY_THINK
    from vlpack.data.types import IGNORE_INDEX

    start_id, end_id = (tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    out = np.full(len(ids_L), IGNORE_INDEX, dtype=np.int64)
    turn = 0
    for s in np.flatnonzero(ids_L == start_id).tolist():
        j = s + 1  # the header's last token: the first that ends the role's line
        while j < len(ids_L) - 1 and "\n" not in tok.decode(ids_L[s + 1 : j + 1].tolist()):
            j += 1
        header = tok.decode(ids_L[s + 1 : j + 1].tolist())
        if not header.startswith("assistant\n"):
            continue
        a = j + 1 if header == "assistant\n" else j  # a token reaching past the header counts
        if not supervise_empty_think:
            for m in range(1, 9):
                if tok.decode(ids_L[a : a + m].tolist()) == EMPTY_THINK:
                    a += m
                    break
        ends = np.flatnonzero(ids_L[a:] == end_id)
        e = a + int(ends[0]) + 1 if len(ends) else len(ids_L)
        if turn < len(losses) and losses[turn]:
            out[a:e] = ids_L[a:e]
        turn += 1
    return out


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _same_encoding(ours: EncodedSample, hf: dict, tok, spec: ModelSpec) -> list[str]:
    """Each way vlpack's ids, timestamps, grids and `second_per_grid` differ from `hf`'s."""
    out = []
    theirs = hf["input_ids"][0].numpy()
    mine = ours.input_ids
    if not np.array_equal(mine, theirs):
        n = min(len(mine), len(theirs))
        i = _first(mine[:n] != theirs[:n]) if (mine[:n] != theirs[:n]).any() else n
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
    if not out and not np.array_equal(ours.mm_token_type_ids, hf["mm_token_type_ids"][0].numpy()):
        out.append("token types (text/image/video) differ from transformers' mm_token_type_ids")
    return out


def frame_timestamps(proc, conv: Conversation, spec: ModelSpec) -> list[str] | None:
    """The `<t seconds>` texts transformers' processor writes for a qwen3-family sample whose
    videos are all frame lists (its `_calculate_timestamps` over the frames, used whole, at
    their fps; no video processor needed), or None when that does not apply."""
    refs = _videos(conv)
    calc = getattr(proc, "_calculate_timestamps", None)
    if not refs or calc is None or any(v.path is not None for v in refs):
        return None
    from vlpack.families import family as family_of

    step = family_of(spec.family).temporal_patch_size
    return [f"{t:.1f}" for v in refs
            for t in calc(list(range(len(v.frames))), float(v.fps or 2.0), step)]


def differences(ours: EncodedSample, hf: dict | None, tok, spec: ModelSpec, model: nn.Module,
                losses: list[bool], supervise_empty_think: bool = True) -> list[str]:
    """Each way vlpack's encoding `ours` differs from transformers' `hf` (processor output;
    None when the processor could not take the sample: its labels and positions are then
    compared on vlpack's own ids and grids). `losses`: the `loss` of each assistant turn."""
    if hf is not None and (out := _same_encoding(ours, hf, tok, spec)):
        return out  # labels and positions compare only encodings that agree
    out = []
    inputs = _vlpack_inputs(ours) if hf is None else hf
    ids = inputs["input_ids"][0].numpy()
    ref = chatml_labels(ids, tok, losses, supervise_empty_think)
    if not np.array_equal(ours.labels, ref):
        i = _first(ours.labels != ref)
        out.append(f"labels differ at token {i} ({_snippet(tok, ids, i)!r}): vlpack "
                   f"{'labels it' if ours.labels[i] >= 0 else 'leaves it out'}, the ChatML rule "
                   f"{'labels it' if ref[i] >= 0 else 'leaves it out'} (assistant turns' loss: "
                   f"{losses})")
    tf = _hf_positions(model, spec, inputs)
    for rule, want in (("transformers", tf), ("qwen", qwen_rule(tf, ours.mm_token_type_ids))):
        pos = mrope_positions(ours.mm_token_type_ids, ours.image_grid_thw, spec.merge_size,
                              ours.temporal_step, after_video=rule)
        if not np.array_equal(pos, want):
            i = _first((pos != want).any(axis=0))
            out.append(f"MRoPE positions (mrope_after_video={rule}) differ from transformers' "
                       f"get_rope_index{'' if rule == 'transformers' else ' under Qwen rule'} at "
                       f"token {i}: vlpack (t, h, w) {pos[:, i].tolist()}, transformers "
                       f"{want[:, i].tolist()}")
    return out


def build_preset_processor(spec: ModelSpec, enc: Encoder
                           ) -> tuple[object | None, str, str | None]:
    """(processor, why its videos are not compared, why nothing is compared or None) for a
    preset: transformers' processor class of the family built from vlpack's tokenizer and
    image processor (`enc`'s settings) and the family's template (`templates`)."""
    import importlib.util

    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    from vlpack.check.templates import reference_template

    try:
        cls = _image_only(getattr(transformers, PROCESSOR_MAPPING_NAMES[spec.family]))
        proc = cls(image_processor=enc.image_processor, tokenizer=enc.tokenizer,
                   video_processor=None, chat_template=reference_template(spec.family))
    except Exception as e:  # any reason is reported; none is a check failure
        return None, "", (f"transformers cannot build the {spec.family} processor from vlpack's "
                          f"tokenizer and image settings: {e}")
    no_video = ("transformers' video processor needs torchvision, which does not import here"
                if importlib.util.find_spec("torchvision") is None else
                "a preset's video settings are not handed to transformers' video processor "
                "(check a folder with --model DIR to compare videos)")
    return proc, no_video, None


def compare_encoding(folder: Path | None, convs: list[Conversation], spec: ModelSpec,
                     model: nn.Module, enc: Encoder | None = None) -> dict:
    """Each conversation encoded by vlpack and by transformers' processor, compared
    (`differences`): a folder's own settings on both sides, or for a preset (`folder` None) the
    check's encoder `enc` and the processor `build_preset_processor` makes of its settings.
    Returns `compared` (keys), `partly` (key -> what was not compared and why; labels and
    positions were, on vlpack's encoding), `not_compared` (key -> reason), `skipped` (why
    nothing was compared, or None) and `failures` (named lines)."""
    from vlpack.config import DataConfig
    from vlpack.data.encode import Encoder

    if folder is None:
        if enc is None:
            raise ValueError("compare_encoding: a preset (folder=None) is compared on the "
                             "check's own encoding: pass its encoder as enc=")
        proc, no_video, skipped = build_preset_processor(spec, enc)
    else:
        proc, no_video, skipped = build_processor(folder)
    report: dict = dict(compared=[], partly={}, not_compared={}, skipped=skipped, failures=[])
    if proc is None:
        return report
    if folder is not None:
        enc = Encoder.from_config(DataConfig(tokenizer=str(folder)), spec.family, folder,
                                  tokens_per_second=spec.tokens_per_second)
    for conv in convs:
        ours = enc.encode(conv)
        hf = None
        if no_video and _videos(conv):
            stamps = frame_timestamps(proc, conv, spec)
            report["partly"][conv.key] = (
                f"ids and grids not compared: {no_video}; labels and positions compared on "
                "vlpack's encoding" + ("" if stamps is None else ", the timestamps with "
                                       "transformers' _calculate_timestamps"))
            mine = _TIMESTAMP.findall(proc.tokenizer.decode(ours.input_ids.tolist()))
            if stamps is not None and mine != stamps:
                report["failures"].append(f"encoding vs transformers: sample {conv.name}: video "
                                          f"timestamps (seconds) {mine} != transformers' {stamps}")
        else:
            try:
                hf = _hf_inputs(proc, conv)
            except Exception as e:  # transformers refusing a sample is reported
                report["not_compared"][conv.key] = f"transformers' processor refused it: {e}"
                continue
        report["compared"].append(conv.key)
        losses = [m.loss for m in conv.messages if m.role == "assistant"]
        report["failures"] += [
            f"encoding vs transformers: sample {conv.name}: {d}"
            for d in differences(ours, hf, proc.tokenizer, spec, model, losses,
                                 enc.supervise_empty_think)]
    return report
