"""Side-by-side training throughput: vlpack packed / vlpack padded / stock transformers padded /
stock transformers padding-free, on the same model shape and the same samples.

    for m in vlpack_packed vlpack_padded hf_padded hf_padding_free; do
      python bench/train_throughput.py --model qwen3-vl-2b --modes $m --out throughput.json; done

Run one process per mode: cuDNN's SDPA plans each new shape once per process, so a mode run
after another on the same images would inherit the earlier mode's plans.

Each mode builds the model (random init, fp32 master weights, bf16 autocast on GPU), runs
`--warmup` steps, then times `--steps` steps. The vlpack modes run the trainer's own step
(`vlpack.train.step.optimizer_step`: global token-mean loss, the MoE aux loss, clipping, AdamW,
the schedule; the model from the trainer's `build_stack`), its forward, backward and optimizer
phases timed apart; the stock modes run their own forward, backward and AdamW step.
Real tokens/s counts only non-padding tokens. MFU = model FLOPs (vlpack/train/setup/flops.py: text + vision +
attention) / time / peak, over the 989 TFLOP/s dense bf16 peak and over a measured bf16 matmul
rate. The step-time breakdown (vision forward, text forward, loss, backward, optimizer, data) is
measured with CUDA events around the vision tower, the language model, the whole forward (so
the loss and the glue between tower and model are the rest of it), backward and optimizer;
`unaccounted` is step time outside every region (GPU idle, e.g. behind a host sync).

Modes:
  vlpack_packed     THD bins of --seq-len (BFD), vlpack varlen attention, chunked/fused loss
  vlpack_padded     right-padded batches of --batch samples, sdpa, vlpack loss
  hf_padded         right-padded batches, sdpa, stock `model(**inputs, labels=...)` loss
  hf_padding_free   stock transformers packing: 4-row position ids, no mask, sdpa, stock loss

Speed levers, recorded as a suffix of the mode's key: `--compile` (torch.compile of the norm and
MLP modules and the rotary functions, `model.compile=true`), `--compile-layers` (each decoder
layer and vision block compiled whole, `model.compile_scope=layers`) and `--bf16-params` (bf16 compute
weights with fp32 masters through FSDP2 on one rank, no autocast: `train.fsdp=always`). A run
under `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` gets the suffix `+expandable`; every
row records the caching allocator's retries and cudaMalloc / cudaFree calls in the timed steps.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from vlpack.config import DataConfig
from vlpack.data.batch import build_thd_batch
from vlpack.data.encode import Encoder
from vlpack.data.loader import open_dataset
from vlpack.data.padded import build_padded_batch
from vlpack.data.plan import plan_bins
from vlpack.data.types import IGNORE_INDEX
from vlpack.model.build import build_model
from vlpack.model.forward import stock_visuals
from vlpack.model.presets import get_preset, reduced_depth
from vlpack.train.distributed.parallel import Topology
from vlpack.train.optim import build_optimizer, build_scheduler
from vlpack.train.run.metrics import allocator_counts
from vlpack.train.run.profile import StepProfiler, count_host_syncs
from vlpack.train.setup.flops import flop_model
from vlpack.train.setup.prepare import Preparation, prepare
from vlpack.train.setup.stack import build_stack
from vlpack.train.step import optimizer_step

MODES = ("vlpack_packed", "vlpack_padded", "hf_padded", "hf_padding_free")
PEAK = 989e12


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device: torch.device) -> float | None:
    """Measured dense bf16 matmul FLOP/s (8192³), the practical ceiling."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    sync(device)
    t = time.perf_counter()
    for _ in range(20):
        a @ a
    sync(device)
    return 20 * 2 * 8192**3 / (time.perf_counter() - t)


class Timer:
    """CUDA-event (or wall-clock) timing of named regions, summed over steps."""

    def __init__(self, device: torch.device):
        self.device, self.open, self.done = device, {}, []

    def start(self, name: str) -> None:
        if self.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.open[name] = e
        else:
            self.open[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        s = self.open.pop(name)
        if self.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.done.append((name, s, e))
        else:
            self.done.append((name, time.perf_counter() - s, None))

    @contextlib.contextmanager
    def region(self, name: str):
        """`start(name)` … `stop(name)` around a block (optimizer_step's `phase`)."""
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def totals(self) -> dict[str, float]:
        sync(self.device)
        out: dict[str, float] = {}
        for name, s, e in self.done:
            out[name] = out.get(name, 0.0) + (s.elapsed_time(e) / 1e3 if e is not None else s)
        return out


def hook_regions(model, timer: Timer) -> list:
    """Forward timing of the vision tower and the language model."""
    handles = []
    for name, mod in (("vision_fwd", model.model.visual), ("text_fwd", model.model.language_model)):
        handles.append(mod.register_forward_pre_hook(lambda m, a, n=name: timer.start(n)))
        handles.append(mod.register_forward_hook(lambda m, a, o, n=name: timer.stop(n)))
    return handles


def model_name(args) -> str:
    """The preset to build: `--model`, or its first `--layers` text layers."""
    return reduced_depth(args.model, args.layers) if args.layers else args.model


def _share(value: str) -> float | str:
    """--checkpoint-share: what `model.checkpoint_share` takes (a share in (0, 1] or auto),
    refused with the config's own message."""
    from vlpack.config import ModelConfig

    try:
        share = value if value == "auto" else float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: a share in (0, 1], e.g. 0.5, or auto") from None
    try:
        ModelConfig(checkpoint_share=share)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return share


def variant(mode: str, args) -> str:
    """The result key: the mode plus its speed levers (`vlpack_packed+compile+bf16_params`;
    `+ac1` with activation checkpointing of every layer, `+ac0.5` of half of each stack, `+acauto`
    of the share the memory plan chose, recorded as the result's `recompute_share`)."""
    share = args.checkpoint_share
    ac = (f"+ac{share:g}" if share != "auto" else "+acauto") if args.activation_checkpointing else ""
    expandable = "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower()
    return (mode + "+compile" * args.compile + "+compile_layers" * args.compile_layers
            + "+vision_attn" * args.trace_vision_attention
            + "+bf16_params" * args.bf16_params + ac
            + (f"+experts_{args.experts}" if args.experts else "")
            + (f"+lora{args.lora_rank}" if args.lora_rank else "")
            + (f"+lora_experts_{args.lora_experts}" if args.lora_experts != "off" else "")
            + (f"+frozen_{args.frozen_dtype}"
               if args.frozen_dtype != "auto" and mode.startswith("vlpack") else "")
            + "+expandable" * expandable)


def hf_padded_loss(model, b, spec):
    visuals = stock_visuals(spec, pixel_values=b.pixel_values, image_grid_thw=b.image_grid_thw,
                            pixel_values_videos=b.pixel_values_videos,
                            video_grid_thw=b.video_grid_thw,
                            second_per_grid_ts=b.second_per_grid_ts)
    out = model(input_ids=b.input_ids, attention_mask=b.attention_mask,
                mm_token_type_ids=b.mm_token_type_ids, use_cache=False, **visuals)
    return torch.nn.functional.cross_entropy(
        out.logits.flatten(0, 1).float(), b.labels.flatten(), ignore_index=IGNORE_INDEX,
        reduction="sum")


def visual_kinds(b, merge: int) -> tuple[int, ...]:
    """The kind of each visual item of a packed row on the host (1 image, 2 video): the token
    type of its first placeholder. `merge` patches make one token."""
    if b.pixel_values is None or not b.image_grids:
        return ()
    types = b.mm_token_type_ids
    assert types.device.type == "cpu", "read the kinds before the batch moves to the device"
    visual = types[types != 0].tolist()
    patches = [t * h * w for t, h, w in b.image_grids]
    assert sum(patches) == merge * len(visual), (sum(patches), merge, len(visual))
    starts = [0, *itertools.accumulate(n // merge for n in patches)][:-1]
    return tuple(visual[s] for s in starts)


def stock_visual_streams(b, kinds: tuple[int, ...]) -> dict:
    """A packed row's one visual stream (`ThdBatch.pixel_values`, images and videos in row
    order) as transformers takes it, images and videos apart (`kinds`: `visual_kinds`), by
    slicing the batch's tensors where they are (no host wait)."""
    streams: dict[int, tuple[list, list]] = {1: ([], []), 2: ([], [])}
    patch = 0
    for i, (kind, (t, h, w)) in enumerate(zip(kinds, b.image_grids, strict=True)):
        pixels, grids = streams[kind]
        pixels.append(b.pixel_values[patch : patch + t * h * w])
        grids.append(b.image_grid_thw[i : i + 1])
        patch += t * h * w
    out = {}
    for kind, names in ((1, ("pixel_values", "image_grid_thw")),
                        (2, ("pixel_values_videos", "video_grid_thw"))):
        pixels, grids = streams[kind]
        if pixels:
            out[names[0]], out[names[1]] = torch.cat(pixels), torch.cat(grids)
    return out


def hf_padding_free_loss(model, b, kinds: tuple[int, ...]):
    """Stock transformers packing: 4-row position ids, no attention mask, no cu kwargs."""
    model.model.rope_deltas = None
    out = model(input_ids=b.input_ids[None], position_ids=b.position_ids[:, None],
                mm_token_type_ids=b.mm_token_type_ids[None], use_cache=False,
                **stock_visual_streams(b, kinds))
    return torch.nn.functional.cross_entropy(
        out.logits[0].float(), b.labels, ignore_index=IGNORE_INDEX, reduction="sum")


def make_batches(samples, mode: str, spec, seq_len: int, batch: int):
    if mode in ("vlpack_padded", "hf_padded"):
        return [build_padded_batch(samples[i : i + batch], pad_token_id=spec.pad_token_id)
                for i in range(0, len(samples) - batch + 1, batch)]
    bins = plan_bins([len(s) for s in samples], seq_len, "bfd")
    # bins of the unpadded lengths, so no alignment padding; the hf modes' MRoPE rule
    return [build_thd_batch([samples[i] for i in b], pad_token_id=spec.pad_token_id,
                            pad_to_multiple_of=1, spatial_merge_size=spec.merge_size,
                            mrope_after_video="transformers") for b in bins]


def _progress(mode: str, what: str, t0: float) -> None:
    """One line per setup phase and warmup step (to stderr): where a cut-off run spent its time."""
    print(f"{mode:>16}: {what} at {time.perf_counter() - t0:6.1f} s", file=sys.stderr, flush=True)


def vlpack_config(mode: str, args):
    """The trainer's config of a vlpack mode: the bench's flags as `model.*` / `train.*` keys."""
    from vlpack.config import load_config

    compile_scope = "layers" if args.compile_layers else "regions" if args.compile else None
    keys = [f"model.name={model_name(args)}", "model.init=random",
            f"data.packing={'bfd' if mode == 'vlpack_packed' else 'none'}",
            f"model.activation_checkpointing={str(args.activation_checkpointing).lower()}",
            f"model.checkpoint_share={args.checkpoint_share}",
            f"data.seq_len={args.seq_len}", "data.pad_to_multiple_of=1",  # the plan's bins
            f"model.compile={str(compile_scope is not None).lower()}",
            f"model.lora.rank={args.lora_rank}", f"model.lora.alpha={2 * args.lora_rank}",
            f"model.lora.experts={str(args.lora_experts != 'off').lower()}",
            f"model.frozen_dtype={args.frozen_dtype}",
            f"train.fsdp={'always' if args.bf16_params else 'auto'}",
            "train.memory_check=skip", "train.kernel_cache=default",
            "optim.lr=1e-5", "optim.weight_decay=0.0"]
    if compile_scope:
        keys.append(f"model.compile_scope={compile_scope}")
    return load_config("tiny", keys)


def run_mode(mode: str, args, samples, device) -> dict:
    t0 = time.perf_counter()
    topo = Topology(rank=0, world_size=1, local_rank=0, device=device)
    cfg = vlpack_config(mode, args)  # both kinds of mode read their settings from it
    m = cfg.model
    if mode.startswith("vlpack"):  # the model `vlpack train` builds (train/setup/stack.py)
        stack = build_stack(cfg, topo, loss_method=None if args.loss == "auto" else args.loss,
                            trace_vision_attention=args.trace_vision_attention)
        model, spec, module = stack.model, stack.spec, stack.module
        recompute = stack.plan.recompute_share  # model.checkpoint_share=auto resolved
        if args.experts and spec.is_moe:
            model.set_experts_implementation(args.experts)
        if args.lora_experts == "peft":  # peft's own forward: W + B·A as a parametrization
            from peft.tuners.lora.layer import ParamWrapper

            for w in model.modules():
                if isinstance(w, ParamWrapper):
                    w.__class__ = ParamWrapper
        params = list(module.parameters())
    else:  # stock transformers: the HF model as built, its own loss
        # stock + peft loads the base in bf16 on a GPU (a 35B base in float32 would not fit) and
        # keeps the adapters in float32, as peft does by default (the preparation holds every
        # trainable parameter in float32)
        low = m.lora.rank and device.type == "cuda"
        model, spec = build_model(m.name, backend="sdpa", device=device, seed=0,
                                  dtype=torch.bfloat16 if low else torch.float32)
        recompute = m.checkpoint_share if m.activation_checkpointing else 0.0
        prepare(model, Preparation(
            model_name=m.name, lora=m.lora if m.lora.rank else None,
            frozen_dtype=torch.bfloat16 if low else None, recompute_share=recompute,
            compile_scope=m.compile_scope if m.compile else None,
            trace_vision_attention=args.trace_vision_attention,
            sharded=args.bf16_params, param_dtype=torch.bfloat16), topo=topo, root=model)
        params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, cfg.optim, device_type=device.type) if args.optimizer else None
    flops = flop_model(model)
    batches = make_batches(samples, mode, spec, args.seq_len, args.batch)
    _progress(mode, f"model built, {len(batches)} distinct batches", t0)
    need = args.warmup + args.steps + (args.profile_steps + 1 if args.profile else 0)
    batches = (batches * (need // len(batches) + 1))[:need]
    if mode.startswith("vlpack"):  # the trainer's step needs an optimizer and a schedule
        if opt is None:  # --no-optimizer: a stateless stand-in that leaves the weights as they are
            opt = torch.optim.SGD(params, lr=0.0)
        sched = build_scheduler(opt, cfg.optim, need)
    if device.type == "cuda":  # as the trainer's DataLoader (pin_memory=True) hands them over
        batches = [b.pin_memory() for b in batches]
    timer = Timer(device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16)
                if device.type == "cuda" and not args.bf16_params else contextlib.nullcontext())
    paths: dict = {}  # which kernels the vlpack forward ran (ForwardOut.paths)
    if mode.startswith("vlpack"):
        module.register_forward_hook(lambda m, args, out: paths.update(out.paths))

    def step(b, measuring: bool):
        vlpack = mode.startswith("vlpack")
        if not vlpack:  # read on the host before the batch moves: no waits
            n = int((b.labels != IGNORE_INDEX).sum())
            kinds = visual_kinds(b, spec.merge_size**2) if mode == "hf_padding_free" else ()
        timer.start("data") if measuring else None
        b = b.to(device, non_blocking=True)
        timer.stop("data") if measuring else None
        if vlpack:  # the trainer's own step (train/step.py), its phases timed
            return optimizer_step(module, opt, sched, [b], topo=topo,
                                  aux_coef=cfg.train.aux_loss_coef, grad_clip=cfg.optim.grad_clip,
                                  autocast=stack.autocast,
                                  phase=timer.region if measuring else None)
        timer.start("forward") if measuring else None
        with autocast:
            loss = (hf_padded_loss(model, b, spec) if mode == "hf_padded" else
                    hf_padding_free_loss(model, b, kinds))
        timer.stop("forward") if measuring else None
        timer.start("backward") if measuring else None
        (loss / n).backward()
        timer.stop("backward") if measuring else None
        timer.start("optimizer") if measuring else None
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)
        timer.stop("optimizer") if measuring else None

    real = tokens = 0
    flop_total = 0.0
    for i, b in enumerate(batches[: args.warmup]):  # the first steps compile and autotune
        step(b, False)
        sync(device)
        _progress(mode, f"warmup step {i + 1}/{args.warmup} ({b.num_tokens} tokens) done", t0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    allocs0 = allocator_counts(device)
    handles = hook_regions(model, timer)
    t_start = time.perf_counter()
    for b in batches[args.warmup : args.warmup + args.steps]:
        flop_total += flops.of_batch(b)  # from host tensors, outside the timed regions
        real += b.num_real_tokens
        tokens += b.num_tokens
        step(b, True)
    sync(device)
    wall = time.perf_counter() - t_start
    for h in handles:
        h.remove()
    parts = timer.totals()
    # The forward outside the vision tower and the language model: the loss (liger's fused loss
    # computes its gradient here too), the embedding merge of image features, position handling.
    # (a step whose bins hold no image runs no vision tower)
    parts["loss_and_glue_fwd"] = (parts.pop("forward") - parts.setdefault("vision_fwd", 0.0)
                                  - parts["text_fwd"])
    parts["unaccounted"] = wall - sum(parts.values())  # GPU idle between regions (host syncs)
    opt_s = parts.get("optimizer", 0.0)
    train_s = wall - opt_s  # forward + backward (+ data), the anchor's definition
    res = {
        "real_tokens_per_s": real / train_s,
        "real_tokens_per_s_with_optimizer": real / wall if args.optimizer else None,
        "padding_share": 1 - real / tokens,
        "recompute_share": recompute,
        "mfu": flop_total / train_s / PEAK,
        "peak_mem_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                         if device.type == "cuda" else None),
        "reserved_gib": (torch.cuda.max_memory_reserved(device) / 2**30
                         if device.type == "cuda" else None),
        # the caching allocator's retries and cudaMalloc / cudaFree calls in the timed steps
        # (a retry or a cudaFree waits for the whole GPU)
        "allocator": {k: v - allocs0[k] for k, v in allocator_counts(device).items()},
        "optimizer": ("AdamW, fp32 states" if args.optimizer else
                      "SGD at lr 0, no state (the trainer's step needs one)" if mode.startswith("vlpack")
                      else "none (forward + backward)"),
        "tokens_per_step": tokens / args.steps,
        "real_tokens_per_step": real / args.steps,
        "step_s": wall / args.steps,
        "breakdown_s_per_step": {k: v / args.steps for k, v in parts.items()},
        "flops_per_step": flop_total / args.steps,
        "paths": paths or ("stock transformers" if mode.startswith("hf") else "vlpack padded: sdpa, "
                                                                     "stock layers, vlpack loss"),
    }
    if args.profile:
        *profiled, last = batches[args.warmup + args.steps :]
        res["profile"] = profile_steps(step, profiled, device,
                                       Path(args.profile) / f"profile_{variant(mode, args)}.txt",
                                       res["step_s"], stacks=args.profile_stacks)
        # every point where the host waited for the GPU in one step (sync debug mode)
        res["host_syncs"] = count_host_syncs(lambda: step(last, False), device)
    return res


def profile_steps(step, batches, device, out: Path, step_s: float, stacks: bool = False) -> dict:
    """Run `batches` under torch.profiler; write its summary to `out` (vlpack.train.run.profile)."""
    prof = StepProfiler(out, start=1, count=len(batches), device=device, stacks=stacks)
    for i, b in enumerate(batches, 1):
        prof.before(i)
        step(b, False)
        prof.after(i, reference_step_s=step_s)
    return prof.summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3_vl")
    p.add_argument("--layers", type=int, default=None, help="reduce text depth (big MoE shapes)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--checkpoint-share", type=_share, default=1.0,
                   help="with --activation-checkpointing: share of each layer stack recomputed, "
                        "or auto (vlpack modes: the least share whose memory plan fits)")
    p.add_argument("--optimizer", action=argparse.BooleanOptionalAction, default=True,
                   help="step AdamW (fp32 states); --no-optimizer for shapes whose states do "
                        "not fit one GPU (throughput never counts the optimizer)")
    p.add_argument("--loss", default="chunked", choices=("chunked", "liger", "plain", "auto"),
                   help="vlpack modes' loss path; chunked is what `vlpack train` uses "
                        "(model.chunked_loss=true); auto = chunked. Runs before this flag existed used "
                        "liger on GPU")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the norms, MLPs and rotary functions (model.compile=true)")
    p.add_argument("--compile-layers", action="store_true",
                   help="torch.compile each decoder layer and vision block whole "
                        "(model.compile_scope=layers)")
    p.add_argument("--trace-vision-attention", action="store_true",
                   help="with --compile-layers: trace the vision attention module too, its "
                        "kernel call the only graph break (docs/benchmarks/levers.md)")
    p.add_argument("--bf16-params", action="store_true",
                   help="bf16 compute weights, fp32 masters: FSDP2 on one rank, no autocast "
                        "(train.fsdp=always)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="profile --profile-steps more steps per mode into DIR/profile_MODE.txt, "
                        "then count the host syncs of one more step")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--profile-stacks", action="store_true",
                   help="add a table of host time by Python call site to the profile")
    p.add_argument("--experts", default=None,
                   choices=("vlpack_grouped_mm", "vlpack_grouped_mm_compiled", "grouped_mm",
                            "batched_mm", "eager"),
                   help="MoE experts implementation of the vlpack modes (default: the build's, "
                        "vlpack_grouped_mm; vlpack_grouped_mm_compiled with --compile or "
                        "--compile-layers)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="LoRA of this rank (alpha 2·rank) on the LLM's projections, as "
                        "model.lora.rank, the frozen base held in bf16 on a GPU; stock modes get "
                        "the same adapters through peft; the optimizer steps the adapters only "
                        "and MFU counts a frozen weight at 4 FLOPs")
    p.add_argument("--lora-experts", choices=("off", "grouped", "peft"), default="off",
                   help="with --lora-rank, LoRA on the routed experts too (model.lora.experts): "
                        "grouped = vlpack's dispatch with the factors (model/lora.py), peft = "
                        "peft's parametrization forming W + B·A per forward (the vlpack modes)")
    p.add_argument("--frozen-dtype", choices=("auto", "float32", "int8"), default="auto",
                   help="model.frozen_dtype of the vlpack modes: int8 holds the frozen routed "
                        "experts in int8 (model/quant.py)")
    p.add_argument("--max-pixels", type=int, default=None)
    p.add_argument("--out", default=None, help="merge results into this JSON file")
    p.add_argument("--stacks-every", type=float, default=0, metavar="S",
                   help="print every thread's Python stack to stderr every S seconds")
    args = p.parse_args(argv)
    if args.frozen_dtype == "int8" and args.experts not in (None, "vlpack_grouped_mm",
                                                             "vlpack_grouped_mm_compiled"):
        p.error("--frozen-dtype int8 runs vlpack's experts kernel: leave --experts out or name "
                "vlpack_grouped_mm(_compiled)")
    if args.lora_experts != "off" and not args.lora_rank:
        p.error("--lora-experts adapts the experts too: give --lora-rank")
    if args.checkpoint_share == "auto" and args.modes != "vlpack_packed":
        p.error("--checkpoint-share auto is model.checkpoint_share=auto, which plans packed "
                "rows: run it with --modes vlpack_packed, the other modes with a share")
    if args.stacks_every:  # where a slow setup or first step spends its time, if it is cut off
        faulthandler.dump_traceback_later(args.stacks_every, repeat=True, file=sys.stderr)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.bf16_params and device.type != "cuda":
        p.error("--bf16-params needs a GPU (on CPU everything runs in float32)")
    if args.compile and args.compile_layers:
        p.error("--compile and --compile-layers are two scopes of one lever: pass one of them")
    if args.trace_vision_attention and not args.compile_layers:
        p.error("--trace-vision-attention changes what --compile-layers compiles: add "
                "--compile-layers")
    family = get_preset(args.model).family
    enc = Encoder.from_config(DataConfig(max_pixels=args.max_pixels), family, None)
    items = [c for c in open_dataset("synthetic", None, synthetic_samples=args.samples)
             if not isinstance(c, Exception)]
    samples = [enc.encode(c) for c in items]
    samples = [s for s in samples if len(s) <= args.seq_len]
    mean = sum(len(s) for s in samples) / len(samples)
    image_share = sum(int((s.mm_token_type_ids > 0).sum()) for s in samples) / sum(map(len, samples))
    rate = matmul_rate(device)
    result = {
        "model": args.model, "layers": args.layers, "device": torch.cuda.get_device_name(0)
        if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "command": "python " + " ".join(sys.argv), "samples": len(samples),
        "mean_tokens_per_sample": mean, "image_token_share": image_share,
        "matmul_bf16_tflops": rate / 1e12 if rate else None, "modes": {},
    }
    for base in args.modes.split(","):
        mode = variant(base, args)
        try:
            r = run_mode(base, args, samples, device)
        except torch.OutOfMemoryError as e:  # recorded, not hidden: the mode does not fit
            print(f"{mode:>16}: out of memory ({str(e).splitlines()[0]})", flush=True)
            result["modes"][mode] = {"error": "out of memory", "real_tokens_per_s": None,
                                     "mfu": None, "peak_mem_gib": None}
            continue
        finally:  # the mode's model and optimizer are garbage once run_mode returns
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if rate:
            r["mfu_vs_matmul"] = r["mfu"] * PEAK / rate
        r["command"] = result["command"]  # modes of one shape may come from separate processes
        result["modes"][mode] = r
        print(f"{mode:>16}: {r['real_tokens_per_s']:9.0f} real tok/s  MFU {100 * r['mfu']:5.1f}%  "
              f"peak {r['peak_mem_gib'] or 0:5.1f} GiB  step {r['step_s']:.3f}s  "
              f"{ {k: round(v, 4) for k, v in r['breakdown_s_per_step'].items()} }", flush=True)
        if r.get("allocator"):
            print(f"{'':>16}  reserved {r['reserved_gib']:.1f} GiB, allocator in the timed steps: "
                  f"{r['allocator']}", flush=True)
        if r.get("host_syncs"):
            print(f"{'':>16}  host syncs in one step: {r['host_syncs']['count']}  "
                  f"{r['host_syncs']['sites']}", flush=True)
    if args.out:
        path = Path(args.out)
        allres = json.loads(path.read_text()) if path.exists() else {}
        key = args.model + (f"-{args.layers}L" if args.layers else "")
        if key in allres:  # one process per mode (fair: no mode inherits another's warm caches)
            result["modes"] = {**allres[key]["modes"], **result["modes"]}
        allres[key] = result
        path.write_text(json.dumps(allres, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
