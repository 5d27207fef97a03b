"""Build a Qwen-VL model by preset name or from a local HF folder, ready for packed rows.

`build_model` never downloads: a preset builds random weights from its config; a folder is read
with `local_files_only=True` (config.json + *.safetensors; with `random_init`, random weights of
its config.json, warned, and no weight file is read).
The returned model has vlpack's attention registered and selected and its family's seams
installed by class (seams.py): the vision tower and attention (host tables, one varlen call per
block), the deepstack merge and the Gated-DeltaNet kernels read the forward's Boundaries.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vlpack.families import family as family_of
from vlpack.model import attention, experts, seams
from vlpack.model.presets import Preset, get_preset

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class ModelSpec:
    """What the data side and the trainer need to know about a built model."""

    name: str
    family: str
    attn_implementation: str
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    pad_token_id: int
    eos_token_id: int
    vocab_size: int
    is_moe: bool
    has_gdn: bool
    num_experts: int = 0
    num_experts_per_tok: int = 0
    tokens_per_second: int | None = None
    """Qwen2.5-VL's temporal positions per second of video (its vision config's)."""

    @property
    def patch_dim(self) -> int:
        """Width of one flattened pixel patch: channels × temporal patch × patch²."""
        return 3 * self.temporal_patch_size * self.patch_size**2


def preset_config(preset: Preset):
    """The transformers config object of a preset."""
    from transformers import CONFIG_MAPPING

    ids = preset.ids
    text = dict(preset.text, vocab_size=ids["vocab_size"], pad_token_id=ids["pad_token_id"],
                eos_token_id=ids["eos_token_id"], tie_word_embeddings=preset.tie_word_embeddings)
    return CONFIG_MAPPING[preset.family](
        text_config=text,
        vision_config=dict(preset.vision),
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        tie_word_embeddings=preset.tie_word_embeddings,
    )


def _model_class(name: str) -> type[nn.Module]:
    import transformers

    return getattr(transformers, family_of(name).hf_class)


def _spec(name: str, config, attn: str) -> ModelSpec:
    family = config.model_type
    text, vision = config.text_config, config.vision_config
    defaults = family_of(family).ids
    pad = getattr(text, "pad_token_id", None)
    if pad is None:
        pad = getattr(config, "pad_token_id", None)
    eos = getattr(config, "eos_token_id", None) or getattr(text, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0]
    patch = getattr(vision, "patch_size", None) or getattr(vision, "spatial_patch_size", 14)
    n_exp = int(getattr(text, "num_experts", 0) or 0)
    return ModelSpec(
        name=name,
        family=family,
        attn_implementation=attn,
        patch_size=int(patch),
        merge_size=int(vision.spatial_merge_size),
        temporal_patch_size=int(vision.temporal_patch_size),
        image_token_id=int(config.image_token_id),
        video_token_id=int(config.video_token_id),
        vision_start_token_id=int(config.vision_start_token_id),
        vision_end_token_id=int(config.vision_end_token_id),
        pad_token_id=int(defaults["pad_token_id"] if pad is None else pad),
        eos_token_id=int(defaults["eos_token_id"] if eos is None else eos),
        vocab_size=int(text.vocab_size),
        is_moe=n_exp > 0,
        has_gdn="linear_attention" in (getattr(text, "layer_types", None) or ()),
        num_experts=n_exp,
        num_experts_per_tok=int(getattr(text, "num_experts_per_tok", 0) or 0),
        tokens_per_second=(int(vision.tokens_per_second)
                           if family_of(family).tokens_per_second else None),
    )


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on CPU, bfloat16 on GPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_model(
    name_or_dir: str,
    *,
    backend: str = "auto",
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    random_init: bool = False,
) -> tuple[nn.Module, ModelSpec]:
    """Build a model by preset name or from a local HF folder; returns (model, spec).

    backend: "auto" | "varlen" (vlpack_varlen) | "flex" (vlpack_flex) | "sdpa" (stock).
    dtype: default float32 on CPU, bfloat16 on CUDA. Random weights are seeded with `seed`.
    A folder without *.safetensors is an error unless `random_init`; with it the folder's
    config.json builds random weights (with a warning) and its weight files are not read. On
    the meta device nothing is read or initialised: shapes only, for
    `vlpack.train.distributed.parallel.load_full_state`.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or default_dtype(device)
    attn = attention.resolve_backend(backend, device)
    attention.register()
    path = Path(name_or_dir)
    torch.manual_seed(seed)
    if path.is_dir():
        model, config = _from_dir(path, attn, dtype, device, random_init)
        name = str(path)
    else:
        preset = get_preset(name_or_dir)
        config = preset_config(preset)
        with torch.device(device):
            model = _model_class(preset.family)._from_config(
                config, attn_implementation=attn, dtype=dtype
            )
        name = preset.name
    model.to(device)
    model.config.use_cache = False
    seams.install(model, model.config.model_type)
    if family_of(model.config.model_type).is_moe and attn != "sdpa":  # "sdpa" is the stock model
        model.set_experts_implementation(experts.register())
    return model, _spec(name, model.config, attn)


def _from_dir(path: Path, attn: str, dtype: torch.dtype, device: torch.device,
              random_init: bool):
    from transformers import AutoConfig

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path} has no config.json: pass a HF checkpoint folder or a preset name")
    model_type = json.loads(cfg_file.read_text()).get("model_type")
    cls = _model_class(model_type)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    has_weights = folder_has_weights(path)
    if has_weights and device.type == "meta":  # shapes only: the weights arrive later
        with torch.device(device):
            return cls._from_config(config, attn_implementation=attn, dtype=dtype), config
    if has_weights and not random_init:
        model = cls.from_pretrained(path, attn_implementation=attn, dtype=dtype,
                                    local_files_only=True)
        return model, config
    if not random_init:
        raise ValueError(
            f"{path} has config.json but no weights (*.safetensors, or model.safetensors.index.json "
            "with its shards): copy the checkpoint's weight files into it, or train random weights "
            "from its config with model.init=random"
        )
    warnings.warn(f"{path}: building RANDOM weights from its config.json", stacklevel=3)
    with torch.device(device):
        model = cls._from_config(config, attn_implementation=attn, dtype=dtype)
    return model, config


def folder_has_weights(path: Path) -> bool:
    """Whether a checkpoint folder holds weight files (*.safetensors)."""
    return any(Path(path).glob("*.safetensors"))


def meta_model(name_or_dir: str, param_dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of a preset or HF folder on the meta device, its parameters in `param_dtype`: shapes
    only, no memory, no weights read (for estimates before building it)."""
    path = Path(name_or_dir)
    if path.is_dir():
        from transformers import AutoConfig

        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json: pass a HF checkpoint folder or a preset name")
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
        cls, config = _model_class(model_type), AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        preset = get_preset(name_or_dir)
        cls, config = _model_class(preset.family), preset_config(preset)
    with torch.device("meta"):
        return cls._from_config(config, attn_implementation="sdpa", dtype=param_dtype)


def set_attn_implementation(model: nn.Module, name: str) -> None:
    """Switch the attention backend of a built model in place (all sub-configs)."""
    configs = [model.config] + [
        getattr(model.config, k) for k in ("text_config", "vision_config")
        if getattr(model.config, k, None) is not None
    ]
    for c in configs:
        c._attn_implementation = name
