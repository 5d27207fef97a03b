"""LoRA on the packed path, through peft.

`apply_lora` injects peft's LoRA layers into the model in place (`peft.inject_adapter_in_model`):
the model stays the transformers model with vlpack's seams, so the packed forward, activation
checkpointing, compiled layers and FSDP2 see the same module tree with LoRA linears in it. Only
the LoRA weights train. Each adapted linear is a `FusedLoraLinear`, peft's `Linear` with `forward`
overridden, installed by class: base(x) + scale · (x Aᵀ) Bᵀ as one in-place `addmm_` on the base
projection's output, where peft's forward makes two more passes over the output (scale, add) and
its backward a third. `save_adapter` writes peft's format (`adapter_config.json` +
`adapter_model.safetensors`), which `peft.PeftModel.from_pretrained` loads on the base model;
`merged_state_dict` folds the adapter into the base weights for a plain transformers folder.

Default targets: the LLM's attention, Gated-DeltaNet and MLP projections (dense and shared-expert);
`target_modules` names other leaf names of the text model. `vision=True` adds every linear of the
vision tower and its mergers. `experts=True` adds the routed experts: their weights are 3-D
parameters ([experts, ...]), not linears, and peft adapts them through `target_parameters`
(`ParamWrapper`: one rank-r update per expert). peft applies W + B·A as a parametrization while
the experts module runs; `GroupedExpertsLora`, the wrapper's subclass installed by `apply_lora`,
overrides its `forward` to hand the factors to vlpack's experts dispatch instead
(model/experts.py: two grouped GEMMs through the rank per projection, no per-expert B·A).

Variants, peft's: `use_rslora` scales the update by alpha/sqrt(r) instead of alpha/r; `use_dora`
adds a trained magnitude per output feature of each adapted linear (DoRA: W' = m · (W + s·BA) /
‖W + s·BA‖, the norm per output row), linears only. DoRA runs peft's forward.

Legend: N = rows (tokens), E = experts, X, O = a linear's or an expert weight's input and output
widths, R = the rank (padded to a multiple of 8 in an expert's factors).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vlpack.config import LoraConfig as VlpackLora
from vlpack.model.experts import ExpertAdapter, routed_expert, takes_adapters

LLM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "in_proj_qkv", "in_proj_z", "out_proj")
"""Projection names of the text model that LoRA adapts by default."""
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
"""The routed experts' weights `model.lora.experts` adapts (peft `target_parameters`)."""


def _peft():
    try:
        import peft
    except ImportError as e:
        raise ValueError("model.lora.rank > 0 needs peft: pip install 'vlpack[lora]' "
                         "(or pip install peft)") from e
    return peft


def target_names(model: nn.Module, cfg: VlpackLora) -> list[str]:
    """Full names of the linear modules LoRA adapts in `model`: the text model's linears whose
    leaf name is in `cfg.target_modules` (default LLM_TARGETS), and with `cfg.vision` every
    linear of the vision tower and its mergers; a ValueError when none match."""
    wanted = set(cfg.target_modules or LLM_TARGETS)
    text_linears = _text_linear_names(model)
    experts = {n.rsplit(".", 1)[-1] for n, _ in model.named_parameters() if routed_expert(n)}
    routed = sorted(wanted & ((experts - text_linears) | {"experts"}))
    if cfg.target_modules and routed:
        raise ValueError(f"model.lora.target_modules names {routed}: the routed experts' weights "
                         "are 3-D parameters, not linear layers; adapt them with "
                         "model.lora.experts=true (and leave them out of target_modules)")
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or name.endswith("lm_head"):
            continue
        if ".visual." in f".{name}.":
            if cfg.vision:
                out.append(name)
        elif name.rsplit(".", 1)[-1] in wanted:
            out.append(name)
    if cfg.target_modules and wanted - text_linears and out:
        raise ValueError(f"model.lora.target_modules: {sorted(wanted - text_linears)} match no "
                         f"linear layer of {type(model).__name__}'s text model; its projection "
                         f"names include {sorted(text_linears)[:12]}")
    if not out:
        raise ValueError(f"model.lora.target_modules={sorted(wanted)} matches no linear layer of "
                         f"{type(model).__name__}; name the projections' leaf names, e.g. "
                         f"{list(LLM_TARGETS[:4])}")
    return out


def _text_linear_names(model: nn.Module) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and ".visual." not in f".{n}." and not n.endswith("lm_head")}


def _expert_targets(model: nn.Module, cfg: VlpackLora) -> list[str]:
    """The routed experts' weights `cfg` adapts on `model` (`experts.gate_up_proj`, ...): none
    without `cfg.experts`, a ValueError for a dense model."""
    if not cfg.experts:
        return []
    names = {n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1]
             for n, _ in model.named_parameters() if routed_expert(n)}
    found = [p for p in EXPERT_PARAMETERS if p in names]
    if not found:
        raise ValueError(f"model.lora.experts=true but {type(model).__name__} has no routed "
                         "experts (a dense family): leave model.lora.experts off")
    return found


def expert_parameters(model: nn.Module, cfg: VlpackLora) -> list[str]:
    """The `target_parameters` of `cfg` on `model`: the routed experts' weights with
    `cfg.experts`, else none; a ValueError for a dense model or a peft without them."""
    found = _expert_targets(model, cfg)
    if not found:
        return []
    peft = _peft()
    if "target_parameters" not in peft.LoraConfig.__dataclass_fields__:
        raise ValueError(f"model.lora.experts=true needs peft >= 0.17 (LoRA on weight tensors); "
                         f"peft {peft.__version__} is installed: pip install -U peft")
    return found


def peft_config(model: nn.Module, cfg: VlpackLora):
    """The `peft.LoraConfig` of `cfg` on `model` (its targets as full module names, the
    experts' weights as `target_parameters`)."""
    peft = _peft()
    extra = {"target_parameters": p} if (p := expert_parameters(model, cfg)) else {}
    return peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                           target_modules=target_names(model, cfg), bias="none",
                           use_dora=cfg.use_dora, use_rslora=cfg.use_rslora, **extra)


def apply_lora(model: nn.Module, cfg: VlpackLora) -> int:
    """Inject LoRA layers into `model` in place and freeze everything else; returns the number
    of adapted modules. The LoRA weights are initialised by peft (B = 0, and DoRA's magnitudes
    the base weights' row norms: the model's function is unchanged until it trains)."""
    peft = _peft()
    pc = peft_config(model, cfg)
    peft.inject_adapter_in_model(pc, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    adapted = [m for m in model.modules() if hasattr(m, "lora_A")]
    linear = fused_lora_linear()
    for m in adapted:
        # The adapter takes its input in the activation dtype: peft would copy a bf16 input to
        # the adapters' float32 (a launch forward and backward per adapter), which autocast then
        # casts back for the matmul, so the copy changes no bit.
        m.cast_input_dtype_enabled = False
        if hasattr(m, "parameter_name"):  # an expert weight's wrapper: factors to the dispatch
            m.__class__ = grouped_experts_lora()
        elif type(m) is linear.__base__:
            m.__class__ = linear
    model._vlpack_lora = pc
    return len(adapted)


def _registered(name: str, base: type, forward: Callable) -> type:
    """`base` with `forward` overridden, registered in this module as `name`, so a model with it
    pickles (`__getattr__` makes it again for an unpickled model)."""
    cls = type(name, (base,), {"forward": forward, "__module__": __name__, "__qualname__": name})
    globals()[name] = cls
    return cls


@functools.cache
def fused_lora_linear() -> type:
    """peft's LoRA `Linear` with `forward` overridden (`_fused_forward`), made once."""
    from peft.tuners.lora.layer import Linear

    return _registered("FusedLoraLinear", Linear, _fused_forward)


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """base(x) + scale · (x Aᵀ) Bᵀ with the scale and the sum inside one matmul (`addmm`'s alpha
    and beta): peft's forward scales and adds the update in two more passes over the layer's
    output, and its backward scales the output's gradient in a third. peft's own forward where
    the call has more arguments, or the adapter is off, merged, not the only one, a variant
    (DoRA), has a bias on B (peft's `lora_bias`), or where its dtypes differ from the input's
    outside autocast."""
    from peft.tuners.lora.layer import Linear

    active = self.active_adapters
    name = active[0] if len(active) == 1 else None
    variant = name in getattr(self, "lora_variant", {}) or self.use_dora.get(name, False)
    if (args or kwargs or self.disable_adapters or self.merged or name not in self.lora_A
            or variant or self.lora_B[name].bias is not None):
        return Linear.forward(self, x, *args, **kwargs)
    a_RX, b_OR = self.lora_A[name].weight, self.lora_B[name].weight
    if not torch.is_autocast_enabled(x.device.type) and not x.dtype == a_RX.dtype == b_OR.dtype:
        return Linear.forward(self, x, *args, **kwargs)
    dropout = self.lora_dropout[name]
    # 2-D rows throughout, so the in-place add below lands on the base's own output, not a view
    # of it (autograd would copy the output in backward to rebase the view)
    x_NX = x.reshape(-1, x.shape[-1])
    base_NO = self.base_layer(x_NX)
    low_NR = F.linear(x_NX if isinstance(dropout, nn.Identity) else dropout(x_NX), a_RX)
    # In place: the out-of-place addmm first copies the base output into a new tensor (a device
    # copy per eager call; compiled graphs lower both forms alike), and nothing keeps that output
    # for its backward (a base that does fails autograd's version check). In-place ops are not
    # autocast: the factors take the output's dtype.
    base_NO.addmm_(low_NR.to(base_NO.dtype), b_OR.t().to(base_NO.dtype), alpha=self.scaling[name])
    return base_NO.view(*x.shape[:-1], base_NO.shape[-1])


@functools.cache
def grouped_experts_lora() -> type:
    """peft's `ParamWrapper` with `forward` overridden (`_grouped_forward`), made once."""
    from peft.tuners.lora.layer import ParamWrapper

    return _registered("GroupedExpertsLora", ParamWrapper, _grouped_forward)


def __getattr__(name: str):  # an unpickled model finds the subclasses before anything made them
    makers = {"GroupedExpertsLora": grouped_experts_lora, "FusedLoraLinear": fused_lora_linear}
    if name in makers:
        return makers[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _grouped_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The experts forward with the adapters of this wrapper and of the wrappers it nests (peft
    nests one per adapted weight) passed to vlpack's dispatch as factors
    (`experts.ExpertAdapter`); peft's own forward (the adapted weight as a parametrization) where
    the experts module does not run vlpack's dispatch, or the adapters are off, merged or more
    than one."""
    from peft.tuners.lora.layer import ParamWrapper

    wrappers, base = [self], self.base_layer
    while isinstance(base, ParamWrapper):
        wrappers.append(base)
        base = base.base_layer
    if kwargs or not takes_adapters(base) or not all(map(_factored, wrappers)):
        return ParamWrapper.forward(self, x, *args, **kwargs)
    return base(x, *args, adapters={w.parameter_name: expert_adapter(w) for w in wrappers})


def _factored(wrapper: nn.Module) -> bool:
    """Whether `wrapper` (a `ParamWrapper`) adapts a [E, O, X] expert stack with one active,
    unmerged adapter."""
    active = wrapper.active_adapters
    return (not wrapper.disable_adapters and not wrapper.merged and len(active) == 1
            and active[0] in wrapper.lora_A and wrapper.num_experts > 1
            and wrapper._did_swap_in_out_features)


def expert_adapter(wrapper: nn.Module) -> ExpertAdapter:
    """The active adapter of `wrapper` (a `ParamWrapper` over an [E, O, X] expert weight) as
    grouped factors: peft's A [E·r, X] and B [O, r·E] as A [E, R, X] and B [E, O, R], the rank
    padded with zeros to R, a multiple of 8."""
    name = wrapper.active_adapters[0]
    a, b, e = wrapper.lora_A[name].weight, wrapper.lora_B[name].weight, wrapper.num_experts
    a_ERX = a.reshape(e, -1, a.shape[-1])
    b_EOR = b.reshape(b.shape[0], -1, e).permute(2, 0, 1)
    pad = -a_ERX.shape[1] % 8
    return ExpertAdapter(F.pad(a_ERX, (0, 0, 0, pad)), F.pad(b_EOR, (0, pad)).contiguous(),
                         wrapper.scaling[name])


def plan_lora(model: nn.Module, cfg: VlpackLora) -> int:
    """LoRA on the meta model the memory plan reads: peft's layers (`apply_lora`) where peft is
    installed, else `shape_adapters` (the same trainable shapes without peft, so `vlpack train
    --dry-run` plans a LoRA recipe on a machine without it); returns the adapted modules."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return shape_adapters(model, cfg)
    return apply_lora(model, cfg)


def shape_adapters(model: nn.Module, cfg: VlpackLora) -> int:
    """Register on `model` trainable stand-ins of the LoRA weights `apply_lora` adds, in their
    shapes, and freeze everything else; returns the number of adapted modules. For the memory
    plan only (the forward ignores them). An adapted linear [out, in] gets A [r, in] and
    B [out, r], rank·(in + out) weights, and under DoRA a magnitude [out]; an adapted expert
    weight [E, a, b] gets peft's `ParamWrapper` factors A [E·r, a] and B [b, r·E],
    rank·E·(a + b)."""
    r, adapted = cfg.rank, 0

    def stand_in(module: nn.Module, leaf: str, a: tuple[int, ...], b: tuple[int, ...]) -> None:
        for part, shape in (("A", a), ("B", b)):
            module.register_parameter(f"lora_{part}{leaf}", nn.Parameter(
                torch.empty(shape, device="meta", dtype=torch.float32)))

    model.requires_grad_(False)
    for name in target_names(model, cfg):
        m = model.get_submodule(name)
        stand_in(m, "", (r, m.in_features), (m.out_features, r))
        if cfg.use_dora:
            m.register_parameter("lora_magnitude", nn.Parameter(
                torch.empty(m.out_features, device="meta", dtype=torch.float32)))
        adapted += 1
    experts = set(_expert_targets(model, cfg))
    for name, p in list(model.named_parameters()):
        owner, leaf = name.rsplit(".", 1)
        if routed_expert(name) and f"{owner.rsplit('.', 1)[-1]}.{leaf}" in experts:
            e, a, b = p.shape
            stand_in(model.get_submodule(owner), f"_{leaf}", (e * r, a), (b, r * e))
            adapted += 1
    return adapted


def _clean(name: str) -> str:
    """A module or parameter name as a state dict names it (no compile or checkpoint wrapper
    parts)."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def _wrapped_parameters(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """{state-dict prefix of a ParamWrapper: (the wrapped parameter's full key, the wrapper)}."""
    out = {}
    for name, m in model.named_modules():
        if hasattr(m, "parameter_name") and hasattr(m, "lora_A"):
            inner = name
            while True:  # the wrapped parameter lives on the innermost base layer
                inner += ".base_layer"
                if not hasattr(model.get_submodule(inner), "lora_A"):
                    break
            out[_clean(name)] = (f"{_clean(inner)}.{m.parameter_name}", m)
    return out


def merge_groups(model: nn.Module, keys) -> dict[str, list[str]]:
    """{key of the plain model's state: the keys of `keys` (a LoRA model's state) it is made
    from}: a base weight with its adapter's A and B (and DoRA's magnitude), every other tensor
    alone; adapter-only keys belong to their base weight's group. A model without LoRA maps each
    key to itself."""
    if getattr(model, "_vlpack_lora", None) is None:
        return {k: [k] for k in keys}
    keys = list(keys)
    present = set(keys)
    wrapped = {key: prefix for prefix, (key, _) in _wrapped_parameters(model).items()}
    groups = {}
    for key in keys:
        if ".lora_" in key:
            continue
        if key in wrapped:
            p = wrapped[key]
            groups[key.replace(".base_layer", "")] = [key, f"{p}.lora_A.default.weight",
                                                      f"{p}.lora_B.default.weight"]
        elif ".base_layer." in key:
            prefix, leaf = key.split(".base_layer.")
            adapter = ([f"{prefix}.lora_A.default.weight", f"{prefix}.lora_B.default.weight"]
                       if leaf == "weight" else [])
            magnitude = f"{prefix}.lora_magnitude_vector.default.weight"
            adapter += [magnitude] if adapter and magnitude in present else []
            groups[f"{prefix}.{leaf}"] = [key, *adapter]
        else:
            groups[key] = [key]
    return groups


def _expert_delta(wrapper: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The update B·A of one adapted expert weight, per expert, in the weight's layout (peft's
    `ParamWrapper` factor layout: A [experts·r, in], B [out, r·experts])."""
    e = wrapper.num_experts
    a = a.reshape(e, -1, a.shape[-1])
    b = b.reshape(b.shape[0], -1, e)
    layout = "e o i" if wrapper._did_swap_in_out_features else "e i o"
    return torch.einsum(f"o r e, e r i -> {layout}", b, a) * wrapper.scaling["default"]


def save_adapter(model: nn.Module, out_dir: str | Path, state_dict: dict | None = None,
                 base: str | None = None) -> Path:
    """Write the adapter of `model` in peft's format into `out_dir` (`state_dict`: the full
    model state, e.g. gathered from FSDP2; default the model's own)."""
    peft = _peft()
    from safetensors.torch import save_file

    pc = model._vlpack_lora
    pc.base_model_name_or_path = base
    # no embedding layers are adapted: peft would otherwise look the base model up on the hub
    sd = peft.get_peft_model_state_dict(model, state_dict=state_dict, save_embedding_layers=False)
    # the names a PeftModel wrapping the base model saves and loads
    sd = {f"base_model.model.{k}": v for k, v in sd.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in sd.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    pc.save_pretrained(str(out))
    return out


def lora_scale(pc) -> float:
    """The factor of a linear's update B·A under peft config `pc`: alpha / r, or alpha / sqrt(r)
    with rsLoRA."""
    return pc.lora_alpha / (math.sqrt(pc.r) if pc.use_rslora else pc.r)


def merged_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict:
    """`state_dict` (the state of a LoRA model, or whole groups of `merge_groups` of it) with
    each adapter folded into its base weight (W + scale · B A; per expert for the routed
    experts' weights; under DoRA m · (W + scale · B A) / ‖W + scale · B A‖, the norm per
    output row) under the base layer's own name: the state of the plain model. A merged
    weight is float32 whatever the base's dtype (a base held in bf16 plus a float32 update is
    not a bf16 number); every other tensor keeps its dtype."""
    scale = lora_scale(model._vlpack_lora)
    wrappers = {key: w for key, w in _wrapped_parameters(model).values()}
    out = {}
    for plain, sources in merge_groups(model, state_dict).items():
        value = state_dict[sources[0]]
        if len(sources) >= 3:
            a, b = (state_dict[k].to(torch.float32) for k in sources[1:3])
            delta = (_expert_delta(wrappers[sources[0]], a, b) if sources[0] in wrappers
                     else scale * (b @ a))
            value = value.to(torch.float32) + delta
        if len(sources) == 4:  # DoRA: the trained magnitude over the adapted row's norm
            magnitude = state_dict[sources[3]].to(torch.float32)
            value = value * (magnitude / torch.linalg.norm(value, dim=1))[:, None]
        out[plain] = value
    return out


def describe(model: nn.Module) -> str:
    """One line: rank, alpha, adapted linears and trainable share."""
    pc = model._vlpack_lora
    total = sum(p.numel() for p in model.parameters())
    train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    adapted = sum(1 for m in model.modules() if hasattr(m, "lora_A")
                  and not hasattr(m, "parameter_name"))
    experts = sum(1 for m in model.modules() if hasattr(m, "parameter_name"))
    variant = "".join(f", {v}" for v, on in (("DoRA", pc.use_dora), ("rsLoRA", pc.use_rslora))
                      if on)
    return (f"LoRA rank {pc.r}, alpha {pc.lora_alpha}{variant}, {adapted} linears"
            + (f" and {experts} expert weights" if experts else "") + ": "
            f"{train:,} of {total:,} parameters train ({100 * train / total:.2f}%)")


def adapter_config(path: str | Path) -> dict:
    """The `adapter_config.json` of an adapter folder."""
    return json.loads((Path(path) / "adapter_config.json").read_text())
