"""`vlpack check`'s view of the vision tower: its output features, and a self-test of what it can see.

The features the tower hands the language model (merged tokens, and Qwen3-VL's and Qwen3.5's
deepstack levels) are compared item by item, packed row against the stock tower on each
sample alone. A vision position error moves them far more than it moves the logits: with the
small random weights of a tiny model the vision attention is nearly uniform, so a wrong
rotary position shifts the features by ~5e-5 of their scale and the logits by less than
their fp32 tolerance (measured in docs/model.md).

`position_sensitivity` proves the comparison can see that class of bug on the check's own
samples and weights: it runs the stock tower on the row's visuals with the rotary positions
perturbed (all zero; h and w swapped) and reports the smallest shift; the check fails when
that shift is not `SENSITIVITY` times the tolerance.

Legend: P = patches, M = merged tokens of one item, C = feature channels (merged + deepstack).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from vlpack.data.types import TOKEN_TYPE_IMAGE, EncodedSample

VISION_TOL = 2e-6
"""Largest |Δ feature| of an item, relative to the item's largest |feature|, between the packed
row and the stock tower (fp32). Clean fp32 rounding on the tiny presets: ≤ 1e-7 (docs/model.md)."""
SENSITIVITY = 10.0
"""The self-test's perturbed positions must move the features by at least this × `VISION_TOL`."""


def _whole(x) -> torch.Tensor:
    """Per-item tensors (transformers 5.24) or one tensor, as one [M_total, C] tensor."""
    return torch.cat(list(x), 0) if isinstance(x, list | tuple) else x


def tower_features(out) -> torch.Tensor:
    """The tower's output as one [M_total, C] float32 tensor: the merged tokens and, where the
    family has them, its deepstack levels side by side."""
    if isinstance(out, torch.Tensor):
        return out.detach().float()
    parts = [_whole(out.pooler_output), *(_whole(f) for f in
                                          (getattr(out, "deepstack_features", None) or []))]
    return torch.cat(parts, -1).detach().float()


def _items(feats_MC: torch.Tensor, grid: torch.Tensor, merge: int) -> list[torch.Tensor]:
    """`feats_MC` split into its items by their (t, h, w) grids."""
    sizes = [int(t * h * w) // merge**2 for t, h, w in grid.tolist()]
    return list(feats_MC.cpu().split(sizes, 0))


class VisionCapture:
    """Records every call of the vision tower inside the block: (grids [I, 3], its items'
    features [M, C] each)."""

    def __init__(self, model: nn.Module, merge: int) -> None:
        self.tower = model.model.visual
        self.merge = merge
        self.calls: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

    def _hook(self, module, args, kwargs, out) -> None:
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        grid = grid.detach().cpu().reshape(-1, 3)
        self.calls.append((grid, _items(tower_features(out), grid, self.merge)))

    def __enter__(self) -> VisionCapture:
        self._handle = self.tower.register_forward_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def packed_items(calls: list, samples: list[EncodedSample]) -> list[list[torch.Tensor]]:
    """Per sample, its items' features from the packed row's tower call(s), in row order."""
    flat = [f for _, items in calls for f in items]
    out, at = [], 0
    for s in samples:
        n = len(s.image_grid_thw)
        out.append(flat[at:at + n])
        at += n
    return out


def reference_items(calls: list, s: EncodedSample) -> list[torch.Tensor]:
    """One sample's items' features, in its own order, from the stock calls of its unpacked
    forward (transformers encodes its images, then its videos)."""
    flat = [f for _, items in calls for f in items]
    kinds = s.visual_kinds
    order = [*np.flatnonzero(kinds == TOKEN_TYPE_IMAGE), *np.flatnonzero(kinds != TOKEN_TYPE_IMAGE)]
    out: list[torch.Tensor | None] = [None] * len(order)
    for i, f in zip(order, flat, strict=False):
        out[int(i)] = f
    return out


def relative_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """‖a − b‖ / ‖b‖ (a position error moves every token; rounding, a few elements); inf
    when the shapes differ or either is missing."""
    if a is None or b is None or a.shape != b.shape:
        return float("inf")
    return float((a - b).double().norm()) / max(float(b.double().norm()), 1e-30)


def compare_items(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> list[float]:
    """Per sample, the largest `relative_diff` of its items (0.0 for a sample without any)."""
    out = []
    for xs, ys in zip(a, b, strict=True):
        if len(xs) != len(ys):
            out.append(float("inf"))
            continue
        out.append(max((relative_diff(x, y) for x, y in zip(xs, ys, strict=True)), default=0.0))
    return out


def failures(label: str, diffs: list[float], keys: list[str]) -> list[str]:
    """One line per sample whose features moved past `VISION_TOL`."""
    return [f"{label}: vision features of sample {k!r} differ from the stock tower's by {d:.2e} "
            f"of their scale > {VISION_TOL:.0e}: the vision boundaries or positions vlpack "
            "hands the tower (vision.py `vision_tables`, `VisionTower`) are not this row's"
            for k, d in zip(keys, diffs, strict=True) if d > VISION_TOL]


def _perturbations(position_ids_P2: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"zeroed": torch.zeros_like(position_ids_P2),
            "h and w swapped": position_ids_P2.flip(-1)}


def position_sensitivity(model: nn.Module, samples: list[EncodedSample], merge: int) -> dict:
    """The stock tower on all visual items of `samples` (no gradients), then again with each
    perturbation of its rotary position ids: per perturbation the largest `relative_diff` of
    an item, and `min` over the perturbations. Empty when no sample has visuals."""
    from transformers import vision_utils as vu

    with_pixels = [s for s in samples if s.pixel_values is not None and len(s.image_grid_thw)]
    if not with_pixels:
        return {}
    tower = model.model.visual
    dev = next(model.parameters()).device
    pixels = torch.from_numpy(np.concatenate([s.pixel_values for s in with_pixels])).to(dev)
    grid = torch.from_numpy(np.concatenate([s.image_grid_thw for s in with_pixels]))
    grid_dev = grid.to(dev)

    def run(**kw) -> list[torch.Tensor]:
        with torch.no_grad():
            return _items(tower_features(tower(pixels, grid_thw=grid_dev, **kw)), grid, merge)

    base = run()
    pos = vu.get_vision_position_ids(grid, tower.spatial_merge_size).to(dev)
    out = {name: max(relative_diff(x, y) for x, y in zip(run(position_ids=p), base, strict=True))
           for name, p in _perturbations(pos).items()}
    out["min"] = min(out.values())
    return out


def sensitivity_failures(sens: dict) -> list[str]:
    """A line when the self-test's smallest shift is below `SENSITIVITY` × `VISION_TOL`: a
    failure on the check's synthetic samples, a warning on `--data` samples (images with
    large flat areas, such as receipts, barely depend on position on a small random model)."""
    if not sens or sens["min"] >= SENSITIVITY * VISION_TOL:
        return []
    worst = min((k for k in sens if k != "min"), key=sens.__getitem__)
    return [f"vision position self-test: the stock tower's rotary positions {worst} move its "
            f"features by only {sens['min']:.2e} of their scale (< {SENSITIVITY:.0f} × "
            f"{VISION_TOL:.0e}): on these samples and weights the check cannot see a vision "
            "position error; run it on its synthetic samples (no --data) or trained weights"]
