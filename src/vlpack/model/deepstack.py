"""Qwen3-VL's deepstack merge without a host sync per layer.

Qwen3-VL adds features of three vision blocks to the hidden states of the first three text
layers, at the image-token positions. transformers selects those positions with a boolean mask
(`hidden[mask] = hidden[mask] + embeds`); each boolean index makes the host wait for the GPU:
on the H200, 2 waits per layer in forward and 3 in backward, 15 per qwen3-vl-2b step
(docs/benchmarks.md, host synchronisations). Inside vlpack's packed forward the merge instead
turns the mask into an index tensor once per forward (one wait; the three layers receive the
same mask object) and uses `index_add`, whose backward gathers without waiting. Each position
still gets exactly one addition, so the result is bitwise the same.

Outside `indexed()` (stock models, the unpacked reference) the stock method runs.

Legend: T = tokens of the row (batch × sequence, flattened), H = hidden size, N = image tokens.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import nn

from vlpack.model.bounds import derived

_ACTIVE = contextvars.ContextVar("vlpack_deepstack_indexed", default=False)
_INDEX: dict = {}


@contextlib.contextmanager
def indexed() -> Iterator[None]:
    """Within this block, models with `install_deepstack` merge by index."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def mask_index(mask: torch.Tensor) -> torch.Tensor:
    """`mask.flatten().nonzero()` as a 1-D index, once per mask object while it is alive and
    unmodified (one host sync)."""
    return derived(_INDEX, mask, lambda: torch.nonzero(mask.reshape(-1)).squeeze(1))


def _deepstack_process(self, hidden_states, visual_pos_masks, visual_embeds):
    if not _ACTIVE.get():
        return type(self)._deepstack_process(self, hidden_states, visual_pos_masks, visual_embeds)
    idx_N = mask_index(visual_pos_masks.to(hidden_states.device))
    embeds_NH = visual_embeds.to(hidden_states.device, hidden_states.dtype)
    h_TH = hidden_states.reshape(-1, hidden_states.shape[-1])
    return h_TH.index_add(0, idx_N, embeds_NH).view(hidden_states.shape)


def install_deepstack(model: nn.Module) -> int:
    """Give every module of `model` with a deepstack merge the indexed one; returns how many."""
    n = 0
    for m in model.modules():
        if hasattr(type(m), "_deepstack_process") and "_deepstack_process" not in m.__dict__:
            m._deepstack_process = _deepstack_process.__get__(m)
            n += 1
    return n
