"""Model FLOPs of a training step, for MFU.

FLOPs (forward + backward = 3 × forward, no recompute counted) of one batch:

  text   = 6 · N_text · T_real                     N_text: matmul params of the LLM touched per
                                                   token (MoE: attention + router + top-k experts
                                                   + shared expert), lm_head included
  vision = 6 · N_vis · P                           N_vis: matmul params of the vision tower and
                                                   merger, P: ViT patches
  attn   = 6 · 2 · d_attn · Σ_s L_s² / 2 · n_attn  causal text attention over each sample
                                                   (QKᵀ and AV: 2 matmuls of 2·d flops per pair),
                                                   n_attn = full-attention layers only
         + 6 · 2 · d_vis · Σ_f F_f² · depth         bidirectional vision attention per frame

MFU = FLOPs / (step time × peak). Gated-DeltaNet layers count as linear projections (their
recurrence is O(T·d_k·d_v), small next to the projections).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0}
"""Dense bf16 tensor-core peak per GPU (TFLOP/s)."""


@dataclass(frozen=True, slots=True)
class FlopModel:
    text_params: float
    vision_params: float
    text_attn_dim: int
    text_attn_layers: int
    vision_attn_dim: int
    vision_depth: int

    def batch_flops(self, seg_lengths: list[int], patches: int, frame_patches: list[int]) -> float:
        T = sum(seg_lengths)
        text = 6 * self.text_params * T
        vision = 6 * self.vision_params * patches
        attn = 6 * 2 * self.text_attn_dim * self.text_attn_layers * sum(n * n for n in seg_lengths) / 2
        attn += 6 * 2 * self.vision_attn_dim * self.vision_depth * sum(f * f for f in frame_patches)
        return text + vision + attn

    def of_batch(self, batch) -> float:
        """FLOPs of a ThdBatch or PaddedBatch (host tensors: no device sync)."""
        frames = [h * w for t, h, w in batch.image_grid_thw.tolist() for _ in range(t)]
        return self.batch_flops(batch.seq_lengths, sum(frames), frames)


def _matmul_params(module: torch.nn.Module) -> float:
    """Weights of the nn.Linear layers of `module`, MoE experts excluded."""
    return float(
        sum(
            m.weight.numel()
            for n, m in module.named_modules()
            if isinstance(m, torch.nn.Linear) and ".experts." not in n
        )
    )


def _expert_params(module: torch.nn.Module) -> float:
    """Weights of all MoE experts: fused 3-D expert tensors, or per-expert nn.Linear layers."""
    fused = sum(p.numel() for n, p in module.named_parameters() if ".experts." in n and p.ndim == 3)
    linear = sum(
        m.weight.numel()
        for n, m in module.named_modules()
        if isinstance(m, torch.nn.Linear) and ".experts." in n
    )
    return float(fused + linear)


def flop_model(model: torch.nn.Module) -> FlopModel:
    """Counts matmul parameters of a Qwen-VL `*ForConditionalGeneration` model."""
    cfg = model.config
    text_cfg = getattr(cfg, "text_config", cfg)
    vis_cfg = cfg.vision_config
    lm, visual = model.model.language_model, model.model.visual
    text = _matmul_params(lm) + model.lm_head.weight.numel()
    n_experts = getattr(text_cfg, "num_experts", 0) or 0
    if n_experts:  # only the top-k experts run for a token
        text += _expert_params(lm) * text_cfg.num_experts_per_tok / n_experts
    heads = text_cfg.num_attention_heads
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads
    layer_types = getattr(text_cfg, "layer_types", None)
    n_attn = (
        sum(t == "full_attention" for t in layer_types) if layer_types else text_cfg.num_hidden_layers
    )
    vis_hidden = getattr(vis_cfg, "hidden_size", None) or vis_cfg.embed_dim
    return FlopModel(
        text_params=text,
        vision_params=_matmul_params(visual),
        text_attn_dim=heads * head_dim,
        text_attn_layers=n_attn,
        vision_attn_dim=vis_hidden,
        vision_depth=vis_cfg.depth,
    )


def peak_flops(device: torch.device) -> float | None:
    """bf16 dense peak FLOP/s of `device`, or None when unknown (CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tf in PEAK_TFLOPS.items():
        if key in name:
            return tf * 1e12
    return None
