"""The padded baseline forward: right-padded [B, L] batches through stock transformers, the
usual way (2-D attention mask, positions from the model's own get_rope_index).

It shares the loss and MoE statistics code with the packed path, so a comparison of the two
measures packing alone. Use an attention backend that honours the 2-D mask (sdpa).

Legend: B = samples, L = longest sample, H = hidden size.
"""

from __future__ import annotations

from torch import nn

from vlpack.data.padded import PaddedBatch
from vlpack.model import loss
from vlpack.model.build import ModelSpec
from vlpack.model.forward import ForwardOut, stock_visuals
from vlpack.model.moe import RouterCapture, router_stats


def padded_forward(
    model: nn.Module,
    batch: PaddedBatch,
    *,
    spec: ModelSpec,
    loss_method: str = "auto",
    token_weights=None,
) -> ForwardOut:
    """Forward a padded batch; loss summed over its label tokens (labels already shifted),
    weighted per token when `token_weights` [B·L] is given."""
    device = next(model.parameters()).device
    if batch.input_ids.device != device:
        batch = batch.to(device)
    visuals = stock_visuals(spec, pixel_values=batch.pixel_values,
                            image_grid_thw=batch.image_grid_thw,
                            pixel_values_videos=batch.pixel_values_videos,
                            video_grid_thw=batch.video_grid_thw,
                            second_per_grid_ts=batch.second_per_grid_ts)
    model.model.rope_deltas = None  # transformers caches it on the module across calls
    capture = RouterCapture(model) if spec.is_moe else None
    if capture is not None:
        capture.__enter__()
    try:
        out = model.model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            mm_token_type_ids=batch.mm_token_type_ids,
            use_cache=False,
            **visuals,
        )
    finally:
        if capture is not None:
            capture.__exit__()
    hidden_BLH = out.last_hidden_state
    loss_sum, n = loss.linear_ce_sum(
        hidden_BLH.reshape(-1, hidden_BLH.shape[-1]), model.lm_head, batch.labels.reshape(-1),
        method=loss_method,
        token_weight_T=None if token_weights is None else token_weights.to(hidden_BLH.device),
    )
    stats = None
    if capture is not None:
        real = batch.attention_mask.reshape(-1).bool()
        stats = router_stats(capture.logits, real, spec.num_experts, spec.num_experts_per_tok,
                             chosen=capture.indices)
    return ForwardOut(
        loss_sum=loss_sum, num_label_tokens=n,
        aux_loss=None if stats is None else stats.aux_loss, router_stats=stats,
    )
