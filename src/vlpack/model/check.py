"""`vlpack check`: prove on a model that one packed row equals its samples run one by one.

The packed side is vlpack's path (`packed_forward`, the chosen backend, boundary-aware GDN,
real-token MoE statistics). The reference is stock transformers: each sample alone, SDPA
attention, positions from the model's own get_rope_index, stock GDN kernels.

Tolerances (defaults, `TOLERANCES`):
  float32  — packed vs unpacked: max |Δlogits| ≤ 1e-4, per-sample |Δloss| / max(1, |loss|)
             ≤ 1e-5, gradient relative error per module group ≤ 1e-4, |Δ MoE aux loss| ≤ 1e-5.
  bfloat16 — the flash-attention rule against an fp32 run of the same weights: the packed bf16
             error is at most 2× the plain unpacked bf16 error (+ a small floor: logits 1e-3,
             loss 1e-4 relative, gradients 1e-3, aux 1e-3).
Exit status 1 above tolerance.

Legend: T = packed tokens, L = tokens of one sample, V = vocabulary.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from vlpack.data.batch import build_thd_batch
from vlpack.data.types import EncodedSample
from vlpack.model import attention, gdn, loss
from vlpack.model.build import ModelSpec, build_model, set_attn_implementation
from vlpack.model.forward import packed_forward, unpacked_forward
from vlpack.model.synthetic import default_mix

logger = logging.getLogger(__name__)

TOLERANCES = {
    "float32": dict(logits=1e-4, loss=1e-5, grad=1e-4, aux=1e-5),
    "bfloat16": dict(logits=1e-3, loss=1e-4, grad=1e-3, aux=1e-3),  # floors of the 2x rule
}
GROUPS = ("vision", "merger", "llm")


def param_group(name: str) -> str:
    """Module group of a parameter: vision tower, merger (incl. deepstack mergers), or LLM."""
    if ".visual." in f".{name}":
        return "merger" if "merger" in name else "vision"
    return "llm"


@dataclass
class Run:
    """Per-sample logits/losses, per-group gradients and MoE aux of one side of the check."""

    logits: list[torch.Tensor]
    losses: list[float]
    grads: dict[str, torch.Tensor]
    aux: float | None = None
    paths: dict[str, str] = field(default_factory=dict)
    topk: list[torch.Tensor] | None = None  # MoE: per sample [L, layers, k] chosen experts


def _topk(router_logits: list[torch.Tensor], k: int) -> torch.Tensor:
    """Sorted top-k expert ids of every token and layer: [L, layers, k]."""
    ids = [torch.topk(r.detach().float(), k, dim=-1).indices.sort(dim=-1).values
           for r in router_logits]
    return torch.stack(ids, dim=1).cpu()


def stable_tokens(*runs: Run) -> list[torch.Tensor] | None:
    """MoE: per sample, the tokens routed to the same experts in every layer of every run.

    In bf16 a near-tie between two router logits can flip one token's expert choice; that
    token's logits then differ by far more than rounding although no sample boundary leaked.
    Logit comparisons use the stable tokens; the flips are counted and reported."""
    if any(r.topk is None for r in runs):
        return None
    return [torch.stack([(r.topk[i] == runs[0].topk[i]).all(-1).all(-1) for r in runs]).all(0)
            for i in range(len(runs[0].topk))]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    flat: dict[str, list[torch.Tensor]] = {g: [] for g in GROUPS}
    for name, p in model.named_parameters():
        if p.grad is not None:
            flat[param_group(name)].append(p.grad.detach().float().reshape(-1).cpu())
    model.zero_grad(set_to_none=True)
    return {g: torch.cat(v) for g, v in flat.items() if v}


def run_packed(model, spec: ModelSpec, samples: list[EncodedSample], pad_to: int,
               total_len: int | None = None) -> Run:
    """vlpack's side: the samples packed into one row (aligned to `pad_to`, optionally padded
    to `total_len`), forward + backward of the summed loss."""
    batch = build_thd_batch(samples, pad_token_id=spec.pad_token_id, pad_to_multiple_of=pad_to,
                            total_len=total_len, spatial_merge_size=spec.merge_size)
    from vlpack.model.moe import RouterCapture

    batch = batch.to(next(model.parameters()).device)
    with RouterCapture(model) as cap:
        out = packed_forward(model, batch, spec=spec, return_logits=True)
    out.loss_sum.backward()
    logits, losses, topk = [], [], []
    for i in range(len(samples)):
        seg = batch.segment(i)
        lg = out.logits[seg].detach().float()
        logits.append(lg.cpu())
        losses.append(float(loss.plain_ce_sum(lg, batch.labels[seg])))
        if spec.is_moe:
            topk.append(_topk([r[seg] for r in cap.logits], spec.num_experts_per_tok))
    aux = None if out.aux_loss is None else float(out.aux_loss.detach())
    return Run(logits, losses, _grads(model), aux, out.paths, topk if spec.is_moe else None)


def _hf_aux(model: nn.Module, spec: ModelSpec, router_logits: list[list[torch.Tensor]]) -> float:
    """transformers' own load-balancing loss over the unpacked samples (pooled, no padding)."""
    import importlib

    mod = importlib.import_module(type(model).__module__)
    per_layer = tuple(torch.cat(layer) for layer in zip(*router_logits, strict=True))
    aux = mod.load_balancing_loss_func(per_layer, spec.num_experts, spec.num_experts_per_tok)
    return float(aux)


def run_unpacked(model, spec: ModelSpec, samples: list[EncodedSample]) -> Run:
    """The reference: stock transformers (SDPA attention, transformers' torch GDN kernels) on
    each sample alone, gradients summed."""
    from vlpack.model.moe import RouterCapture

    saved = model.config._attn_implementation
    set_attn_implementation(model, "sdpa")
    try:
        logits, losses, routers, topk = [], [], [], []
        with gdn.torch_reference():
            for s in samples:
                with RouterCapture(model) as cap:
                    out = unpacked_forward(model, s, spec=spec)
                out.loss_sum.backward()
                logits.append(out.logits.detach().float().cpu())
                losses.append(float(out.loss_sum.detach()))
                routers.append([r.detach() for r in cap.logits])
                if spec.is_moe:
                    topk.append(_topk(cap.logits, spec.num_experts_per_tok))
        aux = _hf_aux(model, spec, routers) if spec.is_moe else None
    finally:
        set_attn_implementation(model, saved)
    return Run(logits, losses, _grads(model), aux, topk=topk if spec.is_moe else None)


def compare(a: Run, b: Run, keep: list[torch.Tensor] | None = None) -> dict:
    """Differences of run `a` against reference `b` (logits on the `keep` tokens only)."""
    keep = keep or [torch.ones(len(x), dtype=torch.bool) for x in b.logits]
    logit = [float((x[m] - y[m]).abs().max()) if m.any() else 0.0
             for x, y, m in zip(a.logits, b.logits, keep, strict=True)]
    lossd = [abs(x - y) / max(1.0, abs(y)) for x, y in zip(a.losses, b.losses, strict=True)]
    grad = {g: float((a.grads[g] - b.grads[g]).norm() / (b.grads[g].norm() + 1e-30))
            for g in b.grads if g in a.grads}
    aux = None if a.aux is None or b.aux is None else abs(a.aux - b.aux)
    return dict(logits=logit, loss=lossd, grad=grad, aux=aux)


def load_samples(args, spec: ModelSpec) -> tuple[list[EncodedSample], str]:
    n = int(args.samples)
    if n < 1:
        raise ValueError("--samples must be >= 1")
    if not args.data:
        return default_mix(spec, n, seed=args.seed), "synthetic (multi-image, text-only, padded)"
    from vlpack.data.encode import Encoder
    from vlpack.data.sources import read_jsonl

    path = args.data
    if path == "synth":
        from vlpack.data.synth import default_dataset

        path = default_dataset(max(n, 16), seed=args.seed)
    convs = read_jsonl(Path(path))[:n]
    if not convs:
        raise ValueError(f"{path} holds no usable conversations")
    enc = Encoder(spec.family, max_pixels=64 * (spec.patch_size * spec.merge_size) ** 2)
    return [enc.encode(c) for c in convs], str(path)


def _free_bytes(dev: torch.device) -> int | None:
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _check_memory(model_name: str, dev: torch.device) -> None:
    """Refuse up front (instead of being killed) when the check cannot fit: it holds fp32
    weights, their gradients and one gradient copy per run (packed and unpacked)."""
    if Path(model_name).is_dir():  # a checkpoint folder: its size is checked by loading it
        return
    meta, _ = build_model(model_name, device="meta", dtype="float32")
    need = 4 * 4 * sum(p.numel() for p in meta.parameters())
    free = _free_bytes(dev)
    if free is not None and need > 0.9 * free:
        raise ValueError(
            f"vlpack check of {model_name} needs about {need / 2**30:.0f} GiB on {dev} (fp32 "
            f"weights, gradients and two gradient copies) but {free / 2**30:.0f} GiB is free: "
            "run it on a device with more memory, or check a smaller preset of the same family"
        )


def check(model_name: str, *, backend: str = "auto", dtype: str | None = None,
          samples: int = 4, seed: int = 0, data: str | None = None,
          device: str | None = None) -> dict:
    """Run the check; returns the report dict (see `check_command` for the CLI)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    if dtype not in TOLERANCES:
        raise ValueError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    _check_memory(model_name, dev)
    # Build in fp32; a bf16 check first records the fp32 reference of the same weights.
    model, spec = build_model(model_name, backend=backend, dtype=torch.float32, device=dev,
                              seed=seed)
    model.train()
    args = argparse.Namespace(samples=samples, seed=seed, data=data)
    batch_samples, source = load_samples(args, spec)
    pad_to = 8
    tol = TOLERANCES[dtype]
    report: dict = dict(model=spec.name, family=spec.family, backend=backend,
                        attn_implementation=spec.attn_implementation, dtype=dtype,
                        device=str(dev), samples=len(batch_samples), data=source,
                        tolerances=tol)
    attention.PATHS_USED.clear()
    gdn.PATHS_USED.clear()
    loss.PATHS_USED.clear()
    if dtype == "float32":
        packed = run_packed(model, spec, batch_samples, pad_to)
        ref = run_unpacked(model, spec, batch_samples)
        keep = stable_tokens(packed, ref)
        d = compare(packed, ref, keep)
        passed = (max(d["logits"]) <= tol["logits"] and max(d["loss"]) <= tol["loss"]
                  and all(v <= tol["grad"] for v in d["grad"].values())
                  and (d["aux"] is None or d["aux"] <= tol["aux"]))
    else:
        ref32 = run_unpacked(model, spec, batch_samples)
        model.to(torch.bfloat16)
        packed = run_packed(model, spec, batch_samples, pad_to)
        plain = run_unpacked(model, spec, batch_samples)
        keep = stable_tokens(packed, plain, ref32)
        d = compare(packed, plain, keep)
        dp, d0 = compare(packed, ref32, keep), compare(plain, ref32, keep)
        report["rule"] = dict(packed_vs_fp32=_summary(dp), plain_bf16_vs_fp32=_summary(d0))
        passed = _rule_ok(dp, d0, tol)
    report.update(
        per_sample=[dict(key=s.key, tokens=len(s), images=len(s.image_grid_thw),
                         max_logit_diff=d["logits"][i], loss_diff=d["loss"][i])
                    for i, s in enumerate(batch_samples)],
        grad_rel_diff=d["grad"],
        max_logit_diff=max(d["logits"]),
        max_loss_diff=max(d["loss"]),
        max_grad_rel_diff=max(d["grad"].values()) if d["grad"] else 0.0,
        moe_aux_diff=d["aux"],
        moe_routing_flips=None if keep is None else int(sum((~m).sum() for m in keep)),
        moe_aux_packed=packed.aux,
        paths=packed.paths,
        passed=bool(passed),
    )
    return report


def _summary(d: dict) -> dict:
    return dict(max_logit_diff=max(d["logits"]), max_loss_diff=max(d["loss"]),
                grad_rel_diff=d["grad"], moe_aux_diff=d["aux"])


def _rule_ok(dp: dict, d0: dict, tol: dict) -> bool:
    ok = max(dp["logits"]) <= 2 * max(d0["logits"]) + tol["logits"]
    ok &= max(dp["loss"]) <= 2 * max(d0["loss"]) + tol["loss"]
    ok &= all(dp["grad"][g] <= 2 * d0["grad"].get(g, 0.0) + tol["grad"] for g in dp["grad"])
    if dp["aux"] is not None:
        ok &= dp["aux"] <= 2 * d0["aux"] + tol["aux"]
    return bool(ok)


def _fmt(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2e}"


def format_report(r: dict) -> str:
    lines = [
        f"vlpack check: {r['model']} ({r['family']}) on {r['device']}, {r['dtype']}, "
        f"backend {r['backend']} -> {r['attn_implementation']}",
        f"data: {r['data']}, {r['samples']} samples packed into one row",
        "paths: " + ", ".join(f"{k}={v}" for k, v in sorted(r["paths"].items())),
        f"{'sample':<24} {'tokens':>6} {'images':>6} {'max|dlogit|':>12} {'dloss(rel)':>11}",
    ]
    for s in r["per_sample"]:
        lines.append(f"{s['key']:<24} {s['tokens']:>6} {s['images']:>6} "
                     f"{_fmt(s['max_logit_diff']):>12} {_fmt(s['loss_diff']):>11}")
    grads = ", ".join(f"{g}={_fmt(v)}" for g, v in r["grad_rel_diff"].items())
    lines.append(f"grad rel err: {grads}")
    if r["moe_aux_diff"] is not None:
        lines.append(f"MoE aux loss (real tokens) {r['moe_aux_packed']:.6f}, "
                     f"diff vs transformers {_fmt(r['moe_aux_diff'])}; tokens with an expert "
                     f"choice flipped by rounding (left out of the logit diff): "
                     f"{r['moe_routing_flips']}")
    if "rule" in r:
        p, q = r["rule"]["packed_vs_fp32"], r["rule"]["plain_bf16_vs_fp32"]
        lines.append(f"bf16 rule: packed vs fp32 logits {_fmt(p['max_logit_diff'])} "
                     f"(plain bf16 {_fmt(q['max_logit_diff'])}), loss {_fmt(p['max_loss_diff'])} "
                     f"(plain {_fmt(q['max_loss_diff'])})")
    lines.append("PASSED" if r["passed"] else f"FAILED (tolerances: {r['tolerances']})")
    return "\n".join(lines)


def check_command(args: argparse.Namespace) -> int:
    """CLI entry (`vlpack check`): 0 when packed == unpacked within tolerance, else 1."""
    r = check(args.model, backend=args.backend, dtype=args.dtype, samples=args.samples,
              seed=args.seed, data=args.data)
    print(json.dumps(r, default=float) if args.json else format_report(r))
    return 0 if r["passed"] else 1

