"""The stack builder: memory plan → build → the preparation (train/setup/prepare.py: LoRA → freeze →
frozen weights' dtype → int8 experts, quantized on the device, from host memory for a folder →
activation checkpointing → compile → FSDP2), from the config's `model`, `data` and `train`
sections. `vlpack train`, `bench/convergence.py` and `bench/train_throughput.py` build through
`build_stack`, so a benchmark's figures come from the model the trainer runs.

`vlpack check` (check/command.py) builds through the same build stage, `build_base` (build →
LoRA, the model, backend, seed and weights of its config), by `build_check_model`. Not through
`build_stack`: the check proves its contract in float32 on one whole copy of the model per
process (under `--cp` every rank holds all of it and sums the gradients, where FSDP2 would
shard it), runs the unpacked reference on the same weights, and builds no optimizer; so its
memory need is its own (weights, their gradients and a gradient copy per side, no AdamW state
or activations of `data.seq_len`) and freezing, checkpointing, compile and FSDP2 do not apply.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vlpack.config import Config
from vlpack.model.build import ModelSpec
from vlpack.train.distributed.parallel import Topology, all_reduce, load_full_state
from vlpack.train.setup import memory
from vlpack.train.setup.flops import FlopModel, flop_model
from vlpack.train.setup.kernel_cache import keep_kernel_cache, use_tuned_kernels
from vlpack.train.setup.module import TrainModule
from vlpack.train.setup.prepare import Preparation, preparation, prepare

log = logging.getLogger("vlpack.train")


@dataclass
class Stack:
    """A model ready to train: the HF model, its facts, the module a micro-batch runs through."""

    model: nn.Module
    spec: ModelSpec
    """The model's facts (model/build.py): family, token ids, merge size."""
    module: TrainModule
    flops: FlopModel
    """FLOPs per batch, counted after freezing (a frozen weight costs 4 FLOPs, not 6)."""
    plan: memory.MemoryPlan
    ways_out: list[str]
    """The settings that lower the plan (for refusals and out-of-memory messages)."""
    autocast: torch.dtype | None
    """The dtype a step autocasts to; None without autocast or under FSDP2 (its policy casts)."""
    sharded: bool
    """FSDP2 applies: the model was built on the meta device and received its shards."""
    tuned_kernels: Path | None = None
    """The folder of fla kernel configurations this process uses (None: fla autotunes)."""


def plan_memory(cfg: Config, topo: Topology, prep: Preparation, *, free: int | None = None,
                autotunes: bool = False, shorten: bool | None = None
                ) -> tuple[memory.MemoryPlan, list[str]]:
    """The run's memory plan per device (train/setup/memory.py), from the model's shapes on the
    meta device prepared by `prep` (`preparation(cfg, topo)`) up to its int8 experts (LoRA,
    freezing, the frozen weights' dtype; sharded by FSDP2 where `prep.sharded`), and the ways
    out that apply to it. With
    `model.checkpoint_share=auto`, the plan of the least share that fits `free` bytes (None:
    this device's free memory), the same on every rank (`auto_share`).
    Where the plan at `data.seq_len` does not fit, the longest shorter length that does
    (`bin_lengths`) is `plan.fitting_seq_len` (`shorter_bins`), which the ways out name; under
    `train.memory_check=shorten` (`shorten`: None reads it from the config) the plan is that
    length's (`shorten_to_plan` applies it).
    `autotunes`: fla's kernels autotune in the first step (no kept configurations for this GPU),
    which a model with Gated-DeltaNet layers plans as `memory.AUTOTUNE_RESERVE` more."""
    from vlpack.model.build import meta_model

    m, d = cfg.model, cfg.data
    autocast, sharded = prep.autocast, prep.sharded
    shapes = meta_model(m.name, prep.build_dtype)  # as built: it decides what `hold` keeps low
    # as the build: only what trains keeps gradients and optimizer state (a LoRA run's adapters
    # outside the frozen groups)
    prepare(shapes, prep, last="int8", topo=topo, shapes=True)
    merge = shapes.config.vision_config.spatial_merge_size
    layers = shapes.config.text_config.num_hidden_layers
    gdn = "linear_attention" in (getattr(shapes.config.text_config, "layer_types", None) or ())
    transient = {"fla autotuning": memory.AUTOTUNE_RESERVE} if autotunes and gdn else {}
    if m.checkpoint_share == "auto" and m.activation_checkpointing and free is None:
        free = memory.available_bytes(topo.device)

    planned: dict[tuple[int, float], memory.MemoryPlan] = {}

    def plan_at(seq_len: int, share: float) -> memory.MemoryPlan:
        if (seq_len, share) not in planned:
            planned[seq_len, share] = plan_once(seq_len, share)
        return planned[seq_len, share]

    def plan_once(seq_len: int, share: float) -> memory.MemoryPlan:
        run = memory.RunShape(seq_len=seq_len // cfg.parallel.cp,
                              patches=d.max_patches or seq_len * merge**2,
                              recompute_share=share, act_bytes=2 if autocast else 4,
                              loss_chunk=1024 if m.chunked_loss else 0, compiled=m.compile)
        return dataclasses.replace(memory.plan(
            shapes, run, world_size=topo.world_size,
            sharing=memory.local_ranks() if topo.device.type == "cpu" else 1, sharded=sharded,
            build_dtype=prep.build_dtype, host_build=prep.host_build,
            data_seq_len=seq_len, optimizer=cfg.optim.name,
            offload=cfg.train.cpu_offload and sharded and topo.device.type != "cpu"),
            transient=transient)

    def plan_of(seq_len: int, *, announce: bool) -> memory.MemoryPlan:
        if not m.activation_checkpointing:
            return plan_at(seq_len, 0.0)
        if m.checkpoint_share == "auto":
            return auto_share(lambda share: plan_at(seq_len, share), layers, topo, free,
                              holds_copy=sharded and topo.is_main, announce=announce)
        return plan_at(seq_len, m.checkpoint_share)

    if not m.activation_checkpointing and m.checkpoint_share == "auto" and topo.is_main:
        log.warning("model.checkpoint_share=auto has no effect without "
                    "model.activation_checkpointing=true: nothing recomputes")
    plan = plan_of(d.seq_len, announce=False)
    room = free if free is not None else memory.available_bytes(topo.device)

    def fits(p: memory.MemoryPlan) -> bool:
        return memory.fits(p, topo.device, room, holds_copy=sharded and topo.is_main)

    if not all_fit([fits(plan)], topo)[0]:
        fitting = shorter_bins(lambda n: plan_of(n, announce=False), d.seq_len,
                               multiple=bin_multiple(cfg), topo=topo,
                               fits=fits)
        plan = dataclasses.replace(plan, fitting_seq_len=fitting or 0)
        if fitting and (cfg.train.memory_check == "shorten" if shorten is None else shorten):
            plan = plan_of(fitting, announce=False)
    if m.activation_checkpointing and m.checkpoint_share == "auto":  # the share of the plan chosen
        auto_share(lambda share: plan_at(plan.seq_len, share), layers, topo, free,
                   holds_copy=sharded and topo.is_main, announce=True)
    ways = memory.ways_out(plan, lora=bool(m.lora.rank), cp=cfg.parallel.cp,
                           vision_capped=d.max_patches is not None,
                           micro_batches=None if cfg.train.tokens_per_step else cfg.train.micro_batches)
    return plan, ways


MIN_BIN = 1024
"""The shortest bins `shorter_bins` tries (tokens)."""


def all_fit(flags: list[bool], topo: Topology) -> list[bool]:
    """Each flag, true where it is true on every rank (one collective)."""
    return [bool(x) for x in all_reduce([float(f) for f in flags], topo, op="min")]


def bin_multiple(cfg: Config) -> int:
    """What a shorter bin length must be a multiple of: each sample's alignment times the
    context-parallel ranks a row is split over."""
    return cfg.data.pad_to_multiple_of * cfg.parallel.cp


def bin_lengths(seq_len: int, multiple: int) -> list[int]:
    """The bin lengths below `seq_len` that `train.memory_check=shorten` may train, longest
    first: seq_len · k/16 for k = 15 .. 1, then the halvings of seq_len / 16, each rounded down
    to a multiple of `multiple`, none below MIN_BIN. Sixteenths rather than halvings alone: an
    80 GB card that cannot hold 16,384-token bins of the 35B recipe holds 10,240, which cut fewer
    long samples than 8,192 (its step is as fast per token: docs/benchmarks.md, runs 8-10)."""
    steps = [seq_len * k // 16 for k in range(15, 0, -1)]
    n = seq_len // 32
    while n >= MIN_BIN:
        steps.append(n)
        n //= 2
    lengths = {n - n % multiple for n in steps}
    return sorted((n for n in lengths if n >= max(MIN_BIN, multiple) and n < seq_len),
                  reverse=True)


def shorter_bins(plan_of: Callable[[int], memory.MemoryPlan], seq_len: int, *, multiple: int,
                 topo: Topology, fits: Callable[[memory.MemoryPlan], bool]) -> int | None:
    """The longest of `bin_lengths(seq_len, multiple)` whose plan fits on every rank; None
    where none does. A bisection (a plan grows with its bins), each probe decided on every
    rank alike (one collective), so the collectives inside `plan_of` (`auto_share`) run alike
    on all of them."""
    lengths = bin_lengths(seq_len, multiple)
    lo, hi = 0, len(lengths)  # the answer's index is in [lo, hi]; len(lengths): none fits
    while lo < hi:
        mid = (lo + hi) // 2
        if all_fit([fits(plan_of(lengths[mid]))], topo)[0]:
            hi = mid
        else:
            lo = mid + 1
    return lengths[lo] if lo < len(lengths) else None


def auto_share(plan_at: Callable[[float], memory.MemoryPlan], layers: int, topo: Topology,
               free: int | None, *, holds_copy: bool, announce: bool = True) -> memory.MemoryPlan:
    """`model.checkpoint_share=auto`: the plan of the least share k / `layers` (k recomputed
    text layers, 0 to all) that fits `free` bytes on this rank (`memory.fits`), the largest k of
    all ranks so every rank recomputes alike; all layers where the free memory is unknown or
    nothing fits (the plan's check then refuses the run). The plan shrinks as k grows, so a
    bisection finds k."""
    plans: dict[int, memory.MemoryPlan] = {}

    def at(k: int) -> memory.MemoryPlan:
        if k not in plans:
            plans[k] = plan_at(k / layers)
        return plans[k]

    lo, hi = (0, layers) if free is not None else (layers, layers)
    while lo < hi:
        mid = (lo + hi) // 2
        if memory.fits(at(mid), topo.device, free, holds_copy=holds_copy):
            hi = mid
        else:
            lo = mid + 1
    k = int(all_reduce([float(lo)], topo, op="max")[0])
    p = at(k)
    if topo.is_main and announce:
        room = ("the free memory unknown" if free is None else f"{free / memory.GIB:.1f} GiB free"
                + ("" if memory.fits(p, topo.device, free, holds_copy=holds_copy)
                   else ", which no share fits"))
        other = f" (rank 0 alone needs {lo}: another rank has less room)" if k != lo else ""
        log.info("model.checkpoint_share=auto: %d of %d text layers recompute (share %r)%s, "
                 "%.1f GiB planned with %s on rank 0", k, layers, round(p.recompute_share, 3), other,
                 p.train_bytes / memory.GIB, room)
    return p


def fla_autotunes(cfg: Config, device_name: str, environ: dict[str, str] | None = None) -> bool:
    """Whether fla's kernels autotune in the first step on `device_name`'s GPU: neither the
    configurations vlpack keeps for it (`train.tuned_kernels`) nor the user's own (FLA_CONFIG_DIR
    set in the environment) serve them."""
    from vlpack.train.setup.kernel_cache import FLA_DIR, keeps_configurations

    env = os.environ if environ is None else environ
    return FLA_DIR not in env and not (cfg.train.tuned_kernels and keeps_configurations(device_name))


def keep_resumed_bins(cfg: Config, resumed: tuple[int, int] | None, topo: Topology) -> bool:
    """A run resumed under `train.memory_check=shorten` keeps the bins it trained (one of
    `bin_lengths(data.seq_len)`, chosen on its first device): the data stream continues by bin
    position, so other bins would skip or repeat samples. Sets them in `cfg` and says so; True
    where it did (the plan then refuses what does not fit rather than shortening again)."""
    d, t = cfg.data, cfg.train
    if (t.memory_check != "shorten" or resumed is None
            or resumed[0] not in bin_lengths(d.seq_len, bin_multiple(cfg))):
        return False
    if topo.is_main:
        log.info("train.memory_check=shorten: the resumed run trained %d-token bins, %d per step; "
                 "it keeps them (other bins would move the data stream's position)", *resumed)
    d.seq_len = resumed[0]
    if not t.tokens_per_step:
        t.micro_batches = resumed[1]
    return True


def shorten_to_plan(cfg: Config, plan: memory.MemoryPlan, topo: Topology,
                    free: int | None = None) -> None:
    """Train at the plan's bin length where `train.memory_check=shorten` chose a shorter one:
    data.seq_len becomes it and train.micro_batches `memory.micro_batches_for` it (unless
    train.tokens_per_step sets a step's bins), so a step's tokens stay as near as whole bins
    allow. `free`: the bytes the plan was fitted to, for the log (None: the device's now)."""
    d, t = cfg.data, cfg.train
    if not plan.seq_len or plan.seq_len == d.seq_len:
        return
    micro = memory.micro_batches_for(t.micro_batches, d.seq_len, plan.seq_len)
    if topo.is_main:
        steps = ("train.tokens_per_step sets each step's bins" if t.tokens_per_step else
                 f"train.micro_batches {t.micro_batches} → {micro} "
                 + memory.tokens_kept(t.micro_batches * d.seq_len, micro * plan.seq_len))
        log.info("train.memory_check=shorten: data.seq_len %d does not fit the device's %s; "
                 "training in %d-token bins (%s; samples longer than that meet "
                 "data.overlong=%s)", d.seq_len, _room_text(topo, free), plan.seq_len, steps,
                 d.overlong)
    if d.overlong == "error" and topo.is_main:
        log.warning("train.memory_check=shorten: a sample longer than %d tokens now stops the run "
                    "(data.overlong=error); set data.overlong=truncate or skip to train past such "
                    "samples", plan.seq_len)
    d.seq_len = plan.seq_len
    if not t.tokens_per_step:
        t.micro_batches = micro


def _room_text(topo: Topology, free: int | None) -> str:
    free = memory.available_bytes(topo.device) if free is None else free
    return "free memory" if free is None else f"{free / memory.GIB:.1f} GiB free"


def describe_choice(cfg: Config, plan: memory.MemoryPlan, prep: Preparation, *,
                    asked_seq_len: int) -> str:
    """One line: the configuration the run trains with and what chose it (bins, recomputed
    layers, compile, frozen weights' dtype, the plan's total)."""
    m, d, t = cfg.model, cfg.data, cfg.train
    bins = f"{d.seq_len:,}-token bins"
    if d.seq_len != asked_seq_len:
        bins += f" ({asked_seq_len:,} did not fit: train.memory_check=shorten)"
    per_step = (f"until {t.tokens_per_step:,} real tokens per step" if t.tokens_per_step
                else f"{t.micro_batches} per step")
    from vlpack.model.recompute import recomputed_layers

    layers = plan.text_layers
    k = recomputed_layers(plan.recompute_share, layers)
    recompute = (f"{k} of {layers} text layers recompute"
                 + (" (model.checkpoint_share=auto)" if m.checkpoint_share == "auto" else ""))
    if not m.activation_checkpointing:
        recompute = "no layer recomputes"
    compiled = (f"compiled ({m.compile_scope})" if m.compile else "eager")
    frozen = "" if not prep.freezes else (
        f", frozen weights {m.frozen_dtype if m.frozen_dtype != 'auto' else 'in the compute dtype'}")
    return (f"{bins}, {per_step}; {recompute}; {compiled}{frozen}; "
            f"{plan.train_bytes / memory.GIB:.1f} GiB planned per device")


def check_plan(plan: memory.MemoryPlan, cfg: Config, topo: Topology, prep: Preparation,
               ways: list[str], *, setting: str = "refuse", free: int | None = None,
               host: bool = True) -> None:
    """Refuse a run whose plan exceeds the free memory (`free` bytes; None: the device's now),
    before building it (`setting`: train.memory_check; `warn` logs the refusal and goes on).
    `host`: also check this host's memory for a whole copy the run builds there (rank 0's of a
    sharded run, or one process's host build: `prep` says), not for a card planned from
    another machine."""
    if setting == "skip":
        return
    device = topo.device
    free = memory.available_bytes(device) if free is None else free
    holds_copy = prep.sharded and topo.is_main
    try:
        memory.check_fits(plan, device, free, model=cfg.model.name, holds_copy=holds_copy,
                          ways=[*ways, "train.memory_check=warn to start it anyway"])
        if host and (holds_copy or prep.host_build) and device.type != "cpu":
            memory.check_host_copy(plan, memory.available_bytes(torch.device("cpu")),
                                   model=cfg.model.name)
    except ValueError as e:
        if setting != "warn":
            raise
        log.warning("train.memory_check=warn: starting although %s", e)


def build_base(cfg: Config, device: torch.device, dtype: torch.dtype,
               prep: Preparation | None = None) -> tuple[nn.Module, ModelSpec]:
    """Build → LoRA: the model of `cfg.model` on `device` in `dtype` (random weights seeded by
    `train.seed`; stock SDPA for `data.packing=none`) and its `ModelSpec`, prepared by `prep`
    (None: `cfg`'s preparation on `device`) up to its LoRA. The build stage of `build_stack`
    and of `build_check_model`."""
    from vlpack.model.build import build_model

    m = cfg.model
    backend = "sdpa" if cfg.data.packing == "none" else m.backend
    model, spec = build_model(m.name, backend=backend, dtype=dtype, device=device,
                              seed=cfg.train.seed, random_init=m.init == "random")
    if prep is None:
        prep = preparation(cfg, Topology(rank=0, world_size=1, local_rank=0, device=device))
    prepare(model, prep, last="lora")
    return model, spec


CHECK_BYTES_PER_PARAM = 16
"""What `vlpack check` holds per parameter: the float32 weight, its gradient and one gradient
copy per side (packed, unpacked), 4 bytes each."""


def build_check_model(cfg: Config, device: torch.device) -> tuple[nn.Module, ModelSpec]:
    """The model `vlpack check` runs on: refused up front (instead of being killed) when
    `CHECK_BYTES_PER_PARAM` per parameter exceed 90% of `device`'s free memory (a folder's
    weights are sized by loading them), then `build_base` in float32 on `device` (the module
    docstring says why not `build_stack`)."""
    from vlpack.model.build import meta_model

    m = cfg.model
    if not Path(m.name).is_dir() or m.init == "random":
        need = CHECK_BYTES_PER_PARAM * sum(p.numel() for p in meta_model(m.name).parameters())
        free = memory.available_bytes(device)
        if free is not None and need > 0.9 * free:
            raise ValueError(
                f"vlpack check of {m.name} needs about {need / 2**30:.0f} GiB on {device} (fp32 "
                f"weights, gradients and two gradient copies) but {free / 2**30:.0f} GiB is "
                "free: run it on a device with more memory, or check a smaller preset of the "
                "same family")
    return build_base(cfg, device, torch.float32)


def build_stack(cfg: Config, topo: Topology, *, context=None, loss_method: str | None = None,
                trace_vision_attention: bool = False,
                resumed_bins: tuple[int, int] | None = None) -> Stack:
    """Plan, check, build and prepare the model of `cfg` on this rank (`context`: the rank's
    context-parallel group, None without CP). `resumed_bins`: (data.seq_len,
    train.micro_batches) of the run this one resumes (`keep_resumed_bins`). Benchmarks' levers
    beyond the config: `loss_method` (`liger`, `plain`; None: the config's) and
    `trace_vision_attention` (with whole layers compiled, docs/benchmarks/levers.md)."""
    m, t = cfg.model, cfg.train
    prep = preparation(cfg, topo, trace_vision_attention=trace_vision_attention)
    sharded = prep.sharded
    if t.cpu_offload and not sharded:
        raise ValueError("train.cpu_offload=true offloads FSDP2's shards, and this run is not "
                         "sharded: set train.fsdp=always (or run several processes)")
    if sharded and prep.int8_experts:
        raise ValueError("model.frozen_dtype=int8 runs on one process without FSDP2 (FSDP2 "
                         "shards the bf16 base instead): use model.frozen_dtype=auto with "
                         "several GPUs, or train.fsdp=auto on one")
    # Before anything imports fla (the memory plan's meta model does, through transformers):
    # fla reads its configuration settings when it is imported.
    tuned = None
    if topo.device.type == "cuda":
        keep_kernel_cache(t.kernel_cache, Path(t.output_dir), announce=topo.is_main)
        if t.tuned_kernels:
            tuned = use_tuned_kernels(torch.cuda.get_device_name(topo.device))
    kept = keep_resumed_bins(cfg, resumed_bins, topo)
    plan, ways = plan_memory(
        cfg, topo, prep, shorten=False if kept else None,
        autotunes=topo.device.type == "cuda" and fla_autotunes(
            cfg, torch.cuda.get_device_name(topo.device)))
    check_plan(plan, cfg, topo, prep, ways, setting=t.memory_check)
    prep = prep.after(plan)  # model.checkpoint_share=auto resolved
    asked = cfg.data.seq_len
    shorten_to_plan(cfg, plan, topo)
    if topo.is_main:
        log.info("training with %s", describe_choice(cfg, plan, prep, asked_seq_len=asked))
    torch.manual_seed(t.seed)
    # FSDP2 runs build shapes only and receive their shards from rank 0's whole CPU copy after
    # sharding (load_full_state); one process builds on its device directly.
    model, spec = build_base(cfg, torch.device("meta") if sharded else torch.device("cpu")
                             if prep.host_build else topo.device, prep.build_dtype, prep)
    if m.compile and cfg.data.packing == "none":
        log.warning("model.compile with data.packing=none: the compiled padded step ran slower "
                    "than the eager one (docs/benchmarks/levers.md); set model.compile=false for "
                    "padded runs")
    if prep.lora is not None:
        from vlpack.model import lora

        log.info(lora.describe(model))
    module = TrainModule(model, spec, touch_vision=topo.distributed,
                         loss_method=loss_method or ("chunked" if m.chunked_loss else "plain"),
                         context=context)
    prepare(model, prep, first="freeze", topo=topo, root=module)  # build_base applied LoRA
    flops = flop_model(model)  # after freezing: frozen weights cost 4 FLOPs, not 6
    autocast = prep.autocast
    if sharded:
        autocast = None  # FSDP's mixed-precision policy casts instead
        if topo.is_main:
            log.info("rank 0 builds the whole model in host memory; every rank then receives "
                     "its shards")
        whole = build_base(cfg, torch.device("cpu"), prep.build_dtype, prep)[0] \
            if topo.is_main else None
        if whole is not None:  # the shards' dtypes, so rank 0 holds no float32 base
            prepare(whole, prep, first="freeze", last="hold")
        load_full_state(model, whole, topo, cpu_offload=t.cpu_offload)
        del whole
    return Stack(model=model, spec=spec, module=module, flops=flops, plan=plan, ways_out=ways,
                 autocast=autocast, sharded=sharded, tuned_kernels=tuned)
