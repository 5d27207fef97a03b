"""`vlpack eval`: generate the assistant turns of held-out conversations and score them.

Each supervised assistant turn of a conversation is one prompt: the conversation up to that
turn (earlier answers as the data has them), rendered by the run's encoder (its `data.*`
settings and `model.name`) exactly as training renders it, cut where that turn's labels start,
so the prompt ends with the generation header `<|im_start|>assistant\\n` (data/encode.py; a
Qwen3.5 model then writes its think block as it was trained to). transformers' `generate`
continues the prompts greedily in left-padded batches, stopping at the family's `<|im_end|>`
(or `<|endoftext|>`).

The model comes from where `vlpack export` takes it: a run folder or checkpoint is exported
(`export_checkpoint`, the frozen base rebuilt, LoRA folded in) into a temporary folder inside
the output folder, which loads as any transformers folder does; a run folder without
checkpoints uses its `hf` export; an exported folder loads directly. bf16 on a GPU, float32 on
the CPU.

Outputs: `predictions.jsonl` (one row per answer: the sample's `id`, the `turn` (index of
the assistant message), the `prompt` text, `reference`, `prediction`) and `metrics.json`
(answer_metrics.score).
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vlpack.data.media import DataFile
from vlpack.data.types import IGNORE_INDEX, BadSampleError, Conversation, EncodedSample
from vlpack.train.run import answer_metrics

log = logging.getLogger(__name__)

STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
"""The tokens that end an answer (the end of a turn, the end of a text)."""
_PADS = re.compile(r"(<\|image_pad\|>|<\|video_pad\|>)+")
MAX_NEW_TOKENS = 256
"""Longest answer generated unless told otherwise (`--max-new-tokens`)."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One assistant turn to generate: `sample` holds the tokens (and visuals) before it."""

    id: str
    """The sample's key."""
    turn: int
    """The index of the assistant message in the sample's messages."""
    sample: EncodedSample
    reference: str


def turn_prompts(conv: Conversation, encoder) -> Iterator[Prompt]:
    """A `Prompt` per supervised assistant turn of `conv`: the conversation up to and
    including that turn, with only that turn supervised, encoded and cut before its labels."""
    for i, m in enumerate(conv.messages):
        if m.role != "assistant" or not m.loss:
            continue
        msgs = (*(replace(p, loss=False) if p.role == "assistant" else p
                  for p in conv.messages[:i]), m)
        sample = encoder.encode(replace(conv, messages=msgs))
        cut = int(np.flatnonzero(sample.labels != IGNORE_INDEX)[0])
        prompt = replace(sample, input_ids=sample.input_ids[:cut],
                         labels=np.full(cut, IGNORE_INDEX, dtype=np.int64),
                         mm_token_type_ids=sample.mm_token_type_ids[:cut])
        text = "".join(c for c in m.content if isinstance(c, str))
        yield Prompt(conv.key, i, prompt, text)


def all_prompts(convs: Sequence[Conversation], encoder, *, what: str = "the data"
                ) -> list[Prompt]:
    """The prompts of every conversation; a ValueError (naming them `what`) when none has a
    supervised answer."""
    check_answers(convs, what)
    return [p for c in convs for p in turn_prompts(c, encoder)]


def check_answers(convs: Sequence[Conversation], source: str) -> None:
    """A ValueError naming the fix when no conversation has a supervised assistant turn."""
    if not any(m.role == "assistant" and m.loss for c in convs for m in c.messages):
        raise ValueError(f"{source} holds no assistant turns to generate (none, or all with "
                         '"loss": false): pass conversations that end with the answers to score')


def stop_ids(tokenizer) -> list[int]:
    """Ids of `STOP_TOKENS` the tokenizer has."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS]
    return [int(i) for i in ids if i is not None and i != tokenizer.unk_token_id]


def left_padded(samples: Sequence[EncodedSample], pad_id: int, spec) -> dict[str, torch.Tensor]:
    """transformers' inputs of `samples`, left-padded: input_ids, attention_mask,
    mm_token_type_ids [B, L] and the visuals (images then videos, in sample order)."""
    from vlpack.model.forward import stock_visuals

    L = max(len(s) for s in samples)
    ids = torch.full((len(samples), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), L), dtype=torch.long)
    types = torch.zeros((len(samples), L), dtype=torch.int32)
    for b, s in enumerate(samples):
        n = len(s)
        ids[b, L - n:] = torch.from_numpy(s.input_ids)
        mask[b, L - n:] = 1
        types[b, L - n:] = torch.from_numpy(s.mm_token_type_ids.astype(np.int32))
    visuals = [s.hf_visuals() for s in samples]
    cat = {k: [v[k] for v in visuals if v[k] is not None] for k in visuals[0]}
    return {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": types,
            **stock_visuals(spec, **{k: np.concatenate(v) if v else None
                                     for k, v in cat.items()})}


def generate(model: nn.Module, spec, encoder, prompts: Sequence[Prompt], *,
             max_new_tokens: int = MAX_NEW_TOKENS, prompts_per_batch: int = 8, synced_gpus: bool = False
             ) -> list[str]:
    """Greedy answers of `prompts` (decoded, special tokens dropped); see `generate_ids`."""
    ids = generate_ids(model, spec, encoder, prompts, max_new_tokens=max_new_tokens,
                       prompts_per_batch=prompts_per_batch, synced_gpus=synced_gpus)
    return [encoder.tokenizer.decode(row, skip_special_tokens=True) for row in ids]


@torch.no_grad()
def generate_ids(model: nn.Module, spec, encoder, prompts: Sequence[Prompt], *,
                 max_new_tokens: int = MAX_NEW_TOKENS, prompts_per_batch: int = 8,
                 synced_gpus: bool = False) -> list[list[int]]:
    """Greedy answer tokens of `prompts` (before the first stop token), `prompts_per_batch` at a
    time. `synced_gpus`: every rank of an FSDP-sharded model calls this with the same prompts
    and steps until all are done (transformers' flag for sharded weights)."""
    from transformers import GenerationConfig

    tok = encoder.tokenizer
    stops = stop_ids(tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[-1]
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                           eos_token_id=stops, pad_token_id=pad, use_cache=True)
    device = next(model.parameters()).device
    out: list[list[int]] = []
    for at in range(0, len(prompts), prompts_per_batch):
        inputs = left_padded([p.sample for p in prompts[at:at + prompts_per_batch]], pad, spec)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        model.model.rope_deltas = None  # transformers caches it on the module across calls
        ids = model.generate(**inputs, generation_config=gen, synced_gpus=synced_gpus)
        for row in ids[:, inputs["input_ids"].shape[1]:].tolist():
            end = next((j for j, t in enumerate(row) if t in stops), len(row))
            out.append(row[:end])
    return out


def predictions(prompts: Sequence[Prompt], answers: Sequence[str], tokenizer) -> list[dict]:
    """Rows of `predictions.jsonl` (each visual's pads written once, as a template writes them)."""
    return [{"id": p.id, "turn": p.turn,
             "prompt": _PADS.sub(r"\1", tokenizer.decode(p.sample.input_ids.tolist())),
             "reference": p.reference, "prediction": a}
            for p, a in zip(prompts, answers, strict=True)]


# ---------------------------------------------------------------------- vlpack eval


def _hf_folder(path: Path) -> bool:
    from vlpack.model.build import folder_has_weights

    return (path / "config.json").is_file() and folder_has_weights(path)


def check_source(source: str | Path) -> Path:
    """`source` as a Path; a ValueError naming the fix when it is no folder."""
    path = Path(source)
    if not path.is_dir():
        raise ValueError(f"{path} does not exist: pass a run folder (OUTPUT_DIR), one of its "
                         "checkpoints or an exported folder (vlpack export)")
    return path


def load(source: str | Path, export_to: Path, device: torch.device
         ) -> tuple[nn.Module, Any, Any, str]:
    """(model, spec, encoder, what was loaded) of a run folder, a checkpoint or an exported
    folder; a checkpoint is exported into `export_to` first (module docstring)."""
    from vlpack.config import Config, DataConfig, load_config
    from vlpack.data.setup import build_encoder
    from vlpack.model.build import build_model
    from vlpack.train.run import checkpoint as ckpt
    from vlpack.train.run.export import export_checkpoint, resolve, run_config

    path = check_source(source)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg: Config | None = None
    if (path / ckpt.MARKER).is_file() or ckpt.latest_checkpoint(path) is not None:
        folder = export_checkpoint(path, export_to, out_dtype=dtype)
        saved, run = resolve(path)
        cfg = run_config(run, int(ckpt.marker(saved)["step"]))
        what = str(saved)
    elif _hf_folder(path):
        folder, what = path, str(path)
    elif _hf_folder(path / "hf"):
        folder, what = path / "hf", str(path / "hf")
    else:
        raise ValueError(f"{path} holds no checkpoint (checkpoints/step_*/{ckpt.MARKER}), no "
                         "config.json with *.safetensors and no hf/ export: pass a run folder, "
                         "a checkpoint or a folder written by vlpack export (an adapter/ "
                         "folder alone has no base: pass its run folder)")
    if cfg is None and (folder.parent / "config.yaml").is_file():
        cfg = load_config(folder.parent / "config.yaml")  # RUN/hf: the run's data settings
    model, spec = build_model(str(folder), backend="sdpa", dtype=dtype, device=device)
    model.eval()
    if cfg is None:  # a folder on its own: its tokenizer, chat template and image settings
        return model, spec, build_encoder(DataConfig(), spec, str(folder)), what
    return model, spec, build_encoder(cfg.data, spec, cfg.model.name), what  # as trained


def evaluate(source: str | Path, data: DataFile | str | Path, out: str | Path | None = None, *,
             max_new_tokens: int = MAX_NEW_TOKENS, prompts_per_batch: int = 8, limit: int | None = None,
             device: str | None = None) -> Path:
    """`vlpack eval`: generate the answers of `data` (a JSONL file; a bare path: its media
    inside its folder) with the model of `source`, write `predictions.jsonl` and
    `metrics.json` into `out` (default SOURCE/eval) and return it."""
    from vlpack.data.sources import check_jsonl_path, read_jsonl

    file = DataFile.of(data)
    data = file.path
    check_jsonl_path(data)
    if max_new_tokens < 1 or prompts_per_batch < 1:
        raise ValueError("--max-new-tokens and --batch-size must be at least 1")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out_dir = Path(out) if out is not None else check_source(source) / "eval"
    convs = read_jsonl(file)[:limit]
    check_answers(convs, str(data))  # before the model is exported and loaded
    check_source(source)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".export-", dir=out_dir) as tmp:  # beside the output
        model, spec, encoder, what = load(source, Path(tmp), dev)
    prompts = all_prompts(convs, encoder, what=str(data))
    answers = generate(model, spec, encoder, prompts, max_new_tokens=max_new_tokens,
                       prompts_per_batch=prompts_per_batch)
    rows = predictions(prompts, answers, encoder.tokenizer)
    metrics = {"model": what, "data": str(data), "max_new_tokens": max_new_tokens,
               **answer_metrics.score((r["prediction"], r["reference"]) for r in rows)}
    with open(out_dir / "predictions.jsonl", "w") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(f"vlpack: {len(rows)} answers of {what}: exact match {metrics['exact_match']:.3f}, "
          f"token F1 {metrics['token_f1']:.3f}"
          + (f", JSON fields {metrics['field_accuracy']:.3f} ({metrics['unparsed']} unparsed)"
             if metrics.get("field_accuracy") is not None else "") + f"; wrote {out_dir}")
    return out_dir


# ---------------------------------------------------------------------- during training


class HeldOutGeneration:
    """`train.eval_generate_every`: the answers of the first `n` held-out samples, generated
    by the live training model and scored (`gen_exact_match`, `gen_token_f1`,
    `gen_field_accuracy`, `gen_unparsed`).

    Every rank calls it with the same prompts: an FSDP2-sharded model gathers its weights
    layer by layer in each forward, so all ranks generate together (`synced_gpus`) and each
    gets the same scores; rank 0's are logged. The model generates through stock attention
    (sdpa, switched for the call and back), in the loop's autocast, with compiled layers run
    eagerly (a decode step's cache state would recompile them until dynamo's limit)."""

    def __init__(self, eval_loader, encoder, n: int, max_new_tokens: int) -> None:
        if eval_loader is None:
            raise ValueError("train.eval_generate_every needs a held-out split, and this run has "
                             "none (data.eval_samples=0, data.mix or data.source=energon): set "
                             "data.eval_samples with a jsonl, hf or synthetic source")
        self.items, self.encoder, self.n = eval_loader.items, encoder, n
        self.max_new_tokens = max_new_tokens
        self.prompts: list[Prompt] | None = None

    def __call__(self, model: nn.Module, spec, world_size: int = 1) -> dict[str, Any]:
        from vlpack.model.build import set_attn_implementation

        if self.prompts is None:  # encoded once, at the first call
            convs = [c for c in self.items[:self.n] if isinstance(c, Conversation)]
            check_answers(convs, "the held-out samples")
            self.prompts = [p for c in convs for p in self._prompts(c)]
        attn, training = model.config._attn_implementation, model.training
        set_attn_implementation(model, "sdpa")
        model.eval()
        try:  # eager: compiled layers (model.compile) would recompile for each cache state
            with torch.compiler.set_stance("force_eager"):
                answers = generate(model, spec, self.encoder, self.prompts,
                                   max_new_tokens=self.max_new_tokens, synced_gpus=world_size > 1)
        finally:
            set_attn_implementation(model, attn)
            model.train(training)
        s = answer_metrics.score(zip(answers, (p.reference for p in self.prompts), strict=True))
        return {f"gen_{k}": s.get(k) for k in ("exact_match", "token_f1", "field_accuracy",
                                               "unparsed")}

    def _prompts(self, conv: Conversation) -> list[Prompt]:
        """The prompts of `conv`; none when it cannot be encoded (training skips it too)."""
        try:
            return list(turn_prompts(conv, self.encoder))
        except BadSampleError as e:
            log.warning("train.eval_generate_every leaves out a held-out sample: %s", e)
            return []
