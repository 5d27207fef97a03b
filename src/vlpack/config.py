"""Typed run configuration: nested dataclasses, validated at construction.

YAML files map 1:1 onto the dataclasses (`data: {seq_len: 4096}` sets `Config.data.seq_len`);
dotted `key=value` overrides apply on top (`train.max_steps=20`). Unknown keys and bad values
raise ValueError naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from vlpack.preset_names import random_weights_refusal

Source = Literal["jsonl", "synthetic", "energon", "hf"]
"""Where `data.*` samples come from (each choice is listed only here and read with get_args)."""
Algo = Literal["greedy", "ffd", "bfd"]
"""The bin planners (`vlpack.data.plan.plan_bins`); the default one is `DataConfig.packing`."""
Packing = Literal[Algo, "none"]
"""`data.packing`: a planner or padded batches."""
Overlong = Literal["error", "truncate", "skip"]
"""`data.overlong`: what happens to a sample longer than data.seq_len (data/admission.py)."""
AfterVideo = Literal["qwen", "transformers"]
"""`data.mrope_after_video`: where text after a multi-patch video continues (data/rope.py)."""


@functools.cache
def _literal_fields(cls: type) -> tuple[tuple[str, tuple], ...]:
    """(field name, allowed values) of each field of `cls` typed `Literal[...]` (or
    `Literal[...] | None`, None then allowed too); a field that also takes another type
    (`float | Literal["auto"]`) checks itself."""
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) \
            else (tp,)
        literals = [a for a in args if typing.get_origin(a) is Literal]
        if literals and all(typing.get_origin(a) is Literal or a is type(None) for a in args):
            allowed = tuple(v for a in literals for v in typing.get_args(a))
            out.append((name, allowed + ((None,) if type(None) in args else ())))
    return tuple(out)


def default_of(section: type, name: str) -> Any:
    """The default of the field `name` of the section class `section`: a plain constructor
    that mirrors a config field takes its default from here, so the default lives once."""
    f = {f.name: f for f in dataclasses.fields(section)}[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _check_choices(section: Any, prefix: str) -> None:
    """ValueError for a field of `section` outside its `Literal` choices, naming them."""
    for name, allowed in _literal_fields(type(section)):
        value = getattr(section, name)
        if value not in allowed:
            choices = ", ".join(str(a) for a in allowed if a is not None)
            raise ValueError(f"{prefix}.{name}={value!r} is not one of {choices}")


def _positive(key: str, value: float | None, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclass(frozen=True, slots=True)
class VideoSettings:
    """How videos are sampled and sized. None: the checkpoint folder's
    `video_preprocessor_config.json` when it sets the value, else the family processor's
    default (`vlpack.data.video.DEFAULTS`, and the pixel bounds of its `rules`)."""

    fps: float | None = None
    """Frames sampled per second of a video file (default 2)."""
    min_frames: int | None = None
    """Fewest frames sampled from a file (default 4)."""
    max_frames: int | None = None
    """Most frames sampled from a file (default 768)."""
    min_pixels: int | None = None
    """Lower bound on one frame's area (qwen2 families) or the clip's (qwen3 families)."""
    max_pixels: int | None = None
    """Upper bound, same meaning."""
    cap_pixels_per_frame: bool | None = None
    """Share the pixel budget over the frames (default on)."""
    max_video_tokens: int | None = None
    """The budget `cap_pixels_per_frame` shares out (qwen2: tokens of the whole clip, 128,000;
    qwen3: tokens of one frame, 768)."""

    def __post_init__(self) -> None:
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"data.video.fps must be positive, got {self.fps}")
        for name in ("min_frames", "max_frames", "min_pixels", "max_pixels", "max_video_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"data.video.{name} must be positive, got {v}")
        if self.min_frames and self.max_frames and self.min_frames > self.max_frames:
            raise ValueError(f"need data.video.min_frames <= max_frames, got {self.min_frames} "
                             f"and {self.max_frames}")

    def over(self, base: VideoSettings) -> VideoSettings:
        """These settings, `base`'s where these are None."""
        return VideoSettings(**{f: getattr(base, f) if getattr(self, f) is None else
                                getattr(self, f) for f in self.__slots__})


@dataclass(kw_only=True, slots=True)
class MixSource:
    """One source of a mixture (`data.mix`, data/mixture.py)."""

    path: str | None = None
    """A JSONL file or a Hugging Face dataset (as data.path); none for `source: synthetic`."""
    source: Literal["jsonl", "hf", "synthetic"] | None = None
    """None: `jsonl` for a .jsonl path, else `hf`."""
    weight: float = 1.0
    """Share of the mixture's samples: weight / the sum of the weights."""
    name: str | None = None
    """Name in the per-source counts (None: the path's file name, or `synthetic`)."""

    def __post_init__(self) -> None:
        if self.source is None:
            self.source = "synthetic" if self.path is None else (
                "jsonl" if self.path.endswith(".jsonl") else "hf")
        if (self.path is None) != (self.source == "synthetic"):
            raise ValueError(f"data.mix entry {self.name or self.path or self.source}: a "
                             f"{self.source} source needs a path, synthetic none")
        if not self.weight > 0:
            raise ValueError(f"data.mix weight of {self.path or self.source} must be > 0, "
                             f"got {self.weight}")
        if self.name is None:
            self.name = "synthetic" if self.path is None else Path(self.path).name


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where samples come from and how they are packed."""

    source: Source = "synthetic"
    """`synthetic`: the built-in receipts (generated once, cached); `jsonl`: `path` is a JSONL file;
    `energon`: `path` is a prepared Megatron-Energon dataset folder; `hf`: `path` is a Hugging
    Face dataset (a save_to_disk folder, .parquet or .arrow files; data/hf_source.py)."""
    mix: list[MixSource] | None = None
    """Several sources drawn by weight (data/mixture.py), in place of data.source/data.path."""
    path: str | None = None
    """DATA.jsonl for source=jsonl (image paths relative to it); for source=energon the folder
    written by `vlpack data energon-prepare`."""
    synthetic_samples: int = 512
    """Size of the built-in synthetic dataset."""
    packing: Packing = "bfd"
    """Bin-packing algorithm; `none` trains on right-padded batches of `batch_size` samples."""
    seq_len: int = 4096
    """Tokens per packed bin (also the cap on one sample's length)."""
    batch_size: int = 4
    """Samples per padded batch (packing=none only)."""
    buffer_size: int = 256
    """Samples the online planner sees at once."""
    packing_buffer_size: int | None = None
    """Energon batch-level packing (source=energon only): samples Energon collects before
    vlpack's planner packs them; each buffer is planned on its own (None: data.buffer_size)."""
    shuffle_buffer_size: int | None = None
    """Energon's sample shuffle buffer before encoding (source=energon only; None: shards and
    slices are still shuffled, samples within them are not)."""
    max_patches: int | None = None
    """Optional cap on ViT patches per bin."""
    pad_to_multiple_of: int = 8
    """Align every sample's segment to this many tokens (TP/CP/FP8 alignment)."""
    mrope_after_video: AfterVideo = "qwen"
    """Qwen2/2.5-VL: where text after a video of several temporal patches continues. `qwen`:
    after the largest position the video used (the rule the released checkpoints were trained
    with); `transformers`: at the video's start + max(h', w') (transformers >= 5.3).
    Images and Qwen3/3.5 videos (one temporal patch per span) are the same under both
    (docs/data.md)."""
    pad_to_seq_len: bool = False
    """Pad every packed row to exactly seq_len tokens (static shapes for torch.compile / CUDA
    graphs; the padding joins the last segment and is excluded from loss and statistics)."""
    overlong: Overlong = "error"
    """What to do with a sample longer than seq_len."""
    min_pixels: int | None = None
    """Image processor bounds (None: the family's default)."""
    max_pixels: int | None = None
    max_image_pixels: int | None = None
    """Largest source image or video frame (width × height) opened (None: Pillow's
    decompression-bomb limit, about 179 M pixels); raise it only for files you trust."""
    media_root: str | None = None
    """Folder every image and video path must resolve inside (`..` and symlinks followed);
    None: the JSONL file's folder. A path that escapes is a skipped sample (docs/data.md)."""
    video: VideoSettings = field(default_factory=VideoSettings)
    """How videos are sampled and sized (`data.video.fps=1`, `data.video.max_pixels=N`, ...;
    see docs/data.md)."""
    tokenizer: str | None = None
    """Local HF folder holding the tokenizer (None: the model folder, else built-in)."""
    chat_template: str = "auto"
    """"auto": the model folder's chat template when it has one, else vlpack's built-in
    rendering; "builtin": always vlpack's; or a .jinja file."""
    supervise_empty_think: bool = True
    """Train the empty `<think>\\n\\n</think>\\n\\n` block that Qwen3.5's template writes before
    each answer without reasoning after the last user query (tool-calling turns included): true
    teaches the model to emit it, as the template's non-thinking generation prompt does; false
    leaves it out of the labels. A block that holds reasoning is always trained; families whose
    template writes no think block ignore this (docs/data.md)."""
    num_workers: int = 0
    """DataLoader worker processes (source=energon: Energon's workers per rank)."""
    shuffle: bool = True
    """Shuffle sample order each epoch (seeded by train.seed)."""
    eval_samples: int = 0
    """Held-out samples (taken from the end of the dataset) evaluated with the same packing
    (ignored with a warning for source=energon and for data.mix: no held-out split)."""
    max_consecutive_bad: int = 32
    """Fail after this many bad samples in a row (a broken dataset, not a bad sample)."""
    max_bad_fraction: float = 0.05
    """Fail when more than this share of samples seen so far was skipped (checked after 100
    samples, or once all were seen in a smaller dataset)."""

    def __post_init__(self) -> None:
        _check_choices(self, "data")
        self._check_mix()
        if self.source in ("jsonl", "energon", "hf") and not self.path:
            raise ValueError(f"data.source={self.source} needs data.path=...")
        if self.source == "synthetic" and self.path:
            raise ValueError(
                f"data.path={self.path} is set but data.source=synthetic (the built-in data) would "
                "ignore it: add data.source=jsonl (a .jsonl file) or data.source=energon (a "
                "prepared Energon folder)"
            )
        for k in ("seq_len", "batch_size", "buffer_size", "pad_to_multiple_of", "synthetic_samples"):
            _positive(f"data.{k}", getattr(self, k))
        _positive("data.max_patches", self.max_patches)
        _positive("data.packing_buffer_size", self.packing_buffer_size)
        _positive("data.shuffle_buffer_size", self.shuffle_buffer_size)
        self._check_energon()
        if self.media_root is not None and self.source not in ("jsonl", "hf") and not self.mix:
            raise ValueError(
                f"data.media_root bounds the media paths of a JSONL file, but data.source="
                f"{self.source} reads none (energon-prepare applies it when writing shards): "
                "drop data.media_root or set data.source=jsonl"
            )
        _positive("data.num_workers", self.num_workers, allow_zero=True)
        _positive("data.eval_samples", self.eval_samples, allow_zero=True)
        if self.seq_len % self.pad_to_multiple_of:
            raise ValueError(
                f"data.seq_len={self.seq_len} must be a multiple of "
                f"data.pad_to_multiple_of={self.pad_to_multiple_of}"
            )
        if not 0 <= self.max_bad_fraction <= 1:
            raise ValueError(f"data.max_bad_fraction must be in [0, 1], got {self.max_bad_fraction}")

    def _check_mix(self) -> None:
        """data.mix replaces data.source/data.path."""
        if self.mix is None:
            return
        if not self.mix:
            raise ValueError("data.mix is an empty list: give at least one {path, weight}")
        if self.path is not None or self.source != "synthetic":
            raise ValueError("data.mix names the sources itself: drop data.path and data.source")

    def _check_energon(self) -> None:
        """Batch-level packing (Energon) excludes the other packing modes."""
        if self.source != "energon":
            for key in ("packing_buffer_size", "shuffle_buffer_size"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"data.{key} is for Energon batch-level packing (data.source=energon), "
                        f"but data.source={self.source} packs with the online planner "
                        "(data.buffer_size): the two are mutually exclusive; drop "
                        f"data.{key} or set data.source=energon"
                    )
            return
        if self.packing == "none":
            raise ValueError(
                "data.packing=none (padded batches) and data.source=energon's batch-level packing "
                "(data.packing_buffer_size) are mutually exclusive: set data.packing to greedy, "
                "ffd or bfd, or use data.source=jsonl"
            )
        if self.shuffle_buffer_size is not None and not self.shuffle:
            raise ValueError(
                "data.shuffle=false contradicts data.shuffle_buffer_size: drop one of them"
            )


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    """LoRA adapters through peft (`vlpack.model.lora`); `rank` 0 trains the full model."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | None = None
    """Leaf names of the text model's linears to adapt; None: the LLM's attention,
    Gated-DeltaNet and MLP projections (routed experts: see `experts`)."""
    vision: bool = False
    """Also adapt every linear of the vision tower and its mergers."""
    experts: bool = False
    """Also adapt the routed experts' weights (MoE families): a low-rank update per expert of
    `gate_up_proj` and `down_proj`, through peft's `target_parameters` (needs lora.dropout 0)."""
    use_dora: bool = False
    """DoRA (peft `use_dora`): each adapted linear's weight is split into a direction, which the
    low-rank update adapts, and a trained magnitude per output feature (`out_features` more
    trainable weights per linear). Linears only: not with `experts`."""
    use_rslora: bool = False
    """rsLoRA (peft `use_rslora`): the update is scaled by alpha / sqrt(rank) instead of
    alpha / rank, so a higher rank does not shrink it."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"model.lora.rank={self.rank}: use 0 (off) or a positive rank, e.g. 8")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.lora.dropout={self.dropout}: use a value in [0, 1)")
        if self.experts and self.dropout:
            raise ValueError("model.lora.experts=true needs model.lora.dropout=0: peft cannot "
                             "drop out the input of a LoRA update on a weight tensor")
        if self.experts and self.use_dora:
            raise ValueError("model.lora.use_dora=true adapts linear layers, and peft's LoRA on "
                             "the routed experts' weight tensors has no DoRA: set "
                             "model.lora.experts=false, or model.lora.use_dora=false")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which model, on which kernels, and what trains."""

    name: str = "tiny-qwen3_vl"
    """A preset name (see `vlpack.model.presets`) or a local HF checkpoint folder."""
    init: Literal["pretrained", "random"] = "pretrained"
    """`pretrained`: a folder's weights (a folder without them is an error); `random`: random
    weights from the folder's config.json. Presets always start from random weights, so a preset
    on your data (`data.source` jsonl, hf or energon, or a `data.mix` holding one) needs
    `model.init=random` to say so."""
    backend: Literal["auto", "sdpa", "varlen", "flex"] = "auto"
    """Attention backend; `auto` picks varlen on GPU, the per-segment SDPA reference on CPU."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter/compute dtype policy; `auto`: bf16 autocast on GPU, float32 on CPU."""
    frozen_dtype: Literal["auto", "float32", "int8"] = "auto"
    """The dtype of parameters that get no gradient (the LoRA base, `freeze_*` parts): `auto`
    holds their linear and expert weights in the autocast dtype (bf16 on a GPU: half the
    memory, the same arithmetic, train/setup/precision.py); `float32` keeps them float32; `int8`
    holds the routed experts' weights in int8 with a scale per row (weight-only, dequantized to
    the compute dtype as each layer runs: a quarter of float32's memory, with rounding error;
    model/quant.py) and the rest as `auto`. MoE models on one process only."""
    freeze_vision: bool = False
    freeze_merger: bool = False
    freeze_llm: bool = False
    activation_checkpointing: bool = False
    """Recompute layer activations in backward instead of keeping them (less memory, about a
    third more compute)."""
    checkpoint_share: float | Literal["auto"] = 1.0
    """With activation_checkpointing: the share of each layer stack (decoder layers, vision
    blocks) that recomputes, from the first layer on; 0.5 keeps the second half's activations
    (vlpack.model.recompute). `auto`: the least share whose memory plan fits the device's free
    memory, in steps of one text layer, chosen before the model is built (train/setup/stack.py; the
    log and `--dry-run` say which); where everything fits, nothing recomputes. Without
    activation_checkpointing nothing recomputes and the share has no effect (so
    `model.activation_checkpointing=false` works on a recipe that sets one)."""
    chunked_loss: bool = True
    """Cross-entropy in chunks, never holding [T, vocab] logits."""
    compile: bool = False
    """torch.compile parts of the model (fuses their elementwise work; the first step pays the
    compilation). See docs/benchmarks.md for what it buys."""
    compile_scope: Literal["regions", "layers"] = "layers"
    """With compile: `layers` compiles each decoder layer and vision block whole, its attention
    call eager (fewer host launches per layer; docs/benchmarks/levers.md); `regions` only the
    norm and MLP modules and the vision rotary (vlpack.model.compile)."""
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        _check_choices(self, "model")
        share = self.checkpoint_share
        if share != "auto" and (isinstance(share, str) or not 0.0 < share <= 1.0):
            raise ValueError(f"model.checkpoint_share={share!r}: use a share in "
                             "(0, 1], e.g. 0.5 to recompute half of each layer stack, or auto "
                             "for the least share that fits the device")
        if self.freeze_vision and self.freeze_merger and self.freeze_llm:
            raise ValueError("model.freeze_* freezes everything: nothing would train")
        if self.frozen_dtype == "int8" and self.lora.experts:
            raise ValueError("model.frozen_dtype=int8 holds the routed experts' weights in int8, "
                             "and model.lora.experts=true adapts those weights: set "
                             "model.lora.experts=false, or model.frozen_dtype=auto")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay. The defaults are fine-tuning values for
    pretrained weights; a model trained from random weights (the tiny recipe) sets its own."""

    name: Literal["adamw", "adamw8bit"] = "adamw"
    """`adamw`: torch's AdamW, float32 moments (8 bytes per trainable parameter); `adamw8bit`:
    torchao's AdamW8bit (`pip install torchao`), both moments in 8 bits with a float32 scale
    per block of 256 values (about 2 bytes per parameter; tensors under 4,096 values keep
    float32 moments), at the moments' quantisation error."""

    lr: float | None = None
    """None: 1e-5 for full fine-tuning, 2e-4 with model.lora.rank (LoRA's few new weights take
    a higher rate); the run's config.yaml holds the resolved value."""
    min_lr_ratio: float = 0.1
    """Final lr as a fraction of lr."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's moment decays (torch's and transformers' default; pretraining recipes use a lower
    second one, e.g. 0.95)."""
    eps: float = 1e-8
    warmup_steps: int = 5
    warmup_ratio: float | None = None
    """Warmup as a share of train.max_steps (rounded to whole steps); set, it replaces
    warmup_steps."""
    lr_vision: float | None = None
    """Learning rate of the vision tower without its merger (None: optim.lr). The warmup and
    cosine schedule scale every group's rate alike."""
    lr_merger: float | None = None
    """Learning rate of the vision merger, the projector into the LLM (None: optim.lr)."""
    lr_llm: float | None = None
    """Learning rate of the language model and lm_head (None: optim.lr)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""

    def __post_init__(self) -> None:
        _check_choices(self, "optim")
        _positive("optim.lr", self.lr)
        _positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        _positive("optim.warmup_steps", self.warmup_steps, allow_zero=True)
        for key in ("lr_vision", "lr_merger", "lr_llm"):
            _positive(f"optim.{key}", getattr(self, key))
        if self.warmup_ratio is not None and not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"optim.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        _positive("optim.grad_clip", self.grad_clip, allow_zero=True)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {self.betas}")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The loop: steps, accumulation, checkpoints, logging."""

    max_steps: int = 40
    epochs: int | None = None
    """Train this many passes over the training set: max_steps becomes the planned bins of that
    many passes over (data-parallel ranks × micro_batches), rounded up (train/epochs.py). Needs
    a dataset of known size (not energon) and micro_batches (not tokens_per_step)."""
    output_dir: str = "runs/default"
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end)."""
    stop_after: int | None = None
    """Stop after this many steps of THIS run, saving a checkpoint as Ctrl-C would (for
    time-limited jobs: resubmit with train.resume=auto to continue)."""
    stop_grace_s: float | None = None
    """After SIGINT/SIGTERM the run finishes its step and saves; past this many seconds it gives
    up and exits (status 130, the last complete checkpoint stays the resume point). Set it a
    little under the scheduler's kill delay (SLURM KillWait, Kubernetes
    terminationGracePeriodSeconds). None: no limit."""
    save_final: bool = True
    """Checkpoint at the end of the run (off for throughput runs that need no checkpoint)."""
    resume: str = "auto"
    """`auto` (latest checkpoint in output_dir, if any) | a checkpoint folder | `none`."""
    resume_fallback: bool = False
    """With `resume=auto`, a latest checkpoint whose files fail their recorded sizes or sha256
    digests is skipped (the log says which and why) for the newest intact one beside it. Off: such
    a checkpoint is refused with an error naming the damaged file and that intact checkpoint."""
    overwrite: bool = False
    """A fresh run (`resume=none`) in an output_dir holding another run's checkpoints is refused;
    with overwrite those checkpoints and the old metrics are deleted first."""
    seed: int = 0
    micro_batches: int = 1
    """Bins (or padded batches) accumulated per optimizer step on each rank."""
    tokens_per_step: int | None = None
    """Accumulate micro-batches until this many real tokens per rank (overrides micro_batches)."""
    loss_norm: Literal["token", "sample"] = "token"
    """`token`: global mean over label tokens of the step (all micro-batches, all ranks) — equal
    to unpacked training; `sample`: mean over samples of each sample's token mean."""
    aux_loss_coef: float = 0.001
    """MoE router load-balancing loss coefficient."""
    log_every: int = 1
    """Write a metrics row (and, when stderr is not a terminal, a progress line) every N steps."""
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = field(default_factory=list)
    """Experiment trackers that mirror every metrics row on rank 0, with the run's config
    (train/run/tracking.py; each an optional extra: pip install "vlpack[tensorboard]"). The run's
    metrics.jsonl is written either way."""
    report_to_errors: Literal["error", "warn"] = "error"
    """A tracker that cannot start (its extra missing, its server unreachable, its login absent;
    tried on rank 0 before the model is built): `error` ends the run with a message naming the
    tracker, the error and the fix; `warn` logs it and trains without that tracker."""
    eval_every: int = 0
    """Evaluate on the held-out split every N steps (0: only at the end when eval_samples > 0)."""
    eval_generate_every: int = 0
    """Every N steps, generate the answers of the first held-out samples (data.eval_samples)
    and log `gen_exact_match`, `gen_token_f1` and `gen_field_accuracy` (train/run/generate.py,
    as `vlpack eval` scores them); 0: never."""
    eval_generate_samples: int = 8
    """How many held-out samples train.eval_generate_every generates."""
    eval_generate_max_new_tokens: int = 256
    """Longest answer train.eval_generate_every generates; an answer cut here scores as
    generated (a cut JSON answer does not parse: raise it for long answers such as receipts)."""
    progress: bool = True
    """Show a progress bar."""
    export_hf: bool = False
    """Also export the final model as a HF folder (output_dir/hf), as `vlpack export` does."""
    export_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """The dtype of that folder's weights (and of its config.json's `dtype`)."""
    keep_checkpoints: int = 2
    """Checkpoints of this run kept in output_dir/checkpoints (the newest; 0 keeps all)."""
    memory_check: Literal["refuse", "shorten", "warn", "skip"] = "refuse"
    """Before building: `refuse` a run whose memory plan (train/setup/memory.py, `vlpack train
    --dry-run`) exceeds the free memory (the message names the bin length that fits);
    `shorten` trains instead at the longest shorter length whose plan fits (sixteenths of
    data.seq_len, then halvings: train/setup/stack.py `bin_lengths`), with as many
    train.micro_batches as come nearest to a step's tokens (a sample longer than the shorter
    bins meets data.overlong), and refuses where none fits; `warn` starts it anyway; `skip`
    checks nothing."""
    fsdp: Literal["auto", "always"] = "auto"
    """`auto`: FSDP2 when torchrun starts more than one process; `always`: FSDP2 on one process
    too (a one-rank group), so one GPU computes with bf16 parameters under FSDP's
    mixed-precision policy instead of autocast over fp32 weights; the fp32 master weights stay
    in the optimizer either way."""
    detect_anomaly: bool = False
    """Autograd anomaly mode (slow, for debugging): an error in backward also prints the
    traceback of the forward operation that created the failing node. With
    CUDA_LAUNCH_BLOCKING=1 it names the operation behind a CUDA illegal memory access."""
    kernel_cache: str = "run"
    """Where a GPU run keeps compiled kernels and Triton's autotuning results (fla's kernels
    autotune for minutes on a fresh machine): `run` = OUTPUT_DIR/kernel_cache, so a resume or a
    run in the same folder starts warm on any machine; `default` = Triton's and Inductor's own
    folders (home, /tmp); or a folder that several runs share. TRITON_CACHE_DIR and
    TORCHINDUCTOR_CACHE_DIR set in the environment win (train/setup/kernel_cache.py)."""
    tuned_kernels: bool = True
    """On a GPU that vlpack has measured, fla's Gated-DeltaNet kernels start from the
    configurations that won its autotuning there instead of autotuning on the first step
    (train/setup/kernel_cache.py; keys must match exactly, others still autotune). false: always
    autotune."""
    profile_steps: int = 0
    """Profile this many steps with torch.profiler (0: off), from step `profile_from`; each rank
    writes OUTPUT_DIR/profile_rank<R>.txt: kernel time per step against the unprofiled step
    time, the matmul / attention / other split, the top kernels and operators."""
    profile_from: int = 6
    """First profiled step (1-based): after compilation and allocator warm-up."""
    reshard_after_forward: bool = True
    """FSDP2: free each block's gathered parameters after its forward (and gather them again for
    its backward). `false` keeps them from forward to backward: one all-gather fewer per block
    and micro-batch, for the memory of the unsharded bf16 parameters. The root unit (embedding,
    lm_head, final norm, vision merger) always keeps them (vlpack.train.distributed.parallel.apply_fsdp)."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2 gradient reduce-scatter dtype. `bfloat16` halves its traffic; the sum over ranks is
    then rounded to bf16 before the fp32 optimizer sees it."""
    cpu_offload: bool = False
    """FSDP2 keeps the parameter shards, their gradients and the optimizer state in host memory
    (`CPUOffloadPolicy`): the device holds only the gathered parameters of the units that run
    and the activations, for a copy to and from the host per unit and an optimizer step on the
    CPU. FSDP2 runs only (train.fsdp=always, or several processes)."""

    def __post_init__(self) -> None:
        _positive("train.max_steps", self.max_steps)
        _positive("train.epochs", self.epochs)
        if self.epochs is not None and self.tokens_per_step is not None:
            raise ValueError("train.epochs counts steps of train.micro_batches bins; with "
                             "train.tokens_per_step a step's bins are not known ahead: set "
                             "train.max_steps instead, or drop train.tokens_per_step")
        _positive("train.save_every", self.save_every, allow_zero=True)
        _positive("train.keep_checkpoints", self.keep_checkpoints, allow_zero=True)
        _check_choices(self, "train")
        _positive("train.stop_after", self.stop_after)
        _positive("train.stop_grace_s", self.stop_grace_s)
        _positive("train.micro_batches", self.micro_batches)
        _positive("train.tokens_per_step", self.tokens_per_step)
        _positive("train.log_every", self.log_every)
        _positive("train.eval_every", self.eval_every, allow_zero=True)
        _positive("train.eval_generate_every", self.eval_generate_every, allow_zero=True)
        _positive("train.eval_generate_samples", self.eval_generate_samples)
        _positive("train.eval_generate_max_new_tokens", self.eval_generate_max_new_tokens)
        _positive("train.aux_loss_coef", self.aux_loss_coef, allow_zero=True)
        _positive("train.profile_steps", self.profile_steps, allow_zero=True)
        _positive("train.profile_from", self.profile_from)
        if self.profile_steps and self.profile_from + self.profile_steps - 1 > self.max_steps:
            raise ValueError(
                f"train.profile_from={self.profile_from} + train.profile_steps={self.profile_steps} "
                f"runs past train.max_steps={self.max_steps}: lower train.profile_from"
            )


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How the ranks of a run split the work beyond data parallelism."""

    cp: int = 1
    """Context parallelism: every packed row is split over `cp` ranks (each sample cut into
    2·cp chunks, rank r holding chunks r and 2·cp−1−r). Under torchrun the world is data ×
    context parallel: ranks g·cp … g·cp+cp−1 form context group g and share one row; FSDP2
    shards over all ranks. Needs data.pad_to_multiple_of a multiple of 2·cp."""

    def __post_init__(self) -> None:
        if self.cp < 1:
            raise ValueError(f"parallel.cp must be >= 1, got {self.cp}")


@dataclass(kw_only=True, slots=True)
class Config:
    """A whole run."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.optim.lr is None:  # the fine-tuning default (OptimConfig.lr)
            self.optim.lr = 2e-4 if self.model.lora.rank else 1e-5
        mixed = [f"{m.source} (in data.mix)" for m in self.data.mix or () if m.source != "synthetic"]
        source = self.data.source if self.data.source != "synthetic" else next(iter(mixed), None)
        if source is not None and self.model.init != "random" and not Path(self.model.name).is_dir():
            raise ValueError(random_weights_refusal(self.model.name, source))
        if self.train.memory_check == "shorten" and self.data.packing == "none":
            raise ValueError("train.memory_check=shorten halves packed bins and doubles "
                             "train.micro_batches to keep a step's tokens, but data.packing=none "
                             "trains padded batches of data.batch_size samples: set "
                             "train.memory_check=refuse and a smaller data.batch_size")
        if self.model.checkpoint_share == "auto" and self.data.packing == "none":
            raise ValueError("model.checkpoint_share=auto plans packed rows of data.seq_len "
                             "tokens, and data.packing=none pads batches of data.batch_size "
                             "samples: set a share (e.g. model.checkpoint_share=1.0)")
        cp = self.parallel.cp
        if cp > 1 and self.data.packing == "none":
            raise ValueError("parallel.cp > 1 splits packed rows: set data.packing to bfd, ffd "
                             "or greedy (or parallel.cp=1 for padded batches)")
        if cp > 1 and self.model.backend not in ("auto", "varlen"):
            raise ValueError(f"parallel.cp > 1 runs vlpack's varlen attention across ranks; "
                             f"model.backend={self.model.backend} does not: set "
                             "model.backend=auto (or varlen)")
        if cp > 1 and self.data.pad_to_multiple_of % (2 * cp):
            unit = math.lcm(self.data.pad_to_multiple_of, 2 * cp)
            raise ValueError(f"parallel.cp={cp} cuts every sample into {2 * cp} equal chunks: "
                             f"set data.pad_to_multiple_of to a multiple of {2 * cp} (e.g. "
                             f"data.pad_to_multiple_of={unit})")
        if cp > 1 and self.train.eval_generate_every:
            raise ValueError("train.eval_generate_every generates whole rows, and parallel.cp > 1 "
                             "splits every row over ranks: set train.eval_generate_every=0 and "
                             "score the checkpoints with `vlpack eval`")
        if self.train.eval_generate_every and not self.data.eval_samples:
            raise ValueError("train.eval_generate_every generates held-out samples: set "
                             "data.eval_samples (e.g. data.eval_samples=16)")

        if self.model.frozen_dtype == "int8":
            if self.data.packing == "none":
                raise ValueError("model.frozen_dtype=int8 runs the routed experts through vlpack's "
                                 "experts kernel, which padded batches (data.packing=none) do not "
                                 "use: set data.packing=bfd, or model.frozen_dtype=auto")
            if self.train.export_hf:
                raise ValueError("train.export_hf=true writes the live model, whose experts are "
                                 "int8 under model.frozen_dtype=int8: set train.export_hf=false "
                                 "and export the final checkpoint with `vlpack export RUN_DIR` "
                                 "(it merges the adapters into the base as stored)")

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)


# ---------------------------------------------------------------------------------------------
# Building configs from dicts, YAML files and dotted overrides.


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple | list):
        return [_to_plain(x) for x in obj]
    return obj


_KIND = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert `value` (from YAML or a command line) to the annotated type `tp`."""
    if dataclasses.is_dataclass(tp):  # an element of a list of sections (data.mix)
        return _build(tp, value, f"{key}.")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            if type(None) in args:
                return None
        errors = []
        kinds = [a for a in args if a is not type(None)]
        for a in kinds:
            try:
                return _coerce(key, value, a)
            except ValueError as e:
                errors.append(str(e))
        if len(kinds) > 1:  # e.g. float | Literal["auto"]
            what = " or ".join(", ".join(map(str, typing.get_args(a)))
                               if typing.get_origin(a) is Literal else _KIND.get(a, str(a))
                               for a in kinds)
            raise ValueError(f"{key} needs {what}, got {value!r}")
        raise ValueError(errors[0] if errors else f"{key}: cannot use {value!r}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            choices = ", ".join(map(str, typing.get_args(tp)))
            raise ValueError(f"{key}={value!r} is not one of {choices}")
        return value
    if origin is list:
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if not isinstance(value, list):
            raise ValueError(f"{key} needs a list like [q_proj, v_proj], got {value!r}")
        (arg,) = typing.get_args(tp)
        return [_coerce(key, v, arg) for v in value]
    if origin is tuple:
        if isinstance(value, str):
            value = yaml.safe_load(value)
        args = typing.get_args(tp)
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ValueError(f"{key} needs {len(args)} values like [0.9, 0.95], got {value!r}")
        return tuple(_coerce(key, v, a) for v, a in zip(value, args, strict=True))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ValueError(f"{key} needs true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"{key} needs an integer, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} needs an integer, got {value!r}") from None
        if not f.is_integer():
            raise ValueError(f"{key} needs an integer, got {value!r}")
        return int(f)
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} needs a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, dict | list):
            raise ValueError(f"{key} needs a string, got {value!r}")
        return str(value)
    raise AssertionError(f"unsupported config type {tp} for {key}")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{prefix or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; known: {', '.join(names)}"
            raise ValueError(f"unknown config key {full!r}{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value or {}, f"{full}.")
        else:
            kwargs[key] = _coerce(full, value, tp)
    return cls(**kwargs)


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a Config from a nested dict (as YAML gives it)."""
    return _build(Config, data, "")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted `key=value` overrides to a nested dict (values parsed as YAML scalars)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2:
            raise ValueError(f"override key {key!r} must be section.key (e.g. train.max_steps, "
                             "model.lora.rank)")
        value = yaml.safe_load(raw) if raw.strip() else None
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"config section {'.'.join(parts[:depth + 1])!r} must be a "
                                 "mapping")
            node[part] = dict(child)
            node = node[part]
        node[parts[-1]] = raw if isinstance(value, str) else value
    return out


RECIPES = Path(__file__).parent / "configs"
"""Shipped recipes (`configs/` at the repository root links here)."""


def recipe_path(name_or_path: str | Path) -> Path:
    """A YAML path as given, or the shipped recipe of that name (`tiny`, `qwen3-vl-2b`, ...)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    recipe = RECIPES / f"{name_or_path}.yaml"
    if recipe.is_file():
        return recipe
    names = ", ".join(sorted(q.stem for q in RECIPES.glob("*.yaml")))
    if p.suffix in (".yaml", ".yml") or len(p.parts) > 1:  # meant as a file
        where = "is a folder" if p.is_dir() else "does not exist"
        raise ValueError(f"config file {p} {where} (from {Path.cwd()}): give the path of a "
                         f"YAML file, or a shipped recipe: {names}")
    raise ValueError(f"config {name_or_path} is neither a YAML file nor a recipe; recipes: {names}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's safe loader refusing a key given twice in one mapping (plain YAML keeps the last
    value without a word); `<<` merge keys still override."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if not isinstance(key, typing.Hashable):  # the safe loader names it
                continue
            if key in first:
                raise ValueError(
                    f"{key_node.start_mark.name}:{line}: the key {key!r} appears twice in one "
                    f"mapping (first at line {first[key]}; YAML would keep only the last "
                    "value): delete one of them")
            first[key] = line
        return super().construct_mapping(node, deep=deep)


def read_recipe(p: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML config as a nested dict, with the recipe its `base:` names (a recipe name, or a
    YAML path relative to this file) underneath: this file's keys override the base's, section
    by section; a list replaces the base's list whole."""
    if p.resolve() in chain:
        loop = " → ".join(str(q) for q in (*chain, p.resolve()))
        raise ValueError(f"{p}: the base: recipes form a loop ({loop}): remove one base:")
    try:
        with p.open() as f:  # the stream's name is the file's in errors
            data = yaml.load(f, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: the top level must be a mapping of sections (model:, data:, "
                         f"train:, ...), not a {type(data).__name__}: {str(data)[:80]}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ValueError(f"{p}: base: must name a recipe or a YAML file, got {base!r}")
    near = p.parent / base
    if near.is_file():
        return _merged(read_recipe(near, (*chain, p.resolve())), data)
    try:
        found = recipe_path(base)
    except ValueError as e:
        raise ValueError(f"{p}: base: {base} is neither a file beside it ({near}) nor found "
                         f"from {Path.cwd()}: {e}") from None
    return _merged(read_recipe(found, (*chain, p.resolve())), data)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, mappings merged key by key."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(out.get(k), dict) and (v is None or isinstance(v, dict)):  # `model:` alone
            out[k] = _merged(out[k], v or {})
        else:
            out[k] = v
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config or a recipe by name (the dataclass defaults when `path` is None), with
    its `base:` recipe underneath (`read_recipe`), and apply overrides."""
    data = read_recipe(recipe_path(path)) if path is not None else {}
    try:
        return config_from_dict(apply_overrides(data, overrides or []))
    except ValueError as e:
        raise ValueError(f"{path}: {e}" if path else str(e)) from None


def save_config(cfg: Config, path: str | Path) -> None:
    """Write `cfg` as YAML that `load_config` reads back to an equal Config."""
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
