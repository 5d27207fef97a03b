"""`vlpack check`: prove on a model that a packed row keeps its samples apart.

The packed side is vlpack's path (`packed_forward`, the chosen backend, boundary-aware GDN,
real-token MoE statistics). The reference is stock transformers: each sample alone, SDPA
attention, positions from the model's own get_rope_index, stock GDN kernels, and the loss of the
model's own `model(..., labels=...)` call (transformers shifts the labels itself).
This module runs the comparison on a built model (`run_check`) and writes the report;
check/command.py builds the model through train/setup/stack.py and is the command's entry.

What is checked, every item a failure with its name when it does not hold:
  contract (always in float32, with the reference kernels of the device):
    - packed vs unpacked: max |Δlogits|, per-sample |Δloss| / max(1, |loss|), the gradient
      relative error of every parameter (against a floor, `GRAD_FLOOR`; reported per group:
      vision, merger, llm, experts, router) and |Δ MoE aux loss|, within
      `TOLERANCES["float32"]`;
    - every parameter with a non-zero gradient on one side has one on the other;
    - the vision tower's features per item, packed vs stock, within `vision.VISION_TOL`
      of their norm, and a self-test that perturbed vision positions move them well past it
      (check/vision.py: on a small random model they barely move the logits);
    - the reference's label shift: its per-sample token-mean loss equals transformers' own;
    - a second, different bin (samples reversed, other alignment, extra tail padding) gives
      the same per-sample logits and aux loss: no state kept from the first forward;
    - isolation: the tokens and pixels of one sample changed, every other sample's final
      hidden states (hence logits) stay within `ISOLATION` (bitwise where the kernels run per
      segment).
  bfloat16 (`--dtype bfloat16`, the default on CUDA) adds, under bf16 autocast over the same
  float32 weights:
    - the flash-attention rule: the packed bf16 error against the fp32 reference is at most
      2× the plain unpacked bf16 error, plus a floor (`TOLERANCES["bfloat16"]`);
    - the parameters' gradients and isolation as above, in bf16.
Exit status: 0 passed, 1 failed, 2 could not run (bad arguments, unsupported backend, too
little memory, a model that did not build).

Legend: T = packed tokens, L = tokens of one sample, V = vocabulary.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from vlpack.check import vision as cv
from vlpack.check.data import CheckUnsupportedError, format_data, load_samples
from vlpack.data.batch import build_thd_batch
from vlpack.data.media import DataFile
from vlpack.data.types import IGNORE_INDEX, TOKEN_TYPE_TEXT, EncodedSample
from vlpack.model import loss
from vlpack.model.bounds import StaleVisionTablesError
from vlpack.model.build import ModelSpec
from vlpack.model.context import ContextGroup
from vlpack.model.forward import packed_forward, unpacked_forward
from vlpack.model.moe import RouterCapture
from vlpack.model.reference import stock_reference
from vlpack.model.seams import classes_of
from vlpack.model.synthetic import special_ids, text_id_range

TOLERANCES = {
    "float32": dict(logits=1e-4, loss=1e-5, grad=1e-4, aux=1e-5),
    "bfloat16": dict(logits=1e-3, loss=1e-4, grad=1e-3, aux=1e-3),  # floors of the 2x rule
}
ISOLATION = {"float32": 1e-6, "bfloat16": 1e-5}
"""Largest |Δ final hidden state| of the other samples when one sample of the row is changed: far below the
rounding of either dtype, so a leak of any size fails."""
LABEL_SHIFT_TOL = 1e-5
"""Relative difference allowed between the reference's token-mean loss and transformers'."""
GRAD_FLOOR = {"float32": 5.0, "bfloat16": 5.0}
"""Absolute floor of a parameter's gradient error: the error is taken relative to the larger of
the parameter's own reference norm and this multiple of its even share of the whole reference
gradient's norm (‖g‖·√(n_p/n)), so a parameter whose true gradient is near zero cannot fail on
rounding alone. fp32: the largest rounding error measured on the six tiny presets is 5e-5 of
a parameter's even share (Qwen3.5's first `A_log`, whose own gradient is far smaller), so the
floor times the 1e-4 tolerance (5e-4) is 10× that noise."""
MAX_NAMED = 6
"""Failing parameters named one by one per item; the rest are counted."""
GROUPS = ("vision", "merger", "llm", "experts", "router")
EXIT_PASSED, EXIT_FAILED, EXIT_COULD_NOT_RUN = 0, 1, 2


def param_groups(model: nn.Module) -> dict[str, str]:
    """Group of every parameter: vision tower, merger (incl. deepstack mergers), MoE router,
    routed experts, or the rest of the LLM."""
    owner: dict[str, str] = {}
    cls = classes_of(model)
    for mname, m in model.named_modules():
        if cls.router is not None and isinstance(m, cls.router):
            kind = "router"
        elif cls.experts is not None and isinstance(m, cls.experts):
            kind = "experts"
        else:
            continue
        for pname, _ in m.named_parameters():
            owner[f"{mname}.{pname}" if mname else pname] = kind
    out = {}
    for name, _ in model.named_parameters():
        if ".visual." in f".{name}":
            out[name] = "merger" if "merger" in name else "vision"
        else:
            out[name] = owner.get(name, "llm")
    return out


@dataclass
class Run:
    """Per-sample logits/losses, every parameter's gradient (flattened, float32, by name; a
    parameter without one is absent) and MoE aux of one side of the check. `groups`: each
    parameter's group (`param_groups`). `hf_losses`: transformers' own token-mean loss per
    sample (reference side only)."""

    logits: list[torch.Tensor]
    losses: list[float]
    grads: dict[str, torch.Tensor]
    aux: float | None = None
    paths: dict[str, str] = field(default_factory=dict)
    topk: list[torch.Tensor] | None = None  # MoE: per sample [L, layers, k] chosen experts
    hf_losses: list[float | None] | None = None
    label_counts: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] | None = None  # packed side: per sample [L, H] final hidden states
    groups: dict[str, str] = field(default_factory=dict)
    loss_total: float | None = None  # the packed path's own summed loss of the row
    own_shift: list[float] | None = None  # reference: CE of its logits with vlpack's label shift
    vision: list[list[torch.Tensor]] | None = None  # per sample, its items' tower features [M, C]


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


def _grads(model: nn.Module, context: ContextGroup | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, flattened in float32 on the host (summed over the ranks of
    a context-parallel `context`); a parameter without a gradient is absent. Clears them."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad if context is None else context.all_reduce(p.grad)
            out[name] = g.detach().float().reshape(-1).cpu()
    model.zero_grad(set_to_none=True)
    return out


def _pack(spec: ModelSpec, samples: list[EncodedSample], pad_to: int, total_len: int | None):
    # the stock model's MRoPE rule: the unpacked side runs its get_rope_index
    return build_thd_batch(samples, pad_token_id=spec.pad_token_id, pad_to_multiple_of=pad_to,
                           total_len=total_len, spatial_merge_size=spec.merge_size,
                           mrope_after_video="transformers")


def _forward_row(model, spec: ModelSpec, batch, context: ContextGroup | None, *,
                 logits: bool, cap: RouterCapture):
    """One packed forward → (its output, logits [T, V] or None, hidden [T, H], router logits
    per layer [T, E], aux loss or None), all of the whole row: with a context-parallel
    `context` each rank computes its share and the row's are gathered (the aux shares
    summed)."""
    out = packed_forward(model, batch, spec=spec, return_logits=logits, return_hidden=True,
                         context=context)
    aux = out.aux_loss
    if context is None or context.size == 1:
        return out, out.logits, out.hidden, cap.logits, aux
    row = lambda x: None if x is None else out.split.gather_row(x.detach())  # noqa: E731
    aux = None if aux is None else context.all_reduce(aux)
    return out, row(out.logits), row(out.hidden), [row(r) for r in cap.logits], aux


def run_packed(model, spec: ModelSpec, samples: list[EncodedSample], pad_to: int,
               total_len: int | None = None, backward: bool = True,
               context: ContextGroup | None = None) -> Run:
    """vlpack's side: the samples packed into one row (aligned to `pad_to`, optionally padded
    to `total_len`), forward (+ backward of the summed loss); split over the ranks of a
    context-parallel `context` (the row's logits gathered, the gradients summed)."""
    batch = _pack(spec, samples, pad_to, total_len).to(next(model.parameters()).device)
    with torch.set_grad_enabled(backward), RouterCapture(model) as cap, \
            cv.VisionCapture(model, spec.merge_size) as seen:
        out, logits_TV, hidden_TH, routers, aux = _forward_row(model, spec, batch, context,
                                                              logits=True, cap=cap)
    if backward:
        out.loss_sum.backward()
    total = out.loss_sum.detach()
    total = float(total if context is None or context.size == 1 else context.all_reduce(total))
    logits, losses, topk, hidden = [], [], [], []
    for i in range(len(samples)):
        seg = batch.segment(i)
        lg = logits_TV[seg].detach().float()
        logits.append(lg.cpu())
        hidden.append(hidden_TH[seg].detach().float().cpu())
        with torch.no_grad():  # the path's own loss function, on this sample's rows
            losses.append(float(loss.linear_ce_sum(hidden_TH[seg].detach(), model.lm_head,
                                                   batch.labels[seg])[0]))
        if spec.is_moe:
            topk.append(_topk([r[seg] for r in routers], spec.num_experts_per_tok))
    aux = None if aux is None else float(aux.detach())
    grads = _grads(model, context) if backward else {}
    # a context-parallel rank encodes only its share of the row's images: features not compared
    vision = cv.packed_items(seen.calls, samples) if context is None else None
    return Run(logits, losses, grads, aux, out.paths, topk if spec.is_moe else None,
               hidden=hidden, groups=param_groups(model), loss_total=total, vision=vision)


def _hf_aux(model: nn.Module, spec: ModelSpec, router_logits: list[list[torch.Tensor]]) -> float:
    """transformers' own load-balancing loss over the unpacked samples (pooled, no padding)."""
    import importlib

    mod = importlib.import_module(type(model).__module__)
    per_layer = tuple(torch.cat(layer) for layer in zip(*router_logits, strict=True))
    aux = mod.load_balancing_loss_func(per_layer, spec.num_experts, spec.num_experts_per_tok)
    return float(aux)


def run_unpacked(model, spec: ModelSpec, samples: list[EncodedSample]) -> Run:
    """The reference: stock transformers code only (`reference.stock_reference`: the stock
    classes of every seam, SDPA attention, transformers' experts and its torch GDN kernels even
    where fla is importable) on each sample alone, gradients summed; the loss and its gradient
    are transformers' own `labels=` loss per sample."""
    with stock_reference(model):
        logits, losses, routers, topk, hf, counts, own, vision = [], [], [], [], [], [], [], []
        for s in samples:
            with RouterCapture(model) as cap, cv.VisionCapture(model, spec.merge_size) as seen:
                out = unpacked_forward(model, s, spec=spec, hf_labels=True)
            vision.append(cv.reference_items(seen.calls, s))
            # transformers' own loss: its token mean times the targets its shift leaves
            n_hf = int((s.labels[1:] != IGNORE_INDEX).sum())
            ref_sum = out.loss_sum if out.hf_loss is None else out.hf_loss.float() * n_hf
            ref_sum.backward()
            logits.append(out.logits.detach().float().cpu())
            losses.append(float(ref_sum.detach()))
            own.append(float(out.loss_sum.detach()))
            counts.append(out.num_label_tokens)
            hf.append(None if out.hf_loss is None else float(out.hf_loss.detach()))
            routers.append([r.detach() for r in cap.logits])
            if spec.is_moe:
                topk.append(_topk(cap.logits, spec.num_experts_per_tok))
        aux = _hf_aux(model, spec, routers) if spec.is_moe else None
    return Run(logits, losses, _grads(model), aux, topk=topk if spec.is_moe else None,
               hf_losses=hf, label_counts=counts, groups=param_groups(model),
               loss_total=sum(losses), own_shift=own, vision=vision)


def _nonzero(g: torch.Tensor | None) -> bool:
    return g is not None and bool(g.ne(0).any())


def compare_grads(a: Run, b: Run, floor: float) -> dict:
    """Every parameter's gradient in run `a` against reference `b`:
      params: name → ‖a − b‖ / max(‖b‖, floor·‖b_all‖·√(n_p/n_all)) for the parameters with a
              non-zero gradient on both sides (`GRAD_FLOOR` says why the floor);
      missing: name → the side whose gradient is the only non-zero one (the other has None,
               none at all, or zeros);
      grad: per group, the summary ‖a_g − b_g‖ / ‖b_g‖ over its parameters in `params`;
      worst: per group, its parameter with the largest error in `params`."""
    ref = {n: g for n, g in b.grads.items() if _nonzero(g)}
    n_all = sum(g.numel() for g in ref.values()) or 1
    total = math.sqrt(sum(float(g.double().square().sum()) for g in ref.values()))
    params, missing = {}, {}
    for name in sorted(set(a.grads) | set(b.grads)):
        x, y = a.grads.get(name), b.grads.get(name)
        if _nonzero(x) != _nonzero(y):
            missing[name] = "reference" if _nonzero(y) else "packed"
        elif _nonzero(y):
            scale = max(float(y.norm()), floor * total * math.sqrt(y.numel() / n_all), 1e-30)
            params[name] = float((x - y).norm()) / scale
    groups = b.groups or a.groups
    grad, worst = {}, {}
    for g in GROUPS:
        names = [n for n in params if groups.get(n, "llm") == g]
        if not names:
            continue
        num = math.sqrt(sum(float((a.grads[n] - b.grads[n]).double().square().sum())
                            for n in names))
        den = math.sqrt(sum(float(b.grads[n].double().square().sum()) for n in names))
        grad[g] = num / max(den, 1e-30)
        top = max(names, key=params.__getitem__)
        worst[g] = dict(name=top, rel_diff=params[top])
    return dict(params=params, missing=missing, grad=grad, worst=worst, groups=groups)


def compare(a: Run, b: Run, keep: list[torch.Tensor] | None = None,
            floor: float = GRAD_FLOOR["float32"]) -> dict:
    """Differences of run `a` against reference `b` (logits on the `keep` tokens only) and
    every parameter's gradient (`compare_grads`, with the absolute `floor`)."""
    keep = keep or [torch.ones(len(x), dtype=torch.bool) for x in b.logits]
    logit = [float((x[m] - y[m]).abs().max()) if m.any() else 0.0
             for x, y, m in zip(a.logits, b.logits, keep, strict=True)]
    lossd = [abs(x - y) / max(1.0, abs(y)) for x, y in zip(a.losses, b.losses, strict=True)]
    ta, tb = (sum(r.losses) if r.loss_total is None else r.loss_total for r in (a, b))
    g = compare_grads(a, b, floor)
    aux = None if a.aux is None or b.aux is None else abs(a.aux - b.aux)
    vision = None if a.vision is None or b.vision is None else cv.compare_items(a.vision, b.vision)
    return dict(logits=logit, loss=lossd, loss_total=abs(ta - tb) / max(1.0, abs(tb)),
                vision=vision,
                loss_value=dict(packed=ta, reference=tb),
                grad=g["grad"], grad_params=g["params"],
                grad_worst=g["worst"], params_missing=g["missing"], aux=aux,
                groups=g["groups"])


def _other_bin(samples: list[EncodedSample], cp: int = 1) -> tuple[list[EncodedSample], int, int]:
    """The samples reversed, aligned to 3 (to 3·2·cp under context parallelism, whose
    segments are multiples of 2·cp) and padded by 11 more tokens (by one more alignment unit):
    another layout of the same samples (samples, pad_to, total_len)."""
    align = 3 if cp == 1 else 6 * cp
    extra = 11 if cp == 1 else align
    return samples[::-1], align, sum(-(-len(s) // align) * align for s in samples) + extra


def pad_unit(cp: int) -> int:
    """The check's sample alignment: 8, or the least multiple of 8 and 2·cp."""
    return math.lcm(8, 2 * cp)


def _perturbed(spec: ModelSpec, s: EncodedSample, rng: np.random.Generator) -> EncodedSample:
    """`s` with every plain text token replaced by another id and noise added to its pixels;
    same length, same images and token types, so the row's layout does not move."""
    ids = s.input_ids.copy()
    text = (s.mm_token_type_ids == TOKEN_TYPE_TEXT) & ~np.isin(ids, list(special_ids(spec)))
    lo, hi = text_id_range(spec)
    ids[text] = lo + (ids[text] - lo + rng.integers(1, hi - lo, size=int(text.sum()))) % (hi - lo)
    labels = np.where(s.labels != IGNORE_INDEX, ids, IGNORE_INDEX)
    pixels = None if s.pixel_values is None else \
        s.pixel_values + rng.standard_normal(s.pixel_values.shape).astype(s.pixel_values.dtype)
    return replace(s, input_ids=ids, labels=labels, pixel_values=pixels)


def _hidden(model, spec: ModelSpec, samples: list[EncodedSample], pad_to: int,
            total_len: int | None = None, context: ContextGroup | None = None):
    """Per-sample final hidden states [L, H] of one packed forward without gradients (no labels,
    no loss: the logits are a row-wise function of them), each token's chosen experts (MoE) and
    the kernels that ran."""
    unlabelled = [replace(s, labels=np.full_like(s.labels, IGNORE_INDEX)) for s in samples]
    batch = _pack(spec, unlabelled, pad_to, total_len).to(next(model.parameters()).device)
    with torch.no_grad(), RouterCapture(model) as cap:
        out, _, hidden_TH, routers, _ = _forward_row(model, spec, batch, context, logits=False,
                                                     cap=cap)
    segs = [batch.segment(i) for i in range(len(samples))]
    hidden = [hidden_TH[seg].float().cpu() for seg in segs]
    topk = [_topk([r[seg] for r in routers], spec.num_experts_per_tok) for seg in segs] \
        if spec.is_moe else None
    return hidden, topk, out.paths


def isolation(model, spec: ModelSpec, samples: list[EncodedSample], pad_to: int,
              seed: int = 0, context: ContextGroup | None = None) -> dict:
    """Change one sample of the row at a time (tokens and pixels) and measure how far every
    OTHER sample's final hidden states move: zero when no layer lets samples see each other.
    Then the samples reversed in another layout, then the first row again: `repeat_diff` is how
    far that repeat moved from the first run (state kept from an earlier forward moves it).
    All forwards run without gradients, so they run the same kernels.

    MoE: tokens whose expert choice changed between the runs are left out (a changed token
    changes the experts' batches, not what a token can see); they are counted."""
    rng = np.random.default_rng(seed)
    cp = 1 if context is None else context.size
    base, base_topk, paths = _hidden(model, spec, samples, pad_to, context=context)
    worst, per, flips = 0.0, [], 0
    for j in range(len(samples)):
        changed = list(samples)
        changed[j] = _perturbed(spec, samples[j], rng)
        hidden, topk, _ = _hidden(model, spec, changed, pad_to, context=context)
        d = 0.0
        for i in range(len(samples)):
            if i == j:
                continue
            m = torch.ones(len(base[i]), dtype=torch.bool) if topk is None else \
                (topk[i] == base_topk[i]).all(-1).all(-1)
            flips += int((~m).sum())
            if m.any():
                d = max(d, float((base[i][m] - hidden[i][m]).abs().max()))
        per.append(dict(changed=samples[j].key, max_hidden_diff=d))
        worst = max(worst, d)
    _hidden(model, spec, *_other_bin(samples, cp), context=context)
    again, _, _ = _hidden(model, spec, samples, pad_to, context=context)
    repeat = max(float((a - b).abs().max()) for a, b in zip(again, base, strict=True))
    return dict(max_diff=worst, per_sample=per, routing_flips=flips if spec.is_moe else None,
                repeat_diff=repeat, paths=paths)


def refuse_unsupported(backend: str, dtype: str, dev: torch.device) -> None:
    """`CheckUnsupportedError` for a `--dtype` without tolerances or a backend `dev` cannot run."""
    if dtype not in TOLERANCES:
        raise CheckUnsupportedError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    if backend == "flex" and dev.type != "cuda":
        raise CheckUnsupportedError(
            f"--backend flex is not supported on {dev.type}: FlexAttention's document mask "
            "needs a CUDA device here; use --backend auto (per-segment SDPA on CPU) or run on a GPU"
        )


def _contract_failures(label: str, d: dict, tol: dict) -> list[str]:
    """Named failures of one comparison against fixed tolerances."""
    out = []
    if max(d["logits"]) > tol["logits"]:
        out.append(f"{label}: max |dlogits| {max(d['logits']):.2e} > {tol['logits']:.0e}")
    out += [f"{label}: sample {i} loss {d['loss'][i]:.2e} from the reference's (relative) > "
            f"{tol['loss']:.0e}" for i in range(len(d["loss"])) if d["loss"][i] > tol["loss"]]
    if d["loss_total"] > tol["loss"]:
        out.append(f"{label}: the row's loss {d['loss_value']['packed']:.6g} vs the reference's "
                   f"{d['loss_value']['reference']:.6g}: {d['loss_total']:.2e} > {tol['loss']:.0e}")
    out += _named(f"{label}: gradient rel. error", {
        n: f"{v:.2e} > {tol['grad']:.0e}" for n, v in _worst_first(d["grad_params"])
        if v > tol["grad"]})
    if d["aux"] is not None and d["aux"] > tol["aux"]:
        out.append(f"{label}: MoE aux loss diff {d['aux']:.2e} > {tol['aux']:.0e}")
    return out + _group_failures(label, d)


def _worst_first(errors: dict[str, float]) -> list[tuple[str, float]]:
    """(name, error) pairs, the largest error first."""
    return sorted(errors.items(), key=lambda kv: -kv[1])


def _named(head: str, items: dict[str, str]) -> list[str]:
    """One failure line per parameter for the first `MAX_NAMED` of `items` (callers give them
    worst first), then a count of the rest."""
    names = list(items)[:MAX_NAMED]
    out = [f"{head} of {n}: {items[n]}" for n in names]
    if len(items) > len(names):
        out.append(f"{head}: {len(items) - len(names)} more parameters")
    return out


def _group_failures(label: str, d: dict) -> list[str]:
    """A parameter with a (non-zero) gradient on one side only, by name."""
    missing = d["params_missing"]
    lines = [f"{label}: parameter {n} gets a gradient on the {side} side only (the other's "
             "is None, absent or zero)" for n, side in list(missing.items())[:MAX_NAMED]]
    if len(missing) > MAX_NAMED:
        lines.append(f"{label}: {len(missing) - MAX_NAMED} more parameters get a gradient on "
                     "one side only")
    return lines


def _rule_failures(dp: dict, d0: dict, tol: dict) -> list[str]:
    """The bf16 rule: packed error vs fp32 at most 2x the plain bf16 error + the floor."""
    out = []
    for key, name in (("logits", "max |dlogits|"), ("loss", "per-sample loss diff")):
        bound = 2 * max(d0[key]) + tol[key]
        if max(dp[key]) > bound:
            out.append(f"bf16 rule: {name} vs fp32 {max(dp[key]):.2e} > {bound:.2e} "
                       f"(2x plain bf16 {max(d0[key]):.2e} + {tol[key]:.0e})")
    bound = 2 * d0["loss_total"] + tol["loss"]
    if dp["loss_total"] > bound:
        out.append(f"bf16 rule: the row's loss vs fp32 {dp['loss_total']:.2e} > {bound:.2e} "
                   f"(2x plain bf16 {d0['loss_total']:.2e} + {tol['loss']:.0e})")
    # per parameter, against the larger of its own plain-bf16 error and the model's bf16 noise
    # level (the largest plain-bf16 parameter error): two bf16 runs round independently. The
    # routed experts and routers get twice that: under autocast the stock experts keep float32
    # weights while vlpack's run in bf16, and a token whose expert choice a near-tie flips
    # moves its whole contribution from one expert to another
    level = max(d0["grad_params"].values(), default=0.0)
    groups = dp.get("groups", {})
    bounds = {n: (4 if groups.get(n) in ("experts", "router") else 2)
              * max(d0["grad_params"].get(n, 0.0), level) + tol["grad"]
              for n in dp["grad_params"]}
    out += _named("bf16 rule: gradient rel. error vs fp32", {
        n: f"{v:.2e} > {bounds[n]:.2e} (plain bf16 {d0['grad_params'].get(n, 0.0):.2e}, "
           f"bf16 level {level:.2e})" for n, v in _worst_first(dp["grad_params"]) if v > bounds[n]})
    if dp["aux"] is not None and dp["aux"] > 2 * d0["aux"] + tol["aux"]:
        out.append(f"bf16 rule: MoE aux diff vs fp32 {dp['aux']:.2e} > "
                   f"{2 * d0['aux'] + tol['aux']:.2e}")
    return out


def _label_failures(ref: Run) -> list[str]:
    """The reference's loss (vlpack's label shift) against transformers' own `labels=` loss."""
    out = []
    for i, (ours, n, hf) in enumerate(zip(ref.own_shift, ref.label_counts, ref.hf_losses,
                                          strict=True)):
        if n == 0:
            continue
        if hf is None:  # transformers' loss of a sample with labels came out NaN or inf
            out.append(f"label shift: sample {i} has {n} label tokens but transformers' labels= "
                       "loss is not finite")
            continue
        if abs(ours / n - hf) > LABEL_SHIFT_TOL * max(1.0, abs(hf)):
            out.append(f"label shift: sample {i} token-mean loss {ours / n:.6f} != "
                       f"transformers' labels= loss {hf:.6f}")
    return out


@contextlib.contextmanager
def _cuda_norm_policy(model: nn.Module, dev: torch.device) -> Iterator[None]:
    """On a CPU, every `nn.LayerNorm` of `model` takes its input in float32 while the block
    runs, so CPU autocast normalises in float32 as CUDA autocast does (its float32 list); CPU
    autocast would normalise a bf16 input in bf16, whose backward sums the bias gradient over
    the call's tokens in low precision, so a packed row's one call over all its patches loses
    more than the reference's call per sample. Nothing changes on a GPU."""
    hooks = [] if dev.type != "cpu" else [
        m.register_forward_pre_hook(lambda _, args: (args[0].float(), *args[1:]))
        for m in model.modules() if isinstance(m, nn.LayerNorm)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _isolation_failures(label: str, iso: dict, bound: float) -> list[str]:
    return [f"{label}: changing sample {p['changed']!r} moved the other samples' hidden "
            f"states by {p['max_hidden_diff']:.2e} > {bound:.0e}"
            for p in iso["per_sample"] if p["max_hidden_diff"] > bound] + (
        [f"{label}: the same bin run again after another bin moved its hidden states by "
         f"{iso['repeat_diff']:.2e}: a forward keeps state from an earlier one"]
        if iso["repeat_diff"] > bound else [])


def run_check(model: nn.Module, spec: ModelSpec, *, dtype: str, device: torch.device,
              backend: str = "auto", samples: int = 4, seed: int = 0,
              data: DataFile | None = None, context: ContextGroup | None = None,
              weights: str = "auto", replica: int = 0) -> dict:
    """Run the check on `model` (float32, built by check/command.py's `check`, whose arguments
    these are); returns the report dict (`passed`, and `failures` naming each item that does
    not hold). Raises `CheckUnsupportedError` (a ValueError) when it cannot run as asked.

    With a `context` group of several processes the packed side is split across them by
    context parallelism; every rank holds the same model and reference, and the packed
    row's logits and gradients are gathered before the comparison. `replica`: this group's
    index among data-parallel replicas, each of which packs the samples in its own order
    (`data.load_samples`)."""
    cp = 1 if context is None else context.size
    context = context if cp > 1 else None
    dev = device
    model.train()
    batch_samples, source, data_info = load_samples(
        spec, samples=samples, seed=seed, data=data, model_name=spec.name, replica=replica,
        model=model)
    pad_to = pad_unit(cp)
    report: dict = dict(model=spec.name, family=spec.family, backend=backend,
                        attn_implementation=spec.attn_implementation, dtype=dtype,
                        device=str(dev), samples=len(batch_samples), data=source, cp=cp,
                        init=weights, replica=replica,
                        sample_keys=[x.key for x in batch_samples],
                        videos=sum(x.num_videos for x in batch_samples),
                        tolerances=TOLERANCES[dtype], isolation_bound=ISOLATION[dtype], **data_info)
    failures: list[str] = list(data_info.get("encoding", {}).get("failures", []))
    try:
        return _run_items(model, spec, batch_samples, report, failures, dtype=dtype, device=dev,
                          pad_to=pad_to, seed=seed, context=context)
    except StaleVisionTablesError as e:  # a vlpack state bug the packed forward detects itself
        report.update(failures=[*failures, f"float32 contract: {e}"], bf16_failures=[],
                      passed=False)
        return report


def _run_items(model: nn.Module, spec: ModelSpec, batch_samples: list[EncodedSample],
               report: dict, failures: list[str], *, dtype: str, device: torch.device,
               pad_to: int, seed: int, context: ContextGroup | None) -> dict:
    """`run_check`'s comparisons on the chosen samples: their failures appended to
    `failures`, their values and the verdict written into `report`, which is returned."""
    cp, dev = 1 if context is None else context.size, device
    tol32, tol = TOLERANCES["float32"], TOLERANCES[dtype]
    # The contract, in fp32. Bin A (forward only), bin B (the samples reversed, other alignment,
    # extra tail padding), then A with gradients: each against the reference, so state kept
    # from one forward (vision tables, deepstack index, boundaries) cannot go unseen. The
    # isolation runs end with B and A again, compared bitwise with their first A.
    ref = run_unpacked(model, spec, batch_samples)
    failures += _label_failures(ref)
    first = run_packed(model, spec, batch_samples, pad_to, backward=False, context=context)
    d1 = compare(first, ref, stable_tokens(first, ref))
    rev = run_packed(model, spec, *_other_bin(batch_samples, cp), backward=False,
                     context=context)
    rev = replace(rev, logits=rev.logits[::-1], losses=rev.losses[::-1],
                  topk=None if rev.topk is None else rev.topk[::-1],
                  vision=None if rev.vision is None else rev.vision[::-1])
    d2 = compare(rev, ref, stable_tokens(rev, ref))
    for d_ in (d1, d2):  # forward only: no gradients to compare
        d_.update(grad={}, grad_params={}, grad_worst={}, params_missing={})
    failures += _contract_failures("float32 first bin, forward only", d1, tol32)
    failures += _contract_failures("float32 second bin (reversed, re-padded)", d2, tol32)
    packed = run_packed(model, spec, batch_samples, pad_to, context=context)
    keep = stable_tokens(packed, ref)
    d = compare(packed, ref, keep)
    failures += _contract_failures("float32 packed vs unpacked", d, tol32)
    keys = [s.key for s in batch_samples]
    for label, d_ in (("float32 first bin, forward only", d1),
                      ("float32 second bin (reversed, re-padded)", d2),
                      ("float32 packed vs unpacked", d)):
        failures += cv.failures(label, d_["vision"], keys) if d_["vision"] is not None else []
    sens = cv.position_sensitivity(model, batch_samples, spec.merge_size)
    weak = cv.sensitivity_failures(sens)
    if report["data"].startswith("synthetic"):
        failures += weak
    elif weak:  # the user's images: said, not failed
        report["vision_position_warning"] = weak[0]
    iso32 = isolation(model, spec, batch_samples, pad_to, seed, context=context)
    failures += _isolation_failures("float32 isolation", iso32, ISOLATION["float32"])
    report.update(contract_float32=_summary(d), second_bin=_summary(d2),
                  vision_position_sensitivity=sens, vision_tolerance=cv.VISION_TOL,
                  isolation_float32=iso32,
                  hf_label_loss=[None if h is None else round(h, 6) for h in ref.hf_losses])

    bf16_from = len(failures)  # the failures from here on are the bf16 items
    if dtype == "bfloat16":
        # the recipes' precision path: bf16 autocast over the float32 master weights (on a CPU,
        # CPU autocast with LayerNorm in float32, as CUDA's), both sides; their errors against
        # the fp32 reference make the 2x rule
        with torch.autocast(dev.type, dtype=torch.bfloat16), _cuda_norm_policy(model, dev):
            packed = run_packed(model, spec, batch_samples, pad_to, context=context)
            plain = run_unpacked(model, spec, batch_samples)
            iso16 = isolation(model, spec, batch_samples, pad_to, seed, context=context)
        keep = stable_tokens(packed, plain, ref)
        f16 = GRAD_FLOOR["bfloat16"]
        d = compare(packed, plain, keep, f16)
        dp, d0 = compare(packed, ref, keep, f16), compare(plain, ref, keep, f16)
        failures += _rule_failures(dp, d0, tol) + _group_failures("bfloat16 packed vs unpacked", d)
        failures += _isolation_failures("bfloat16 isolation", iso16, ISOLATION["bfloat16"])
        report.update(rule=dict(packed_vs_fp32=_summary(dp), plain_bf16_vs_fp32=_summary(d0)),
                      isolation_bfloat16=iso16,
                      precision=f"bfloat16 autocast on {dev.type} over float32 weights")
    report.update(
        per_sample=[dict(key=s.key, tokens=len(s), images=len(s.image_grid_thw),
                         max_logit_diff=d["logits"][i], loss_diff=d["loss"][i])
                    for i, s in enumerate(batch_samples)],
        grad_rel_diff=d["grad"],
        max_logit_diff=max(d["logits"]),
        max_loss_diff=max(d["loss"]),
        loss_total_diff=d["loss_total"],
        loss_value=d["loss_value"],
        max_grad_rel_diff=max(d["grad"].values()) if d["grad"] else 0.0,
        moe_aux_diff=d["aux"],
        moe_routing_flips=None if keep is None else int(sum((~m).sum() for m in keep)),
        moe_aux_packed=packed.aux,
        grad_worst=d["grad_worst"],
        groups_not_exercised=_not_exercised(param_groups(model), packed, ref),
        paths=packed.paths,
        paths_no_grad=(iso16 if dtype == "bfloat16" else iso32)["paths"],
        failures=failures,
        bf16_failures=failures[bf16_from:],
        passed=not failures,
    )
    return report


def _not_exercised(groups: dict[str, str], *runs: Run) -> list[str]:
    """The groups none of whose parameters gets a non-zero gradient in any of `runs`."""
    hit = {groups[n] for r in runs for n, g in r.grads.items() if _nonzero(g)}
    return [g for g in GROUPS if g in set(groups.values()) and g not in hit]


def _summary(d: dict) -> dict:
    return dict(max_logit_diff=max(d["logits"]), max_loss_diff=max(d["loss"]),
                loss_total_diff=d["loss_total"],
                grad_rel_diff=d["grad"], moe_aux_diff=d["aux"],
                max_vision_diff=None if not d["vision"] else max(d["vision"]))


def _fmt(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2e}"


def format_report(r: dict) -> str:
    if "per_sample" not in r:  # stopped by an error the packed forward detected itself
        return "\n".join([f"vlpack check: {r['model']} ({r['family']}) on {r['device']}, "
                          f"{r['dtype']}", "FAILED:", *[f"  - {f}" for f in r["failures"]]])
    lines = [
        f"vlpack check: {r['model']} ({r['family']}) on {r['device']}"
        + (f" × {r['cp']} context-parallel ranks" if r.get("cp", 1) > 1 else "")
        + f", {r['dtype']}, "
        f"backend {r['backend']} -> {r['attn_implementation']}"
        + (", random weights (--init random)" if r.get("init") == "random" else ""),
        f"data: {r['data']}, {r['samples']} samples packed into one row ({r['videos']} videos): "
        + ", ".join(r["sample_keys"]),
        "paths: " + ", ".join(f"{k}={v}" for k, v in sorted(r["paths"].items())),
        *([] if r["paths_no_grad"] == r["paths"] else [
            "paths without gradients: "
            + ", ".join(f"{k}={v}" for k, v in sorted(r["paths_no_grad"].items()))]),
        f"{'sample':<24} {'tokens':>6} {'images':>6} {'max|dlogit|':>12} {'dloss(rel)':>11}",
    ]
    for s in r["per_sample"]:
        lines.append(f"{s['key']:<24} {s['tokens']:>6} {s['images']:>6} "
                     f"{_fmt(s['max_logit_diff']):>12} {_fmt(s['loss_diff']):>11}")
    grads = ", ".join(f"{g}={_fmt(v)}" for g, v in r["grad_rel_diff"].items())
    lines.append(f"grad rel err per group: {grads}")
    lines += [f"  worst {g} parameter: {w['name']} {_fmt(w['rel_diff'])}"
              for g, w in r["grad_worst"].items()]
    if r["groups_not_exercised"]:
        lines.append("not exercised by these samples (no gradient on either side): "
                     + ", ".join(r["groups_not_exercised"]))
    if r["moe_aux_diff"] is not None:
        lines.append(f"MoE aux loss (real tokens) {r['moe_aux_packed']:.6f}, "
                     f"diff vs transformers {_fmt(r['moe_aux_diff'])}; tokens with an expert "
                     f"choice flipped by rounding (left out of the logit diff): "
                     f"{r['moe_routing_flips']}")
    c, b = r["contract_float32"], r["second_bin"]
    lines.append(f"float32 contract: logits {_fmt(c['max_logit_diff'])}, loss per sample "
                 f"{_fmt(c['max_loss_diff'])}, the row's loss {_fmt(c['loss_total_diff'])} "
                 f"(packed {r['loss_value']['packed']:.6g}, reference "
                 f"{r['loss_value']['reference']:.6g}); second bin logits "
                 f"{_fmt(b['max_logit_diff'])}")
    for key in ("isolation_float32", "isolation_bfloat16"):
        if key in r:
            lines.append(f"{key.replace('_', ' ')}: other samples moved by at most "
                         f"{_fmt(r[key]['max_diff'])} when one sample changed")
    if "rule" in r:
        p, q = r["rule"]["packed_vs_fp32"], r["rule"]["plain_bf16_vs_fp32"]
        lines.append(f"bf16 rule: packed vs fp32 logits {_fmt(p['max_logit_diff'])} "
                     f"(plain bf16 {_fmt(q['max_logit_diff'])}), loss {_fmt(p['max_loss_diff'])} "
                     f"(plain {_fmt(q['max_loss_diff'])})")
    lines += format_data(r) + format_replicas(r)
    if "vision_position_warning" in r:
        lines.append(f"warning: {r['vision_position_warning']}")
    if r["passed"]:
        lines.append("PASSED")
    else:
        lines += ["FAILED:"] + [f"  - {f}" for f in r["failures"]]
    return "\n".join(lines)


def format_replicas(r: dict) -> list[str]:
    """The report's lines for its data-parallel replicas (none for a single replica)."""
    return [f"data-parallel replica {x['replica']}: {'passed' if x['passed'] else 'FAILED'}, "
            f"max |dlogit| {x['max_logit_diff']:.2e}, samples " + ", ".join(x["sample_keys"])
            for x in r.get("replicas", ())]
