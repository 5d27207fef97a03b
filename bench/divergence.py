"""Where the packed forward departs from the unpacked one, layer by layer, on a real-size model in
its training precision: the tool for a gap between bench/convergence.py's two curves.

    python bench/divergence.py --recipe qwen3.5-35b-a3b-lora --seq-len 4096 --bins 3 --out OUT

The bins are bench/convergence.py's first `--bins` bins (its data settings, same seed, same
samples; MRoPE by transformers' rule, `data.mrope_after_video=transformers`, which the padded
and stock sides compute with `get_rope_index`), and the model is the one the trainer builds
(`Trainer`: LoRA, frozen bf16 base, checkpointing; bf16 autocast on a GPU; LoRA's B starts at
zero, so the forward is the base model's). Each sample of a bin runs five ways:

  packed        the bin's row from `build_loaders`, as the trainer trains it: vlpack's varlen
                attention, experts and Gated-DeltaNet
  again         the same row a second time (the run-to-run floor of the kernels)
  alone         the sample as its own THD row (`batch.packed_row`: the same path, nothing
                packed beside it)
  padded        the bin as right-padded batches of `--micro` (convergence.py's padded mode: stock
                SDPA with the 2-D mask, transformers' experts and Gated-DeltaNet forward)
  padded_alone  the sample alone through the padded path (no padding)

Reported per text layer and sample: the relative difference ‖a − b‖ / ‖b‖ of the layer's output
on the sample's tokens for the pairs below, the share of the sample's tokens whose routed
experts (the top-k set) agree, and each sample's loss; then the step's gradient of the trainable
parameters for each way, from the trainer's own step (`Trainer.train_step`, unclipped, with the
MoE aux loss and without it): relative difference and norm. In bf16 a row's
kernels round differently with its length, so packed/alone differs even where nothing leaks;
a leak shows cleanly only in float32 (`--truth`). Everything is written to OUT/divergence.json;
a summary is printed.

With `--truth` (LoRA recipes: their frozen base is what is cast) the model is built in float32
without LoRA and each way is also compared with the float32 forward of the stock model
(`model/reference.py`: SDPA, transformers' experts, its torch Gated-DeltaNet kernels) on each
sample alone: vlpack's float32 path on the packed row (`packed_fp32`) and on each sample alone
(`ours_fp32`), then, after the frozen matmul weights are cast to bf16 as a LoRA run holds them
(`precision.hold_parameters`), the bf16 ways. No gradients then.

Legend: T = tokens of a forward (flattened), H = hidden size, k = experts per token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

from vlpack.config import load_config
from vlpack.data.batch import packed_row
from vlpack.data.loader import build_loaders
from vlpack.data.padded import build_padded_batch
from vlpack.data.setup import build_encoder
from vlpack.data.types import IGNORE_INDEX
from vlpack.model.build import set_attn_implementation
from vlpack.model.moe import routers
from vlpack.model.reference import STOCK_EXPERTS, stock_reference
from vlpack.train.distributed.parallel import Topology
from vlpack.train.setup import precision
from vlpack.train.setup.kernel_cache import use_tuned_kernels
from vlpack.train.setup.module import TrainModule
from vlpack.train.setup.stack import build_base
from vlpack.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from convergence import bench_config, packed_steps, plan  # the convergence bench's data and bins

PAIRS = (("packed", "again"), ("packed", "alone"), ("alone", "padded_alone"),
         ("padded", "padded_alone"), ("packed", "padded"))
"""(a, b) compared as ‖a − b‖ / ‖b‖."""


def spans_of(batch) -> list[tuple[int, int]]:
    """(start, stop) of each sample's real tokens in the flattened token axis of `batch`."""
    if hasattr(batch, "cu_seqlens"):
        starts = batch.cu_seqlens_padded.tolist()
        lens = torch.diff(batch.cu_seqlens).tolist()
        return [(s, s + n) for s, n in zip(starts[:-1], lens, strict=True)]
    L = batch.input_ids.shape[1]
    return [(r * L, r * L + int(n)) for r, n in enumerate(batch.attention_mask.sum(1).tolist())]


class Recorder:
    """Forward hooks: each text layer's output [T, H], the input of the first layer (the
    embeddings with the visual features merged in), the final norm's output, and each
    router's top-k indices [T, k]."""

    def __init__(self, text_model: torch.nn.Module, model: torch.nn.Module):
        self.outputs: list[torch.Tensor] = []
        self.routes: list[torch.Tensor] = []
        self.handles = [text_model.layers[0].register_forward_pre_hook(self._pre, with_kwargs=True)]
        self.handles += [layer.register_forward_hook(self._out) for layer in text_model.layers]
        self.handles.append(text_model.norm.register_forward_hook(self._out))
        self.handles += [r.register_forward_hook(self._route) for r in routers(model)]

    def _pre(self, module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        self.outputs.append(x.detach().reshape(-1, x.shape[-1]))

    def _out(self, module, args, output):
        x = output[0] if isinstance(output, tuple) else output
        self.outputs.append(x.detach().reshape(-1, x.shape[-1]))

    def _route(self, module, args, output):
        self.routes.append(output[2].detach().sort(dim=-1).values)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def run_forward(module, model, mbs, autocast) -> tuple[list, list]:
    """Per sample (mbs' order): [layer outputs: embeddings, layers..., final norm] as float32
    [n, H], and [routes per MoE layer] [n, k]."""
    text = model.model.language_model
    per_sample, routes = [], []
    for b in mbs:
        rec = Recorder(text, model)
        try:
            with torch.no_grad(), autocast():
                module(b)
        finally:
            rec.close()
        for s, e in spans_of(b):
            per_sample.append([x[s:e].float() for x in rec.outputs])
            routes.append([r[s:e] for r in rec.routes])
    return per_sample, routes


def sample_losses(model, finals, labels, autocast) -> list[float]:
    """Each sample's mean CE over its label tokens, from its final-norm output."""
    out = []
    with torch.no_grad(), autocast():
        for h, y in zip(finals, labels, strict=True):
            logits = model.lm_head(h.to(model.lm_head.weight.dtype)).float()
            out.append(float(torch.nn.functional.cross_entropy(logits, y, ignore_index=IGNORE_INDEX)))
    return out


def real_labels(alone: list) -> list[torch.Tensor]:
    """Each one-sample row's labels on its real tokens (a row's alignment padding cut)."""
    return [b.labels[s:e] for b in alone for s, e in spans_of(b)]


def step_gradient(trainer: Trainer, mbs, *, aux_coef: float) -> dict[str, torch.Tensor]:
    """The trainable parameters' gradient of the trainer's step over `mbs` (`train_step`
    itself with the MoE aux coefficient `aux_coef`, its optimizer a stand-in that records the
    gradient and leaves the weights; the run's `optim.grad_clip=0`: the gradient unclipped)."""
    names = {p: n for n, p in trainer.module.named_parameters() if p.requires_grad}
    grads: dict[str, torch.Tensor] = {}

    class Record(torch.optim.SGD):
        def step(self, closure=None):
            grads.update({names[p]: p.grad.detach().float().clone() for p in names
                          if p.grad is not None})

    trainer.optimizer = Record(list(names), lr=0.0)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda k: 1.0)
    trainer.cfg.train.aux_loss_coef = aux_coef  # the step reads it from the run's config
    trainer.train_step(mbs)
    return grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def grad_compare(ga: dict, gb: dict) -> dict:
    va = torch.cat([ga[n].flatten() for n in sorted(gb)])
    vb = torch.cat([gb[n].flatten() for n in sorted(gb)])
    return {"relative": rel(va, vb), "norm_a": float(va.norm()), "norm_b": float(vb.norm()),
            "cosine": float(torch.nn.functional.cosine_similarity(va, vb, dim=0))}


def print_bin(k: int, sizes: list, losses: dict, layers: dict, agree: dict, gcmp: dict) -> None:
    n_layers = len(next(iter(layers.values())))
    print(f"\nbin {k}: {len(sizes)} samples of {sizes} tokens")
    print("  sample losses: " + "; ".join(f"{w} {', '.join(f'{x:.4f}' for x in v)}"
                                         for w, v in losses.items()))
    print("  layer " + " ".join(f"{key:>24}" for key in layers))
    for i in sorted({0, 1, 2, 3, 4, 8, 12, 16, 20, 24, 28, 32, 36, n_layers - 2, n_layers - 1}
                    & set(range(n_layers))):
        cells = " ".join(f"{' '.join(f'{x:.1e}' for x in v[i]):>24}" for v in layers.values())
        print(f"  {i:>5} {cells}")
    if agree:
        print("  route agreement (mean over MoE layers, per sample): " + "; ".join(
            f"{key} " + ", ".join(f"{sum(r[s] for r in v) / len(v):.3f}" for s in range(len(sizes)))
            for key, v in agree.items()))
    for key, g in gcmp.items():
        print(f"  grad {key:>34}: relative {g['relative']:.2e}  cosine {g['cosine']:.6f}  "
              f"norms {g['norm_a']:.4f} / {g['norm_b']:.4f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipe", default="tiny")
    p.add_argument("--layers", type=int, default=None, help="reduce text depth (a cut)")
    p.add_argument("--bins", type=int, default=3, help="the first N steps' bins")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro", type=int, default=16, help="padded: samples per micro-batch")
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--steps", type=int, default=200,
                   help="convergence.py's --steps: the plan's length (at least --bins)")
    p.add_argument("--truth", action="store_true",
                   help="compare with the float32 stock forward (no LoRA, no gradients)")
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    truth = ["model.lora.rank=0"] if args.truth else []
    cfg = bench_config(args, *truth, "model.compile=false", "data.mrope_after_video=transformers",
                       "optim.grad_clip=0", f"train.max_steps={args.steps}",
                       f"train.output_dir={out}")
    if args.bins > args.steps:
        raise ValueError(f"--bins {args.bins} > --steps {args.steps}: the plan has --steps bins")
    if args.truth and not load_config(args.recipe, list(args.overrides)).model.lora.rank:
        raise ValueError("--truth casts the frozen base to bf16 as a LoRA run holds it: pass a "
                         "LoRA recipe (e.g. qwen3.5-35b-a3b-lora)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    low = torch.bfloat16 if device.type == "cuda" else None
    topo = Topology(rank=0, world_size=1, local_rank=0, device=device)
    if args.truth and low is None:
        print("no GPU: no bf16 autocast, so the ways compared with the truth run in float32")
    trainer = None
    if args.truth:  # float32 weights first; cast below, after the float32 forwards
        if device.type == "cuda" and cfg.train.tuned_kernels:  # as build_stack does
            use_tuned_kernels(torch.cuda.get_device_name(device))
        model, spec = build_base(cfg, device, torch.float32)
        module = TrainModule(model, spec)
        encoder = build_encoder(cfg.data, spec, cfg.model.name)  # as the trainer's
        loader, _ = build_loaders(cfg.data, encoder, seed=cfg.train.seed,
                                  pad_token_id=spec.pad_token_id,
                                  spatial_merge_size=spec.merge_size)
    else:
        trainer = Trainer(cfg, topo)
        model, module, spec, low = trainer.model, trainer.module, trainer.spec, trainer.autocast
        encoder, loader, cfg = trainer.encoder, trainer.train_loader, trainer.cfg
    module.train()
    coefs = (0.0, cfg.train.aux_loss_coef)  # the step's MoE aux coefficients compared
    items = loader.items
    bins = plan(loader.sizes, cfg.data, args.bins, cfg.train.seed)
    rows = [mbs[0] for mbs in packed_steps(loader, items, [[ids] for ids in bins], 1)]
    packed_attn = model.config._attn_implementation
    packed_experts = getattr(getattr(model.config, "text_config", model.config),
                             "_experts_implementation", None)

    def autocast():
        return torch.autocast(device.type, dtype=low) if low else contextlib.nullcontext()

    def stock(on: bool) -> None:  # the padded mode's model: SDPA, transformers' experts
        set_attn_implementation(model, "sdpa" if on else packed_attn)
        if spec.is_moe:
            model.set_experts_implementation(STOCK_EXPERTS if on else packed_experts)

    pad, merge = spec.pad_token_id, spec.merge_size
    report = {"recipe": args.recipe, "model": cfg.model.name, "seq_len": args.seq_len,
              "micro": args.micro, "truth": args.truth, "bins": []}
    encoded = [[encoder.encode(items[i]) for i in ids] for ids in bins]
    ways_of = []
    for group, row in zip(encoded, rows, strict=True):
        ways = {
            "packed": [row],
            "alone": [packed_row([s], cfg.data, pad_token_id=pad, spatial_merge_size=merge)
                      for s in group],
            "padded": [build_padded_batch(group[i : i + args.micro], pad_token_id=pad)
                       for i in range(0, len(group), args.micro)],
            "padded_alone": [build_padded_batch([s], pad_token_id=pad) for s in group],
        }
        ways["again"] = ways["packed"]
        ways_of.append({w: [b.to(device) for b in mbs] for w, mbs in ways.items()})
    hidden = [{} for _ in bins]
    routes = [{} for _ in bins]
    losses = [{} for _ in bins]
    grads = [{} for _ in bins]
    nothing = contextlib.nullcontext
    if args.truth:
        for k, ways in enumerate(ways_of):
            labels = real_labels(ways["alone"])
            with stock_reference(model):
                hidden[k]["truth"], routes[k]["truth"] = run_forward(
                    module, model, ways["padded_alone"], nothing)
            hidden[k]["ours_fp32"], routes[k]["ours_fp32"] = run_forward(
                module, model, ways["alone"], nothing)
            hidden[k]["packed_fp32"], routes[k]["packed_fp32"] = run_forward(
                module, model, ways["packed"], nothing)
            for w in ("truth", "ours_fp32", "packed_fp32"):
                losses[k][w] = sample_losses(model, [h[-1] for h in hidden[k][w]], labels, nothing)
        for prm in model.parameters():
            prm.requires_grad_(False)
        precision.hold_parameters(model, low)
    for k, ways in enumerate(ways_of):
        labels = real_labels(ways["alone"])
        for w in ("packed", "again", "alone", "padded", "padded_alone"):
            stock(w.startswith("padded"))
            hidden[k][w], routes[k][w] = run_forward(module, model, ways[w], autocast)
            losses[k][w] = sample_losses(model, [h[-1] for h in hidden[k][w]], labels, autocast)
            if not args.truth:
                for coef in coefs:
                    grads[k][w, coef] = step_gradient(trainer, ways[w], aux_coef=coef)
            print(f"bin {k + 1}: {w} done", flush=True)
        stock(False)
    pairs = ([(w, "truth") for w in ("packed_fp32", "ours_fp32", "packed", "alone", "padded",
                                     "padded_alone")] if args.truth else PAIRS)
    for k, group in enumerate(encoded):
        h, r, n = hidden[k], routes[k], len(group)
        layers = {f"{a}/{b}": [[rel(h[a][s][i], h[b][s][i]) for s in range(n)]
                               for i in range(len(h[b][0]))] for a, b in pairs}
        agree = {f"{a}/{b}": [[float((r[a][s][i] == r[b][s][i]).all(-1).float().mean())
                               for s in range(n)] for i in range(len(r[a][0]))]
                 for a, b in pairs if r[a][0]}
        gcmp = {f"{a}/{b} aux={coef}": grad_compare(grads[k][a, coef], grads[k][b, coef])
                for a, b in pairs if not args.truth for coef in coefs}
        sizes = [len(s) for s in group]
        report["bins"].append({
            "step": k + 1, "sample_tokens": sizes,
            "layer_rows": "0: embeddings into layer 0; i: layer i's output; last: the final norm",
            "relative_difference": layers, "route_agreement": agree, "loss": losses[k],
            "gradient": gcmp})
        print_bin(k + 1, sizes, losses[k], layers, agree, gcmp)
    (out / "divergence.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out / 'divergence.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
