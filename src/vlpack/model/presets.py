"""Model presets by name: tiny configs for tests and real-size shapes for benchmarks.

Every preset keeps the REAL tokenizer ids of its family (vocab 151,936 for Qwen2/2.5/3-VL,
248,320 for Qwen3.5), so samples encoded with the real tokenizer run on the tiny models too.
Tiny presets tie the word embeddings (the vocabulary dominates their size).

Real-size presets carry the official shapes with random weights. `source` names where the
values come from; `unverified` lists values not confirmed against a published config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from vlpack.families import FAMILIES as REGISTRY
from vlpack.families import family
from vlpack.preset_names import NAMES

FAMILIES = tuple(REGISTRY)


@dataclass(frozen=True)
class Preset:
    """A named model: family (HF model_type), text/vision config dicts and provenance."""

    name: str
    family: str
    text: dict[str, Any]
    vision: dict[str, Any]
    tie_word_embeddings: bool = False
    source: str = "vlpack tiny test model"
    unverified: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ids(self) -> dict[str, int]:
        return dict(family(self.family).ids)


def _rope(theta: float, section: list[int], interleaved: bool, partial: float | None = None):
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta, "mrope_section": section}
    if interleaved:
        rope["mrope_interleaved"] = True
    if partial is not None:
        rope["partial_rotary_factor"] = partial
    return rope


# --- tiny presets: hidden 64, 2-4 text layers, vision depth 2 ----------------------------------
_TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=4096)
_TINY_VIS3 = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  num_position_embeddings=64)
_TINY_GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4,
                 layer_types=["linear_attention", "full_attention", "linear_attention",
                              "full_attention"])
_TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

PRESETS: dict[str, Preset] = {}


def _add(p: Preset) -> None:
    if p.name not in NAMES:
        raise ValueError(f"preset {p.name}: list its name in vlpack.preset_names (PUBLISHED with "
                         "its checkpoint, or TEST_MODELS)")
    PRESETS[p.name] = p


TINY_ROPE_THETA = 100.0
"""rope_theta of the tiny Qwen2/2.5-VL presets. Their MRoPE sections are contiguous, so h and w
get the slowest of a tiny head's 8 rotary frequencies; with the published theta (1e6) an image
position error turns them so little that logits move only about 3x past `vlpack check`'s fp32
tolerance. At 100 a swapped h/w moves them about 30x past it (tests/gates/test_mutations.py). The
interleaved Qwen3-VL and Qwen3.5 presets keep the published thetas (margins 20-300x)."""


_add(Preset(
    "tiny-qwen2_vl", "qwen2_vl",
    text=dict(_TINY_TEXT, num_hidden_layers=2,
              rope_parameters=_rope(TINY_ROPE_THETA, [2, 3, 3], False)),
    vision=dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14,
                spatial_merge_size=2, temporal_patch_size=2),
    tie_word_embeddings=True,
))
_add(Preset(
    "tiny-qwen2_5_vl", "qwen2_5_vl",
    text=dict(_TINY_TEXT, num_hidden_layers=2,
              rope_parameters=_rope(TINY_ROPE_THETA, [2, 3, 3], False)),
    # window 112 px = 8 patches = 4 merged tokens a side: images of 16×16 patches get 4 windows.
    vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                fullatt_block_indexes=[1], tokens_per_second=2),
    tie_word_embeddings=True,
))
_add(Preset(
    "tiny-qwen3_vl", "qwen3_vl",
    text=dict(_TINY_TEXT, num_hidden_layers=2, head_dim=16,
              rope_parameters=_rope(5e6, [2, 3, 3], True)),
    vision=dict(_TINY_VIS3, deepstack_visual_indexes=[0, 1]),
    tie_word_embeddings=True,
))
_add(Preset(
    "tiny-qwen3_vl_moe", "qwen3_vl_moe",
    text=dict(**_TINY_TEXT, **_TINY_MOE, num_hidden_layers=2, head_dim=16, decoder_sparse_step=1,
              mlp_only_layers=[], rope_parameters=_rope(5e6, [2, 3, 3], True)),
    vision=dict(_TINY_VIS3, deepstack_visual_indexes=[0, 1]),
    tie_word_embeddings=True,
))
_add(Preset(
    "tiny-qwen3_5", "qwen3_5",
    # head_dim 32 × partial_rotary_factor 0.25 = rotary dim 8 → mrope_section sums to 4.
    text=dict(**_TINY_TEXT, **_TINY_GDN, num_hidden_layers=4, head_dim=32,
              rope_parameters=_rope(1e7, [2, 1, 1], True, partial=0.25)),
    vision=dict(_TINY_VIS3),
    tie_word_embeddings=True,
))
_add(Preset(
    "tiny-qwen3_5_moe", "qwen3_5_moe",
    text=dict(**_TINY_TEXT, **_TINY_GDN, **_TINY_MOE, num_hidden_layers=4, head_dim=32,
              shared_expert_intermediate_size=32,
              rope_parameters=_rope(1e7, [2, 1, 1], True, partial=0.25)),
    vision=dict(_TINY_VIS3),
    tie_word_embeddings=True,
))

# --- real-size shapes (random weights) ----------------------------------------------------------
_QWEN3_VIS_27 = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                     patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                     num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh")

_QWEN3_5_LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_num_key_heads=16, linear_num_value_heads=32)
"""The Gated-DeltaNet shapes that Qwen3.5-9B and Qwen3.5-35B-A3B share."""

_add(Preset(
    "qwen3-vl-2b", "qwen3_vl",
    text=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
              num_attention_heads=16, num_key_value_heads=8, head_dim=128,
              max_position_embeddings=262144, rms_norm_eps=1e-6,
              rope_parameters=_rope(5e6, [24, 20, 20], True)),
    vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                out_hidden_size=2048, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17],
                hidden_act="gelu_pytorch_tanh"),
    tie_word_embeddings=True,
    source="the published Qwen3-VL-2B model card (28 layers, hidden 2048, ViT depth 24 / width "
           "1024, deepstack 5,11,17)",
    unverified=("all text and vision shapes: not compared with Qwen/Qwen3-VL-2B-Instruct's "
                "config.json",),
))
_add(Preset(
    "qwen3-vl-8b", "qwen3_vl",
    text=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
              num_attention_heads=32, num_key_value_heads=8, head_dim=128,
              max_position_embeddings=262144, rms_norm_eps=1e-6,
              rope_parameters=_rope(5e6, [24, 20, 20], True)),
    vision=dict(_QWEN3_VIS_27, out_hidden_size=4096, deepstack_visual_indexes=[8, 16, 24]),
    source="Qwen/Qwen3-VL-8B-Instruct config.json, as mirrored in fine-tunes of it on the HF hub "
           "(huggingface.co/Steinate/Cortex, Chhagan005/CSM-DocExtract-8N) and the ollama "
           "qwen3-vl:8b metadata",
))
_add(Preset(
    "qwen3-vl-30b-a3b", "qwen3_vl_moe",
    text=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
              num_attention_heads=32, num_key_value_heads=4, head_dim=128,
              num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
              decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=262144,
              rms_norm_eps=1e-6, rope_parameters=_rope(5e6, [24, 20, 20], True)),
    vision=dict(_QWEN3_VIS_27, out_hidden_size=2048, deepstack_visual_indexes=[8, 16, 24]),
    source="Qwen/Qwen3-VL-30B-A3B-Instruct (text shapes = Qwen3-30B-A3B: 48 layers, 128 "
           "experts top-8, moe_intermediate 768, as in MindSpeed-RL qwen3_30b_a3b.yaml)",
    unverified=("intermediate_size 6144 (dense MLP size, unused with mlp_only_layers=[])",
                "vision block: taken equal to the 8B ViT (depth 27, width 1152)"),
))
_add(Preset(
    "qwen3.5-9b", "qwen3_5",
    text=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
              num_attention_heads=16, num_key_value_heads=4, head_dim=256, **_QWEN3_5_LINEAR,
              max_position_embeddings=262144, rms_norm_eps=1e-6,
              layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
              rope_parameters=_rope(1e7, [11, 11, 10], True, partial=0.25)),
    vision=dict(_QWEN3_VIS_27, out_hidden_size=4096, deepstack_visual_indexes=[]),
    source="Qwen/Qwen3.5-9B config.json: its first 50 lines (text shapes, linear-attention "
           "heads, layer types) as fetched from the hub in a public session log; the rest as "
           "mirrored in a test fixture built from the real config (revision c2022362), an "
           "unsloth fine-tune's config.json and the Megatron arguments of radixark/miles "
           "scripts/models/qwen3.5-9B.sh, which all agree",
    unverified=("max_position_embeddings, rope_parameters (theta 1e7, partial 0.25, "
                "mrope_section [11, 11, 10]) and the vision block: from the mirrors, not seen "
                "in the official file",),
))
_add(Preset(
    "qwen3.5-35b-a3b", "qwen3_5_moe",
    text=dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
              num_key_value_heads=2, head_dim=256, **_QWEN3_5_LINEAR,
              num_experts=256, num_experts_per_tok=8,
              moe_intermediate_size=512, shared_expert_intermediate_size=512,
              max_position_embeddings=262144, rms_norm_eps=1e-6,
              layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
              rope_parameters=_rope(1e7, [11, 11, 10], True, partial=0.25)),
    vision=dict(_QWEN3_VIS_27, out_hidden_size=2048),
    source="Qwen/Qwen3.5-35B-A3B config.json as mirrored on the HF hub "
           "(huggingface.co/compiledcode83/consider_P9a81t, UnionStreet/Helios-Rabbit-1.0) "
           "and transformers' Qwen3_5MoeTextConfig defaults",
    unverified=("num_experts 256 / top-8 / moe_intermediate 512 / shared 512: transformers "
                "defaults, not seen in a returned config excerpt",
                "vision block (depth 27, width 1152, out 2048)"),
))


def get_preset(name: str) -> Preset:
    """The preset called `name`, or `BASE-<n>L`: preset BASE cut to its first n text layers
    (`reduced_depth`); ValueError lists the known names."""
    if name in PRESETS:
        return PRESETS[name]
    cut = re.fullmatch(r"(.+)-(\d+)L", name)
    if cut and cut.group(1) in PRESETS:
        return PRESETS[reduced_depth(cut.group(1), int(cut.group(2)))]
    raise ValueError(
        f"unknown model preset {name!r}: use one of {', '.join(PRESETS)} or a local HF "
        "checkpoint folder (config.json + *.safetensors)"
    )


def reduced_depth(name: str, layers: int) -> str:
    """Register (once) and return `NAME-<layers>L`: preset `name` with its first `layers` text
    layers (layer types cut to match), for benchmarks of shapes too deep for one GPU."""
    base = get_preset(name)
    if not 0 < layers <= base.text["num_hidden_layers"]:
        raise ValueError(f"layers={layers}: {name} has {base.text['num_hidden_layers']} text "
                         "layers; pass a number between 1 and that")
    text = dict(base.text, num_hidden_layers=layers)
    if "layer_types" in text:
        text["layer_types"] = list(text["layer_types"])[:layers]
    reduced = f"{base.name}-{layers}L"
    PRESETS.setdefault(reduced, replace(base, name=reduced, text=text))
    return reduced

