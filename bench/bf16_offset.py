"""Where vlpack's bf16 loss departs from the stock path's on a real-size model, and which of the
two lies nearer float32: each of vlpack's seams swapped for transformers' own, one at a time, and
a float32 reference of the whole depth that fits beside the model.

    python bench/bf16_offset.py --recipe qwen3.5-35b-a3b-lora --seq-len 4096 --bins 2 --samples 2000 --out OUT

The samples are those of bench/convergence.py's first `--bins` bins (bench/divergence.py's), the
model the one the trainer builds (`Trainer`: LoRA, frozen base held in bf16, bf16 autocast on a
GPU; LoRA's B starts at zero), MRoPE by transformers' rule. Each sample runs alone, these ways:

  stock       a padded batch of one through the trainer's padded path (transformers' SDPA,
              experts, Gated-DeltaNet forward and vision tower): divergence.py's padded_alone
  vlpack      its own THD row through vlpack's seams: divergence.py's alone
  -attention  vlpack, the text attention transformers' SDPA
  -gdn        vlpack, Gated-DeltaNet transformers' own forward, as stock's (fla's delta rule
              where fla imports; its torch convolution unless causal-conv1d is installed)
  -experts    vlpack, the routed experts transformers' grouped_mm
  -vision     vlpack, the vision tower and its attention transformers' own (SDPA)
  -all        vlpack with all four swapped
  -conv       vlpack, Gated-DeltaNet's short convolution alone run as transformers' torch
              fallback computes it (per segment), the delta rule still fla's
  float32     the stock model (model/reference.py: SDPA, transformers' experts, its torch
              Gated-DeltaNet kernels) in float32 on the padded batch of one. The bf16-held
              weights are upcast, exactly: the modules outside the text layers for the whole
              pass, each text layer only while it runs. The backward runs layer by layer from
              the top, each layer upcast again and run once more from its saved input, so no
              float32 copy of the whole model (131 GiB for the 35B) is ever held.

`--ways` runs some of them (the float32 reference always). Per way and sample: the loss (mean
cross-entropy over the sample's label tokens from its final-norm output, one function for every
way: the loss function is not among the swaps); the relative
difference ‖a − f‖ / ‖f‖ of the embeddings, each text layer's output and the final norm's from
float32's, and the share of tokens whose top-k experts match float32's; the adapter gradient of
the sample's step (the trainer's own step, unclipped, MoE aux loss off; for float32 the same
loss's backward) against float32's: relative difference, cosine and norms. Written to
OUT/bf16_offset.json, a table printed. On a CPU there is no autocast: every way runs in float32
and all of them agree with the reference to rounding (a check of the bench itself).

Legend: T = tokens of the sample, H = hidden size.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from vlpack.data.batch import packed_row
from vlpack.data.padded import build_padded_batch
from vlpack.model.attention import TEXT_VARLEN_KWARGS
from vlpack.model.bounds import BOUNDS_KWARG
from vlpack.model.gdn import GatedDeltaNet
from vlpack.model.reference import STOCK_EXPERTS, stock_reference
from vlpack.model.seams import classes_of
from vlpack.model.vision import VisionAttention, VisionTower
from vlpack.train.distributed.parallel import Topology
from vlpack.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from convergence import bench_config, plan  # the convergence bench's data and bins
from divergence import grad_compare, real_labels, rel, run_forward, sample_losses, step_gradient

SWAPS = ("attention", "gdn", "experts", "vision")
WAYS = ("stock", "vlpack", *(f"-{s}" for s in SWAPS), "-all", "-conv")
STOCK = ("attention", "experts", "vision")
"""The seams the trainer's padded path runs as transformers' (`build_base` with `data.packing=none`:
SDPA for text and vision, transformers' experts); its Gated-DeltaNet layers are vlpack's class,
which without a row's boundaries runs transformers' forward."""


@functools.cache
def unpacked_gdn(cls: type) -> type:
    """vlpack's Gated-DeltaNet class `cls` called as the padded path calls it: the row's
    boundary keywords dropped (transformers from 5.25 would pass them to its kernel), so it runs
    transformers' own forward over the sample alone in its row as one sequence, its alignment
    padding after it, with vlpack's approval of fla's backward on Hopper as on the padded path."""

    def forward(self, hidden_states, *args, **kwargs):
        for k in (*TEXT_VARLEN_KWARGS, BOUNDS_KWARG):
            kwargs.pop(k, None)
        return cls.forward(self, hidden_states, *args, **kwargs)

    return type(f"Unpacked{cls.__name__}", (cls,), {"forward": forward})


@functools.cache
def torch_conv_gdn(cls: type) -> type:
    """vlpack's Gated-DeltaNet class `cls` with its short convolution on torch (`-conv`)."""
    return type(f"TorchConv{cls.__name__}", (cls,), {"conv_on_torch": True})


@functools.cache
def grid_on_device(stock: type) -> type:
    """`stock` (a transformers vision tower class) given its grids on its own device, as the
    padded path gives them: vlpack's `get_image_features` hands the tower the row's grids on the
    host (its own tower reads only host-built tables), and the stock tower builds its index
    tables on the grids' device."""

    def forward(self, hidden_states, grid_thw=None, **kwargs):
        return stock.forward(self, hidden_states, grid_thw.to(hidden_states.device), **kwargs)

    return type(f"Device{stock.__name__}", (stock,), {"forward": forward})


@contextlib.contextmanager
def stock_seams(model: nn.Module, names: Iterable[str]) -> Iterator[None]:
    """vlpack's seams `names` (of SWAPS, or "conv") swapped for transformers' own for the
    block."""
    names = set(names)
    text_cfg = getattr(model.config, "text_config", model.config)
    vision_cfg = getattr(model.config, "vision_config", None)
    attn = (text_cfg._attn_implementation, getattr(vision_cfg, "_attn_implementation", None))
    experts = (getattr(text_cfg, "_experts_implementation", None)
               if classes_of(model).experts is not None else None)  # a dense model has none
    kinds = ((GatedDeltaNet,) if {"gdn", "conv"} & names else ()) + \
            ((VisionTower, VisionAttention) if "vision" in names else ())
    moved = [(m, type(m)) for m in model.modules() if kinds and isinstance(m, kinds)]
    gdn = unpacked_gdn if "gdn" in names else torch_conv_gdn
    try:
        if "attention" in names:
            text_cfg._attn_implementation = "sdpa"
        if "vision" in names and vision_cfg is not None:
            vision_cfg._attn_implementation = "sdpa"
        for m, cls in moved:
            stock = cls._vlpack_stock
            m.__class__ = (gdn(cls) if isinstance(m, GatedDeltaNet)
                           else grid_on_device(stock) if isinstance(m, VisionTower) else stock)
        if "experts" in names and experts is not None:
            model.set_experts_implementation(STOCK_EXPERTS)
        yield
    finally:
        for m, cls in moved:
            m.__class__ = cls
        text_cfg._attn_implementation = attn[0]
        if vision_cfg is not None:
            vision_cfg._attn_implementation = attn[1]
        if "experts" in names and experts is not None:
            model.set_experts_implementation(experts)


def upcast(params: Iterable[nn.Parameter]) -> list[tuple[nn.Parameter, torch.dtype]]:
    """Each parameter not in float32 upcast in place; returns (parameter, its dtype) to restore."""
    low = [(p, p.dtype) for p in params if p.is_floating_point() and p.dtype != torch.float32]
    for p, _ in low:
        p.data = p.data.float()
    return low


def restore(low: list[tuple[nn.Parameter, torch.dtype]]) -> None:
    """`upcast` undone, exactly (a bf16 value is a float32 value)."""
    for p, dtype in low:
        p.data = p.data.to(dtype)


@contextlib.contextmanager
def in_float32(params: Iterable[nn.Parameter]) -> Iterator[None]:
    low = upcast(params)
    try:
        yield
    finally:
        restore(low)


class Streamed:
    """Forward hooks on the text layers: each upcast to float32 only while it runs, its call
    kept (`calls`: layer, its input hidden states, the positional arguments after them, keywords)
    for the layer-by-layer backward. The input is the layer's own: a deepstack family (Qwen3-VL)
    adds vision features to the first layers' outputs before the next layer reads them."""

    def __init__(self, layers: list[nn.Module]):
        self.calls: list[tuple[nn.Module, torch.Tensor, tuple, dict]] = []
        self._low: list = []
        self.handles = [h for layer in layers for h in (
            layer.register_forward_pre_hook(self._pre, with_kwargs=True),
            layer.register_forward_hook(self._post))]

    def _pre(self, layer, args, kwargs):
        self._low = upcast(layer.parameters())
        rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        x = args[0] if args else kwargs["hidden_states"]
        self.calls.append((layer, x.detach(), args[1:] if args else (), rest))

    def _post(self, layer, args, output):
        restore(self._low)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def float32_way(model: nn.Module, module: nn.Module, batch, labels_T: torch.Tensor,
                trainable: dict[str, nn.Parameter]):
    """The float32 reference of one sample (module docstring): ([embeddings, layer outputs...,
    final norm] as [T, H], routes per MoE layer, loss, {trainable name: gradient})."""
    text = model.model.language_model
    layers = list(text.layers)
    inside = {p for layer in layers for p in layer.parameters()}
    outside = [p for p in model.parameters() if p not in inside]
    for p in trainable.values():
        p.grad = None
    with stock_reference(model), in_float32(outside), full_float32():
        stream = Streamed(layers)
        try:
            per_sample, routes = run_forward(module, model, [batch], contextlib.nullcontext)
        finally:
            stream.close()
        outs = per_sample[0]  # [embeddings, layer 0 .. L-1 outputs, final norm]
        T, H = outs[0].shape
        x = outs[-2].view(1, T, H).clone().requires_grad_(True)
        with torch.enable_grad():
            logits = model.lm_head(text.norm(x)[0]).float()
            loss = torch.nn.functional.cross_entropy(logits, labels_T, ignore_index=-100)
            loss.backward()
        grad = x.grad
        for i in reversed(range(len(layers))):
            layer, x, args, kwargs = stream.calls[i]
            x = x.clone().requires_grad_(True)
            with in_float32(layer.parameters()), torch.enable_grad():
                y = layer(x, *args, **kwargs)
                y = y[0] if isinstance(y, tuple) else y
                torch.autograd.backward(y, grad)
            grad = x.grad
    grads = {n: p.grad.detach().float().clone() for n, p in trainable.items() if p.grad is not None}
    for p in trainable.values():
        p.grad = None
    missing = sorted(set(trainable) - set(grads))
    if missing:  # trainable outside the text layers (e.g. model.lora.vision): not streamed
        raise ValueError(f"the float32 backward runs through the text layers only; {len(missing)} "
                         f"trainable tensors outside them get no gradient (first: {missing[0]}): "
                         "train adapters on the text layers only for this bench")
    return host(outs), routes[0], loss.item(), grads


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """TF32 off for the block (torch lets cuDNN convolutions, such as the vision patch
    embedding, use it by default)."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def host(outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A way's layer outputs moved off the GPU (the comparisons run on the host), and the
    blocks they and the way's other tensors held given back to the device: the bf16 model of
    the 35B leaves an 80 GB card little room beside it."""
    outs = [x.cpu() for x in outs]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return outs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipe", default="tiny")
    p.add_argument("--layers", type=int, default=None, help="reduce text depth (a cut)")
    p.add_argument("--bins", type=int, default=2, help="the samples of the first N steps' bins")
    p.add_argument("--max-samples", type=int, default=0, help="at most this many samples (0: all)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--steps", type=int, default=200, help="the plan's length (at least --bins)")
    p.add_argument("--no-grad", action="store_true", help="losses and layers only")
    p.add_argument("--ways", default=",".join(WAYS),
                   help=f"comma-separated, of {','.join(WAYS)} (the float32 reference always runs)")
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    args = p.parse_args(argv)
    ways = tuple(args.ways.split(","))
    if not set(ways) <= set(WAYS):
        raise ValueError(f"--ways {args.ways}: each way one of {', '.join(WAYS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = bench_config(args, "model.compile=false", "data.mrope_after_video=transformers",
                       "optim.grad_clip=0", f"train.max_steps={args.steps}",
                       f"train.output_dir={out}")
    if not cfg.model.lora.rank:
        raise ValueError("pass a LoRA recipe (e.g. qwen3.5-35b-a3b-lora): the gradients compared "
                         "are the adapters'")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    trainer = Trainer(cfg, Topology(rank=0, world_size=1, local_rank=0, device=device))
    model, module, spec, low = trainer.model, trainer.module, trainer.spec, trainer.autocast
    module.train()
    trainable = {n: q for n, q in module.named_parameters() if q.requires_grad}
    loader, items = trainer.train_loader, trainer.train_loader.items
    ids = [i for b in plan(loader.sizes, cfg.data, args.bins, cfg.train.seed) for i in b]
    ids = ids[: args.max_samples] if args.max_samples else ids
    pad, merge = spec.pad_token_id, spec.merge_size

    def autocast():
        return torch.autocast(device.type, dtype=low) if low else contextlib.nullcontext()

    print(f"{len(ids)} samples; autocast {low}; {device}", flush=True)
    rows = []
    for k, i in enumerate(ids):
        s = trainer.encoder.encode(items[i])
        alone = packed_row([s], cfg.data, pad_token_id=pad, spatial_merge_size=merge).to(device)
        padded = build_padded_batch([s], pad_token_id=pad).to(device)
        labels = real_labels([alone])
        f_outs, f_routes, f_loss, f_grads = float32_way(model, module, padded, labels[0], trainable)
        norm = float(torch.cat([g.flatten() for g in f_grads.values()]).norm()) if f_grads else 0.0
        row = {"sample": k, "tokens": len(s), "loss": {"float32": f_loss}, "layers": {},
               "routes_agree": {}, "gradient": {},
               "float32_gradient": {"tensors": len(f_grads), "of": len(trainable), "norm": norm}}
        for way in ways:
            batch = padded if way == "stock" else alone
            swaps = (SWAPS if way == "-all" else (way[1:],) if way.startswith("-")
                     else STOCK if way == "stock" else ())
            with stock_seams(model, swaps):
                per_sample, routes = run_forward(module, model, [batch], autocast)
                row["loss"][way] = sample_losses(model, [per_sample[0][-1]], labels, autocast)[0]
                outs = host(per_sample[0])
                del per_sample
                if not args.no_grad:
                    g = step_gradient(trainer, [batch], aux_coef=0.0)
                    row["gradient"][way] = grad_compare(g, f_grads)
            row["layers"][way] = [rel(a, b) for a, b in zip(outs, f_outs, strict=True)]
            row["routes_agree"][way] = (
                statistics.fmean(float((a == b).all(-1).float().mean())
                                 for a, b in zip(routes[0], f_routes, strict=True))
                if f_routes else None)
            del outs
        rows.append(row)
        print_row(row)
        (out / "bf16_offset.json").write_text(json.dumps(
            {"recipe": args.recipe, "model": cfg.model.name, "layers": args.layers,
             "seq_len": args.seq_len, "autocast": str(low), "ways": list(ways),
             "layer_rows": "0: embeddings into layer 0; i: layer i's output; last: the final norm",
             "samples": rows}, indent=1))
    print_summary(rows)
    print(f"\nwrote {out / 'bf16_offset.json'}")
    return 0


def print_row(row: dict) -> None:
    f = row["loss"]["float32"]
    g32 = row["float32_gradient"]
    print(f"\nsample {row['sample']} ({row['tokens']} tokens): float32 loss {f:.5f}, adapter "
          f"gradient norm {g32['norm']:.4g} over {g32['tensors']} of {g32['of']} tensors")
    print(f"  {'way':>11} {'loss':>9} {'- float32':>10} {'- stock':>9} {'final norm':>11} "
          f"{'experts':>8} {'grad rel':>9} {'cosine':>8}")
    stock = row["loss"].get("stock", float("nan"))
    for way in row["layers"]:
        loss, g = row["loss"][way], row["gradient"].get(way)
        agree = row["routes_agree"][way]
        print(f"  {way:>11} {loss:9.5f} {loss - f:+10.5f} {loss - stock:+9.5f} "
              f"{row['layers'][way][-1]:11.2e} {'' if agree is None else f'{agree:8.3f}'} "
              + (f"{g['relative']:9.3e} {g['cosine']:8.5f}" if g else ""), flush=True)


def print_summary(rows: list[dict]) -> None:
    """Mean over samples, per way: loss − float32, loss − stock, final-norm and gradient
    distance from float32."""
    print(f"\nmean over {len(rows)} samples")
    print(f"  {'way':>11} {'- float32':>10} {'- stock':>9} {'final norm':>11} {'grad rel':>9} "
          f"{'cosine':>8}")
    for way in rows[0]["layers"]:
        m = statistics.fmean
        d32 = m(r["loss"][way] - r["loss"]["float32"] for r in rows)
        dst = m(r["loss"][way] - r["loss"].get("stock", float("nan")) for r in rows)
        fin = m(r["layers"][way][-1] for r in rows)
        g = [r["gradient"][way] for r in rows if way in r["gradient"]]
        tail = f"{m(x['relative'] for x in g):9.3e} {m(x['cosine'] for x in g):8.5f}" if g else ""
        print(f"  {way:>11} {d32:+10.5f} {dst:+9.5f} {fin:11.2e} {tail}")


if __name__ == "__main__":
    raise SystemExit(main())
