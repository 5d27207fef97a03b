"""Model FLOPs of a training step, for MFU: the FLOPs the step performs, recomputation aside.

A weight costs 2 FLOPs per token (or patch) and parameter in the forward, 2 more for the
gradient of its input and 2 for its own gradient: 6 when it trains, 4 when it is frozen but a
gradient flows through it (the LoRA base, a frozen LLM under a training vision tower), 2 when no
gradient flows through it at all (a frozen vision tower below a frozen merger). Attention costs
its forward once and its backward twice (3×), or once where no gradient flows.

  text   = c_text · T_real               c_text: Σ factor · weights of the LLM a token touches
                                         (MoE: attention + router + top-k experts + shared
                                         expert), lm_head included
  vision = c_vis · P                     c_vis: the same over the vision tower and merger,
                                         P: ViT patches
  attn   = a · 2 · d_attn · Σ_s L_s² / 2 · n_attn   causal text attention over each sample (QKᵀ
                                         and AV: 2 matmuls of 2·d flops per pair, a = 3 · 2),
                                         n_attn = full-attention layers only
         + a_vis · 2 · d_vis · Σ_f F_f² · depth    bidirectional vision attention per frame

MFU = FLOPs / (step time × peak). Gated-DeltaNet layers count as linear projections (their
recurrence is O(T·d_k·d_v), small next to the projections).

Recomputation (activation checkpointing) performs a recomputed layer's forward a second time in
backward. MFU does not count it; `recomputed_flops` does, read from the layers'
`gradient_checkpointing` flags, so a run can say which share of the FLOPs it performed went
into recomputing (the metrics' `recompute_flops_share`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlpack.model.experts import routed_expert

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0}
"""Dense bf16 tensor-core peak per GPU (TFLOP/s)."""


@dataclass(frozen=True, slots=True)
class FlopModel:
    text_per_token: float
    """FLOPs of the LLM's weights per token (forward and backward)."""
    vision_per_patch: float
    """FLOPs of the vision tower's and merger's weights per patch."""
    text_attn_dim: int
    text_attn_layers: int
    vision_attn_dim: int
    vision_depth: int
    vision_attn_passes: int = 3
    """3 when a gradient flows through the vision attention, else 1 (forward only)."""
    recomputed_per_token: float = 0.0
    """Forward FLOPs per token of the text layers that recompute in backward (not counted)."""
    recomputed_attn_layers: int = 0
    """Full-attention text layers among them."""
    recomputed_per_patch: float = 0.0
    """The same for recomputed vision blocks (only where a gradient flows through them)."""
    recomputed_vision_blocks: int = 0

    def batch_flops(self, seg_lengths: list[int], patches: int, frame_patches: list[int]) -> float:
        T = sum(seg_lengths)
        text = self.text_per_token * T
        vision = self.vision_per_patch * patches
        attn = 6 * 2 * self.text_attn_dim * self.text_attn_layers * sum(n * n for n in seg_lengths) / 2
        attn += (self.vision_attn_passes * 2 * 2 * self.vision_attn_dim * self.vision_depth
                 * sum(f * f for f in frame_patches))
        return text + vision + attn

    def recomputed_flops(self, seg_lengths: list[int], patches: int,
                         frame_patches: list[int]) -> float:
        """FLOPs the step performs again in backward for its recomputed layers (their forward:
        2 per weight and token, attention's two matmuls once): performed, not counted in MFU."""
        attn = 2 * 2 * self.text_attn_dim * self.recomputed_attn_layers * sum(
            n * n for n in seg_lengths) / 2
        attn += 2 * 2 * self.vision_attn_dim * self.recomputed_vision_blocks * sum(
            f * f for f in frame_patches)
        return (self.recomputed_per_token * sum(seg_lengths) + self.recomputed_per_patch * patches
                + attn)

    def of_batch(self, batch) -> float:
        """FLOPs of a ThdBatch or PaddedBatch (host tensors: no device sync)."""
        return self.batch_flops(*_shape(batch))

    def recomputed_of_batch(self, batch) -> float:
        """`recomputed_flops` of a ThdBatch or PaddedBatch."""
        return self.recomputed_flops(*_shape(batch))


def _shape(batch) -> tuple[list[int], int, list[int]]:
    """A batch's segment lengths, patches and patches per frame (host tensors)."""
    frames = [h * w for t, h, w in batch.image_grid_thw.tolist() for _ in range(t)]
    return batch.seq_lengths, sum(frames), frames


def _factor(p: torch.nn.Parameter, grad_flows: bool) -> int:
    return 6 if p.requires_grad else 4 if grad_flows else 2


def _matmul_flops(module: torch.nn.Module, grad_flows: bool, experts: bool = False) -> float:
    """Σ factor · weight over the nn.Linear layers of `module` (its MoE experts' linears only
    with `experts`, else every linear but them), or over its fused 3-D expert weights."""
    total = 0.0
    for n, m in module.named_modules():
        if isinstance(m, torch.nn.Linear) and routed_expert(n) == experts:
            total += _factor(m.weight, grad_flows) * m.weight.numel()
    if experts:
        total += sum(_factor(p, grad_flows) * p.numel()
                     for n, p in module.named_parameters() if routed_expert(n) and p.ndim == 3)
    return total


def flop_model(model: torch.nn.Module) -> FlopModel:
    """Counts matmul parameters of a Qwen-VL `*ForConditionalGeneration` model, each by whether
    it trains and whether a gradient flows through it (read from `requires_grad`: call it after
    LoRA and freezing)."""
    cfg = model.config
    text_cfg = getattr(cfg, "text_config", cfg)
    vis_cfg = cfg.vision_config
    lm, visual = model.model.language_model, model.model.visual
    # a gradient flows through the LLM whenever anything trains (the LLM itself, or the vision
    # side below it); through the vision tower only when it or its merger trains
    vision_trains = any(p.requires_grad for p in visual.parameters())
    text = _matmul_flops(lm, True) + _factor(model.lm_head.weight, True) * model.lm_head.weight.numel()
    n_experts = getattr(text_cfg, "num_experts", 0) or 0
    if n_experts:  # only the top-k experts run for a token
        text += _matmul_flops(lm, True, experts=True) * text_cfg.num_experts_per_tok / n_experts
    heads = text_cfg.num_attention_heads
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads
    layer_types = getattr(text_cfg, "layer_types", None)
    n_attn = (
        sum(t == "full_attention" for t in layer_types) if layer_types else text_cfg.num_hidden_layers
    )
    vis_hidden = getattr(vis_cfg, "hidden_size", None) or vis_cfg.embed_dim
    share = text_cfg.num_experts_per_tok / n_experts if n_experts else 0.0
    recomputed = [layer for layer in lm.layers if getattr(layer, "gradient_checkpointing", False)]
    # a block recomputes only where a gradient flows through it: something in or below the
    # blocks trains (a training merger alone above a frozen tower needs no block's backward)
    blocks_backward = any(p.requires_grad for n, p in visual.named_parameters()
                          if not n.startswith(("merger", "deepstack")))
    blocks = [b for b in getattr(visual, "blocks", []) if getattr(b, "gradient_checkpointing", False)
              ] if blocks_backward else []
    return FlopModel(
        recomputed_per_token=sum(_forward_flops(layer, share) for layer in recomputed),
        recomputed_attn_layers=sum(hasattr(layer, "self_attn") for layer in recomputed),
        recomputed_per_patch=sum(_forward_flops(b, 0.0) for b in blocks),
        recomputed_vision_blocks=len(blocks),
        text_per_token=text,
        vision_per_patch=_matmul_flops(visual, vision_trains),
        text_attn_dim=heads * head_dim,
        text_attn_layers=n_attn,
        vision_attn_dim=vis_hidden,
        vision_depth=vis_cfg.depth,
        vision_attn_passes=3 if vision_trains else 1,
    )


def _forward_flops(module: torch.nn.Module, expert_share: float) -> float:
    """Forward FLOPs per token of `module`'s weights: 2 per linear weight, its routed experts'
    weights by the share of experts a token reaches."""
    dense = sum(2 * m.weight.numel() for n, m in module.named_modules()
                if isinstance(m, torch.nn.Linear) and not routed_expert(n))
    experts = sum(2 * m.weight.numel() for n, m in module.named_modules()
                  if isinstance(m, torch.nn.Linear) and routed_expert(n))
    experts += sum(2 * p.numel() for n, p in module.named_parameters()
                   if routed_expert(n) and p.ndim == 3)
    return dense + experts * expert_share


def peak_flops(device: torch.device) -> float | None:
    """bf16 dense peak FLOP/s of `device`, or None when unknown (CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tf in PEAK_TFLOPS.items():
        if key in name:
            return tf * 1e12
    return None
