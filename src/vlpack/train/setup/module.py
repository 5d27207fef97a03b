"""The trainable root module: one forward per micro-batch, packed or padded.

Wrapping the HF model lets FSDP2 shard it as a single root (the packed forward calls the base
model and the lm_head separately, so the root's pre-forward hook must sit above both).
"""

from __future__ import annotations

import torch
from torch import nn

from vlpack.data.batch import ThdBatch
from vlpack.data.padded import PaddedBatch
from vlpack.model.build import ModelSpec
from vlpack.model.forward import ForwardOut, packed_forward
from vlpack.model.padded import padded_forward


def module_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Parameters by group: `vision` (tower without merger), `merger`, `llm` (incl. lm_head)."""
    visual = model.model.visual
    merger_ids = {
        id(p)
        for name, m in visual.named_children()
        if "merger" in name
        for p in m.parameters()
    }
    groups = {
        "vision": [p for p in visual.parameters() if id(p) not in merger_ids],
        "merger": [p for p in visual.parameters() if id(p) in merger_ids],
        "llm": list(model.model.language_model.parameters()),
    }
    seen = {id(p) for g in groups.values() for p in g}
    groups["llm"] += [p for p in model.lm_head.parameters() if id(p) not in seen]
    return groups


def freeze(model: nn.Module, *, vision: bool, merger: bool, llm: bool) -> None:
    """Turn off gradients of the chosen groups."""
    groups = module_groups(model)
    for name, frozen in (("vision", vision), ("merger", merger), ("llm", llm)):
        for p in groups[name] if frozen else []:
            p.requires_grad_(False)


def _tensors(obj) -> list[torch.Tensor]:
    """All tensors in a nested output (tensor, tuple/list, dict or ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list | tuple):
        return [t for x in obj for t in _tensors(x)]
    return []


def _has(pixels: torch.Tensor | None, grid: torch.Tensor | None) -> int:
    """1 when a micro-batch's image (or video) stream holds at least one item, else 0."""
    return int(pixels is not None and grid is not None and grid.shape[0] > 0)


class TrainModule(nn.Module):
    """forward(batch) → ForwardOut for a ThdBatch (packed) or a PaddedBatch (baseline)."""

    def __init__(self, model: nn.Module, spec: ModelSpec, *, touch_vision: bool = False,
                 loss_method: str = "auto", context=None):
        super().__init__()
        self.model = model
        self.spec = spec
        self.touch_vision = touch_vision
        self.loss_method = loss_method
        self.context = context  # a ContextGroup: packed rows split over its ranks

    def _dummy_vision(self) -> torch.Tensor:
        """Run the vision tower on one tiny blank image and return 0 × its output.

        Under FSDP every rank must run the same blocks in the same order; a rank whose bin has
        no image would otherwise skip the vision blocks and hang the others' all-gathers.
        """
        m = self.spec.merge_size
        device = self.model.lm_head.weight.device
        grid = torch.tensor([[1, m, m]], device=device)
        pixels = torch.zeros(m * m, self.spec.patch_dim, device=device)
        out = self.model.model.visual(pixels, grid_thw=grid)
        # Touch every output (deepstack features too) so every parameter gets a gradient, as
        # on the ranks that saw real images: FSDP reduces the same tensors everywhere.
        return sum(x.float().sum() for x in _tensors(out)) * 0.0

    def forward(self, batch: ThdBatch | PaddedBatch, token_weights=None) -> ForwardOut:
        """Loss of one micro-batch: summed CE (weighted per token when `token_weights`).

        With `touch_vision` (several FSDP ranks) every micro-batch runs the vision tower the
        same number of times on every rank, blank images making up the difference: once for a
        packed row (its images and videos are one stream), twice for a padded batch (the stock
        forward encodes its images and its videos in separate calls)."""
        zero = None
        if self.touch_vision:
            runs = _has(batch.pixel_values, batch.image_grid_thw)
            if isinstance(batch, PaddedBatch):
                runs += _has(batch.pixel_values_videos, batch.video_grid_thw)
            for _ in range((1 if isinstance(batch, ThdBatch) else 2) - runs):
                dummy = self._dummy_vision()
                zero = dummy if zero is None else zero + dummy
        if isinstance(batch, ThdBatch):
            out = packed_forward(self.model, batch, spec=self.spec, loss_method=self.loss_method,
                                 token_weights=token_weights, context=self.context)
        else:
            out = padded_forward(self.model, batch, spec=self.spec, loss_method=self.loss_method,
                                 token_weights=token_weights)
        if zero is not None:
            out.loss_sum = out.loss_sum + zero
        return out
