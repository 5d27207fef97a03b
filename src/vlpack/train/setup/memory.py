"""Will the run fit? A plan of its memory per device, made from the model's shapes (built on the
meta device) and the run's settings before anything is allocated, so a run too large for the
machine is refused in seconds with the numbers and the ways out, not after minutes with an
out-of-memory kill. `vlpack train ... --dry-run` prints the plan.

Per device, in training:

  weights      every parameter at the dtype it is held in (train/setup/precision.py: frozen matmul
               weights in bf16 on a GPU, the rest float32; frozen routed experts in int8 with
               float32 row scales under model.frozen_dtype=int8), 1/world of them under FSDP2
  gradients    4 bytes per trainable parameter (float32), 1/world under FSDP2 (a LoRA run's
               trainable parameters: the adapters, DoRA's magnitudes included)
  optimizer    AdamW's two float32 moments: 8 bytes per trainable parameter, 1/world; under
               optim.name=adamw8bit 1 byte per value and moment, a float32 scale per 256 values
               and a 256-entry float32 code table per moment of each tensor of at least 4,096
               values (`moment_bytes`; smaller tensors keep float32 moments)
  offloaded    under train.cpu_offload (FSDP2 on an accelerator) the weight shards, gradients
               and optimizer state live in host memory: 0 on the device, this rank's share on
               the host (`check_host_copy` counts every local rank's)
  activations  one micro-batch at a time (accumulation frees each backward's activations):
               T = data.seq_len / parallel.cp tokens per rank and up to P vision patches
               (data.max_patches, else every token an image token: T · merge²).
               A recomputed layer keeps only its input (the float32 residual, 4·h bytes per
               token); a kept layer keeps what its backward reads (`layer_bytes`: projections'
               outputs, attention and Gated-DeltaNet kernel inputs, the MLP or routed experts'
               intermediates). Backward recomputes one layer and holds the gradients of one
               layer's activations at a time: two layers' worth on top. Vision blocks count the
               same per patch, and nothing when the vision tower has no trainable parameter (no
               gradient flows into it, so autograd keeps nothing). The chunked loss holds one
               [chunk, vocab] float32 block of logits, the label rows' hidden gradients and, when
               the lm_head trains, a float32 copy of its gradient.
               The sum is scaled by ACTIVATION_SCALE, calibrated on the H200 against measured
               peaks (docs/training.md gives the error on the 2B, 8B and 35B shapes). int8
               experts add one expert weight dequantized to the compute dtype (not scaled);
               DoRA adds what its norm of the widest adapted linear takes (`dora_bytes`).

One process builds the model on its device (at the build dtype: bf16 when frozen weights are held
in bf16, else float32; `build_bytes`). An FSDP2 run builds shapes only on every device, and rank
0 builds the whole model once in host memory (`vlpack.train.distributed.parallel.load_full_state`). CPU ranks
of one host share its memory (`sharing`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from vlpack.model.experts import routed_expert
from vlpack.model.quant import scale_buffers
from vlpack.model.recompute import recomputed_layers

GIB = 2**30
ACTIVATION_SCALE = 0.85
"""Measured peak activation memory over the formula's: 0.76-0.87 on the H200 for the 2B, 8B and
35B-A3B recipes (docs/training.md, "What fits on one GPU")."""
CUDA_CONTEXT = int(0.52 * GIB)
"""What a GPU's CUDA context takes before PyTorch allocates: an H100 80GB reports 79.18 GiB in
`torch.cuda.mem_get_info`'s total and 78.66 GiB free once the context exists (`vlpack train
--dry-run --device-memory` subtracts it)."""
HEADROOM = 0.05
"""Share of the free memory left for the plan's error and kernels' workspaces: the measured peaks
lie within -5.5% to +1.7% of the plan and the reserved memory at most 2.8% above it
(docs/benchmarks/memory-plan/README.md)."""
AUTOTUNE_RESERVE = 8 * GIB
"""What a first step in which Triton autotunes fla's Gated-DeltaNet kernels takes beyond the
plan's tensors (on a GPU vlpack keeps no kernel configurations for, train/setup/kernel_cache.py): the
Qwen3.5-35B-A3B recipe on an H100 ran out of memory there twice with 71.8 and 72.1 GiB
allocated of 78.7 GiB free, where the same runs served from kept configurations peaked at 73.2
and 75.7 GiB."""
GPU_RESERVE = 2 * GIB
"""Bytes of a GPU's free memory the plan never counts on: what the caching allocator holds
beyond the tensors (0.6-0.9 GiB at the peak of the Qwen3.5-35B-A3B recipe on an H100, under the
expandable segments `vlpack train` sets) and kernels' and torch.compile's workspaces."""


@dataclass(frozen=True, slots=True)
class RunShape:
    """The settings of a run that decide its activation memory."""

    seq_len: int
    """Tokens of one packed row on one rank (data.seq_len / parallel.cp)."""
    patches: int
    """Vision patches of one row, at most."""
    recompute_share: float = 0.0
    """Share of each layer stack that recomputes (0: activation checkpointing off)."""
    act_bytes: int = 4
    """Bytes of an activation: 2 under bf16 autocast, else 4."""
    loss_chunk: int = 1024
    """Rows of the chunked loss's logits block (0: the whole [T, vocab] logits)."""
    compiled: bool = False
    """model.compile: the routed experts' dispatch runs compiled and keeps less (`routed_bytes`)."""


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Bytes per device of a run, by part (see the module docstring)."""

    params: int
    trainable: int
    weights: dict[str, int]
    """Bytes per device by the dtype the parameters are held in."""
    grads: int
    optimizer: int
    moments: str = "float32"
    """The optimizer moments' format the plan's line names (`8-bit` under optim.name=adamw8bit)."""
    offloaded: int = 0
    """Bytes of this rank's weight shards, gradients and optimizer state in host memory
    (train.cpu_offload; 0 on the device then)."""
    activations: dict[str, int] = field(default_factory=dict)
    """Bytes per device by part: text layers, recompute, vision, loss."""
    transient: dict[str, int] = field(default_factory=dict)
    """Bytes the first step takes besides (`AUTOTUNE_RESERVE`)."""
    build_bytes: int = 0
    """Peak on one device while building (the whole model; 0 when sharded)."""
    host_bytes: int = 0
    """The whole copy in host memory while the run starts: rank 0's of a sharded run, or the
    folder read by an int8 run (`plan`'s `host_build`)."""
    shard_bytes: int = 0
    """Per device, the parameter shards alone (what exists while rank 0's copy does)."""
    build_dtype: torch.dtype = torch.float32
    """The dtype the model is built in (train/setup/precision.py build_dtype)."""
    recompute_share: float = 0.0
    """The share of each layer stack that recomputes in this plan (0: none)."""
    seq_len: int = 0
    """The bin length (data.seq_len, over all context ranks) whose activations it counts."""
    text_layers: int = 0
    """The model's decoder layers (`recompute_share` of them recompute)."""
    fitting_seq_len: int | None = None
    """Where this plan does not fit: the longest shorter bin length whose plan does, 0 where
    none does (train/setup/stack.py `shorter_bins`); None where none was planned."""

    @property
    def train_bytes(self) -> int:
        """Per device in training: weights, gradients, optimizer state and activations."""
        return (sum(self.weights.values()) + self.grads + self.optimizer
                + sum(self.activations.values()) + sum(self.transient.values()))

    def lines(self) -> list[str]:
        """The plan as aligned lines, GiB per device."""
        rows = [(f"weights ({k})", v) for k, v in self.weights.items()]
        rows += [("gradients (float32)", self.grads), (f"AdamW moments ({self.moments})", self.optimizer)]
        rows += [(f"activations: {k}", v) for k, v in self.activations.items()]
        rows += [(f"first step: {k}", v) for k, v in self.transient.items()]
        rows += [("total in training", self.train_bytes)]
        if self.build_bytes:
            rows.append(("while building", self.build_bytes))
        if self.host_bytes:
            rows.append(("whole copy in host memory", self.host_bytes))
        if self.offloaded:
            rows.append(("offloaded to host memory", self.offloaded))
        return [f"  {name:<36} {v / GIB:8.2f} GiB" for name, v in rows]


def _cfg(model: nn.Module):
    cfg = model.config
    return getattr(cfg, "text_config", cfg), cfg.vision_config


def layer_bytes(text, kind: str, b: int, *, experts_train: bool = False,
                compiled: bool = False) -> int:
    """Bytes per token a text layer of `kind` keeps for its backward when it does not
    recompute: its two norms (float32 input, `b`-byte output), its mixer and its MLP (routed
    experts: `routed_bytes`)."""
    h = text.hidden_size
    out = 2 * (4 * h + b * h)
    if kind == "linear_attention":
        qkv = 2 * text.linear_num_key_heads * text.linear_key_head_dim
        v = text.linear_num_value_heads * text.linear_value_head_dim
        qkv += v
        # projections (qkv, z, b, a), conv input and output, the kernel's q/k/v/g/beta, the gated
        # norm's float32 input, its output and the out projection's input
        out += b * (qkv + v + 2 * text.linear_num_value_heads) + 3 * b * qkv + 4 * v + 2 * b * v
    else:
        heads, kv = text.num_attention_heads, text.num_key_value_heads
        d = getattr(text, "head_dim", None) or h // heads
        gated = 2 if getattr(text, "attn_output_gate", False) or text.model_type.startswith(
            "qwen3_5") else 1
        q = heads * d * gated
        # projections' outputs, q/k after norm and rotary, the kernel's output, the gate's
        # product and the o projection's input
        out += b * (q + 2 * kv * d) + b * (heads * d + kv * d) + 3 * b * heads * d + 4 * heads
    n_exp = getattr(text, "num_experts", 0) or 0
    if n_exp:
        k, inter = text.num_experts_per_tok, text.moe_intermediate_size
        shared = getattr(text, "shared_expert_intermediate_size", 0) or 0
        # float32 router logits and probabilities, the routed copies, the shared expert as a
        # dense MLP
        out += (8 * n_exp + k * routed_bytes(h, inter, b, train=experts_train, compiled=compiled)
                + b * (6 * shared + h))
    else:
        out += 6 * b * text.intermediate_size
    return out


def routed_bytes(h: int, inter: int, b: int, *, train: bool, compiled: bool) -> int:
    """Bytes one routed (token, expert) copy keeps for backward in vlpack's dispatch
    (model/experts.py): its `b`-byte routing weight and the gate/up projection's output (2I);
    eager, also three int64 indices and the SiLU gate's output and the gated product (2I more);
    compiled, two int64 indices (the compiled backward recomputes the gate). Trained experts
    (full fine-tuning, LoRA on the experts) add the inputs of both grouped GEMMs for the weights'
    gradients (h + I)."""
    out = b + b * 2 * inter + (16 if compiled else 24 + b * 2 * inter)
    return out + (b * (h + inter) if train else 0)


def vision_block_bytes(vision, b: int) -> int:
    """Bytes per patch a vision block keeps for its backward when it does not recompute."""
    hv = getattr(vision, "hidden_size", None) or vision.embed_dim
    inter = getattr(vision, "intermediate_size", None) or int(hv * getattr(vision, "mlp_ratio", 4))
    # norms, qkv, float32 rotated q/k, attention output and projection input, MLP in/act/out
    return 2 * (4 * hv + b * hv) + 3 * b * hv + 8 * hv + 2 * b * hv + 3 * b * inter


def activation_bytes(model: nn.Module, run: RunShape) -> dict[str, int]:
    """Activation bytes per device of one micro-batch of `run` on `model` (shapes only), by
    part, before ACTIVATION_SCALE."""
    text, vision = _cfg(model)
    b, T, h = run.act_bytes, run.seq_len, text.hidden_size
    n = text.num_hidden_layers
    kinds = list(getattr(text, "layer_types", None) or ["full_attention"] * n)
    experts_train = any(p.requires_grad for name, p in model.named_parameters()
                        if routed_expert(name))
    per_layer = [layer_bytes(text, k, b, experts_train=experts_train, compiled=run.compiled)
                 for k in kinds]
    recomputed = recomputed_layers(run.recompute_share, n)
    kept = sum(per_layer[recomputed:]) + 4 * h * recomputed
    widest = max(per_layer)
    parts = {"text layers": T * kept, "backward working set": 2 * T * widest}
    visual = model.model.visual
    if any(p.requires_grad for p in visual.parameters()):
        depth = vision.depth
        vb = vision_block_bytes(vision, b)
        hv = getattr(vision, "hidden_size", None) or vision.embed_dim
        vr = recomputed_layers(run.recompute_share, depth)
        parts["vision blocks"] = run.patches * (vb * (depth - vr) + 4 * hv * vr + 2 * vb)
    vocab = text.vocab_size
    rows = run.loss_chunk or T
    loss = rows * vocab * (4 + b) + T * h * b
    if model.lm_head.weight.requires_grad:
        loss += vocab * h * (4 + b)
    parts["loss"] = loss
    out = {k: int(v * ACTIVATION_SCALE) for k, v in parts.items()}
    int8 = [p.numel() for p in model.parameters() if p.dtype == torch.int8]
    if int8:  # one expert weight dequantized at a time (model/quant.py): exact, not scaled
        out["int8 weight dequantized"] = b * max(int8)
    if dora := dora_bytes(model):  # one layer's DoRA norm at a time: not scaled
        out["DoRA weight norm"] = dora
    return out


def moment_bytes(numel: int, optimizer: str = "adamw") -> int:
    """Bytes of the two AdamW moments of one tensor of `numel` values (a rank's shard under
    FSDP2): float32 for `adamw`; for `adamw8bit` (torchao `AdamW8bit`) a tensor of at least
    4,096 values in whole 256-value blocks keeps per moment a byte per value, a float32 scale
    per block and its 256-entry float32 code table, any other tensor float32 moments."""
    if optimizer == "adamw8bit" and numel >= 4096 and numel % 256 == 0:
        return 2 * (numel + 4 * (numel // 256) + 4 * 256)
    return 8 * numel


def plan(model: nn.Module, run: RunShape | None, *, world_size: int, sharing: int = 1,
         sharded: bool = False, build_dtype: torch.dtype = torch.float32,
         host_build: bool = False, data_seq_len: int = 0, optimizer: str = "adamw",
         offload: bool = False) -> MemoryPlan:
    """The memory plan of `model` (shapes only: a meta model after LoRA, freezing and
    `precision.hold_parameters`) trained as `run` describes (None: activations not planned),
    FSDP2 over `world_size` ranks (`sharded`), `sharing` ranks on one memory. `host_build`: one
    process reads the whole model into host memory and moves it to its device as it quantizes
    (`model.frozen_dtype=int8` from a folder), so the device never holds it at the build dtype.
    `data_seq_len`: the bin length over all context ranks, recorded in the plan. `optimizer`:
    optim.name, whose moments `moment_bytes` counts (per shard: rank 0's, FSDP2 splitting
    the first dimension). `offload`: FSDP2 keeps weight shards, gradients and optimizer state
    in host memory (train.cpu_offload on an accelerator)."""
    world = max(world_size, 1) if sharded or world_size > 1 else 1
    weights: dict[str, int] = {}
    params = trainable = whole = 0
    build_size = torch.empty((), dtype=build_dtype).element_size()
    for p in model.parameters():
        name = str(p.dtype).removeprefix("torch.")
        weights[name] = weights.get(name, 0) + p.numel() * p.element_size()
        params += p.numel()
        trainable += p.numel() if p.requires_grad else 0
        whole += p.numel() * max(p.element_size(), build_size)
    for s in scale_buffers(model):  # int8 weights' scales: bytes, not parameters
        weights["float32"] = weights.get("float32", 0) + s.numel() * s.element_size()
        whole += s.numel() * s.element_size()
    shard = {k: v * sharing // world for k, v in weights.items()}
    acts = activation_bytes(model, run) if run is not None else {}
    p = MemoryPlan(
        params=params, trainable=trainable, weights=shard,
        grads=4 * trainable * sharing // world,
        optimizer=8 * trainable * sharing // world if optimizer == "adamw" else sharing * sum(
            moment_bytes(_shard_numel(p, world), optimizer) for p in model.parameters()
            if p.requires_grad),
        moments="8-bit" if optimizer == "adamw8bit" else "float32",
        activations={k: v * sharing for k, v in acts.items()},
        build_bytes=0 if sharded or host_build else whole * sharing,
        host_bytes=sum(weights.values()) if sharded else whole if host_build else 0,
        shard_bytes=sum(shard.values()) if sharded else 0,
        build_dtype=build_dtype, recompute_share=run.recompute_share if run is not None else 0.0,
        seq_len=data_seq_len,
        text_layers=_cfg(model)[0].num_hidden_layers if run is not None else 0,
    )
    if not offload:
        return p
    return replace(p, weights={}, grads=0, optimizer=0,
                   offloaded=sum(p.weights.values()) + p.grads + p.optimizer)


def _shard_numel(p: torch.Tensor, world: int) -> int:
    """Values of rank 0's shard of `p` over `world` ranks (FSDP2 splits dim 0, rounding up)."""
    if world == 1 or p.ndim == 0:
        return p.numel()
    return -(-p.shape[0] // world) * (p.numel() // p.shape[0])


def dora_bytes(model: nn.Module) -> int:
    """Bytes DoRA's forward takes besides for the widest adapted linear [out, in] of `model`:
    to take the norm of W + s·B·A it forms B·A, casts W and adds them (peft
    `DoraLinearLayer`), up to four float32 [out, in] tensors at once, freed before the next
    layer (0 without DoRA)."""
    sizes = [m.in_features * m.out_features for m in model.modules()
             if len(getattr(m, "lora_magnitude_vector", ())) or hasattr(m, "lora_magnitude")]
    return 16 * max(sizes, default=0)


def available_bytes(device: torch.device) -> int | None:
    """Free memory of `device` now (None where it cannot be read); on a GPU at most what this
    process's cap leaves (`torch.cuda.set_per_process_memory_fraction`, or
    `PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:F`) beyond what it has reserved."""
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None
                              else device.index)
        free, total = torch.cuda.mem_get_info(device)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
        capped = int(fraction * total) - torch.cuda.memory_reserved(device)
        return int(min(free, max(capped, 0)))
    meminfo = Path("/proc/meminfo")
    if device.type == "cpu" and meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def ways_out(p: MemoryPlan, *, lora: bool, cp: int, vision_capped: bool = True,
             micro_batches: int | None = 1) -> list[str]:
    """The settings that shrink the largest parts of `p`, most effective first. `micro_batches`:
    train.micro_batches (None: train.tokens_per_step sets a step's bins), which shorter bins
    multiply to keep the tokens per step."""
    acts = sum(p.activations.values())
    state = p.grads + p.optimizer
    out = []
    if not lora and state > acts:
        out.append("train LoRA adapters (model.lora.rank=16): the frozen base needs no "
                   "gradients or optimizer state and is held in bf16")
    if state > acts and p.moments == "float32":
        out.append("8-bit AdamW moments (optim.name=adamw8bit, pip install torchao): about a "
                   "quarter of the optimizer state")
    if not vision_capped and p.activations.get("vision blocks", 0) > acts / 4:
        out.append("a vision budget per bin (data.max_patches=N): without one the plan counts "
                   "every token of a bin as an image token")
    if acts:
        if p.recompute_share < 1.0:
            out.append("recompute more of each layer stack (model.activation_checkpointing=true "
                       "model.checkpoint_share=1.0)")
        if p.fitting_seq_len != 0:  # 0: no shorter bins fit
            out.append(shorter_bins_way(p, micro_batches))
        out.append(f"split each row over more GPUs (parallel.cp={2 * cp})")
    out.append("more GPUs (FSDP2 shards weights, gradients and optimizer state)")
    return out


def shorter_bins_way(p: MemoryPlan, micro_batches: int | None) -> str:
    """The way out through shorter bins: the fitting length and the micro-batches that keep a
    step's tokens as near as whole bins allow, where the plan found one."""
    n = p.fitting_seq_len
    if not n or not p.seq_len:
        return "shorter bins (data.seq_len)"
    if micro_batches is None:
        return f"shorter bins: data.seq_len={n} fits (train.memory_check=shorten chooses it)"
    micro = micro_batches_for(micro_batches, p.seq_len, n)
    return (f"shorter bins: data.seq_len={n} train.micro_batches={micro} fits and "
            f"{tokens_kept(micro_batches * p.seq_len, micro * n)} "
            "(train.memory_check=shorten chooses it)")


def micro_batches_for(micro_batches: int, seq_len: int, shorter: int) -> int:
    """The micro-batches per step in `shorter`-token bins nearest to `micro_batches` bins of
    `seq_len` tokens (at least 1)."""
    return max(1, round(micro_batches * seq_len / shorter))


def tokens_kept(before: int, after: int) -> str:
    """How a step's padded tokens change with shorter bins, for the log and the ways out."""
    return ("keeps the tokens per step" if before == after else
            f"gives {after:,} tokens per step where {before:,} were asked")


def fits(p: MemoryPlan, device: torch.device, free: int | None, *,
         holds_copy: bool = False) -> bool:
    """Whether `p` fits `free` bytes of `device` (`usable_bytes`; `check_fits` says why not);
    True where the free memory cannot be read."""
    return free is None or _need(p, device, holds_copy)[0] <= usable_bytes(free, device)


def usable_bytes(free: int, device: torch.device) -> int:
    """What a plan may take of `free` bytes on `device`: less HEADROOM, and on a GPU less
    GPU_RESERVE."""
    return int(free * (1 - HEADROOM)) - (GPU_RESERVE if device.type == "cuda" else 0)


def _need(p: MemoryPlan, device: torch.device, holds_copy: bool) -> tuple[int, int]:
    """The most `p` holds on `device` at once, and what it holds while rank 0's copy loads."""
    loading = p.host_bytes + p.shard_bytes if holds_copy and device.type == "cpu" else 0
    return max(p.build_bytes, p.train_bytes, loading), loading


def check_fits(p: MemoryPlan, device: torch.device, free: int | None, *, model: str,
               holds_copy: bool = False, ways: list[str] | None = None) -> None:
    """ValueError with the plan and the ways out when it exceeds `usable_bytes` of `free`.
    `holds_copy`: this CPU device also holds rank 0's whole copy while the shards load (the copy
    is freed before gradients and optimizer state exist)."""
    if fits(p, device, free, holds_copy=holds_copy):
        return
    need, loading = _need(p, device, holds_copy)
    usable = usable_bytes(free, device)
    what = ("building it would" if p.build_bytes == need else
            "rank 0's whole copy and the parameter shards would" if loading == need else
            "training it would")
    ways = ways or ["a smaller model", "more GPUs (FSDP shards the training state)",
                    "freezing parts of it (model.freeze_vision / freeze_llm)"]
    raise ValueError(
        f"model.name={model} has {p.params / 1e9:.2f} B parameters ({p.trainable / 1e9:.2f} B "
        f"trainable): {what} take about {need / GIB:.1f} GiB on each {device.type} device, but "
        f"{free / GIB:.1f} GiB is free ({usable / GIB:.1f} GiB usable). The plan per device:\n"
        + "\n".join(p.lines()) + "\nWays out: " + "; ".join(ways)
    )


def check_host_copy(p: MemoryPlan, free: int | None, *, model: str) -> None:
    """ValueError when the host cannot hold the whole model that a sharded run (on rank 0) or
    an int8 run builds there once, plus what the host's ranks offload (train.cpu_offload;
    accelerator runs; on CPU `check_fits` counts it)."""
    offloaded = p.offloaded * local_ranks()
    if free is None or p.host_bytes + offloaded <= free:
        return
    also = (f" and its ranks offload {offloaded / GIB:.1f} GiB (train.cpu_offload)"
            if offloaded else "")
    raise ValueError(
        f"model.name={model}: the run builds the whole model once in host memory (rank 0 of a "
        f"sharded run, or a folder read before model.frozen_dtype=int8 quantizes it), about "
        f"{p.host_bytes / GIB:.1f} GiB{also}, but {free / GIB:.1f} GiB is free; run on a host "
        "with more memory"
    )


def local_ranks() -> int:
    """Ranks of this job on this host (torchrun's LOCAL_WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
