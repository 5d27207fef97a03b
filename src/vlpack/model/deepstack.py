"""Qwen3-VL's deepstack merge without a host sync per layer.

Qwen3-VL adds features of three vision blocks to the hidden states of the first three text
layers, at the image-token positions. transformers selects those positions with a boolean mask
(`hidden[mask] = hidden[mask] + embeds`); each boolean index makes the host wait for the GPU,
2 waits per layer in forward and 3 in backward. `DeepstackTextModel`, a subclass of the text
model installed by class at build time (seams.py), takes the positions from the forward's
`Boundaries` instead (`image_index`, made on the host from the batch) and merges with
`index_add`, whose backward gathers without waiting. Each position still gets exactly one
addition, so the result is bitwise the same. Without Boundaries the stock merge runs.

Legend: T = tokens of the row (batch × sequence, flattened), H = hidden size, N = image tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from vlpack.model.bounds import BOUNDS_KWARG


class DeepstackTextModel(nn.Module):
    """Mixin for a text model class with a deepstack merge: the merge by index."""

    def forward(self, *args, visual_pos_masks=None, **kwargs):
        bounds = kwargs.get(BOUNDS_KWARG)
        if visual_pos_masks is not None and bounds is not None and bounds.image_index is not None:
            visual_pos_masks = _Index(bounds.image_index)
        return super().forward(*args, visual_pos_masks=visual_pos_masks, **kwargs)

    def _deepstack_process(self, hidden_states, visual_pos_masks, visual_embeds):
        if not isinstance(visual_pos_masks, _Index):
            return super()._deepstack_process(hidden_states, visual_pos_masks, visual_embeds)
        idx_N = visual_pos_masks.index_N.to(hidden_states.device)
        embeds_NH = visual_embeds.to(hidden_states.device, hidden_states.dtype)
        h_TH = hidden_states.reshape(-1, hidden_states.shape[-1])
        return h_TH.index_add(0, idx_N, embeds_NH).view(hidden_states.shape)


class _Index:
    """The image-token positions, standing in for the boolean mask in the stock call."""

    __slots__ = ("index_N",)

    def __init__(self, index_N: torch.Tensor) -> None:
        self.index_N = index_N
