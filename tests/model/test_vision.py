"""Host metadata for the model, no device syncs: the vision tower's tables computed on the host
(`vlpack.model.vision.vision_tables`) reach the tower's helpers and are bitwise its own in every
family; the text boundaries and the deepstack positions come from the batch's host fields."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from tests.helpers import make_sample
from vlpack.data.batch import build_thd_batch
from vlpack.model import attention, vision
from vlpack.model.bounds import BOUNDS_KWARG
from vlpack.model.build import build_model
from vlpack.model.forward import packed_forward, packed_model_inputs
from vlpack.model.synthetic import default_mix

FAMILIES = ["tiny-qwen2_vl", "tiny-qwen2_5_vl", "tiny-qwen3_vl", "tiny-qwen3_vl_moe",
            "tiny-qwen3_5", "tiny-qwen3_5_moe"]
HELPERS = {  # transformers.vision_utils helper -> the kwargs keys it takes precomputed values from
    "get_vision_position_ids": ("position_ids",),
    "get_vision_interpolation_indices_and_weights": ("interp_indices", "interp_weights"),
    "get_vision_attention_seqlens": ("cu_seqlens", "max_seqlen"),
    "get_vision_window_index": ("window_index", "cu_window_seqlens"),
}


def _batch(spec):
    rng = np.random.default_rng(0)
    rows = [make_sample("a", rng, text=(6, 12), grids=((1, 4, 4),), patch_dim=spec.patch_dim,
                        spec=spec),
            make_sample("b", rng, text=(5, 3, 7), grids=((1, 4, 6), (1, 2, 2)),
                        patch_dim=spec.patch_dim, spec=spec)]
    return build_thd_batch(rows, pad_token_id=spec.pad_token_id,
                           spatial_merge_size=spec.merge_size,
                                   pad_to_multiple_of=1, mrope_after_video="transformers")


def _stock_tables(model, batch):
    """The tables the stock tower computes from the (device) grid, by its own helpers."""
    tower = model.model.visual
    module_globals = inspect.unwrap(type(tower)._vlpack_stock.forward).__globals__
    return {name: fn for name, fn in module_globals.items() if name in HELPERS}


@pytest.mark.parametrize("name", FAMILIES)
def test_host_tables_equal_the_towers_own_and_reach_its_helpers(name, monkeypatch):
    """Every helper the tower calls finds its table already in its kwargs, equal to what the
    helper computes from the grid itself; loss and gradients are bitwise those of the stock
    tower (the unpatched class)."""
    model, spec = build_model(name, dtype=torch.float32, device="cpu", seed=0)
    batch = _batch(spec)
    helpers = _stock_tables(model, batch)
    assert helpers, "the tower calls none of transformers' vision helpers"
    handed = []
    module_globals = inspect.unwrap(type(model.model.visual)._vlpack_stock.forward).__globals__
    for helper, fn in helpers.items():
        def spy(grid_thw, *args, kwargs=None, _fn=fn, _keys=HELPERS[helper], **kw):
            if kwargs is not None:  # the tower's own call: compare with its own computation
                mine = {k: kwargs[k] for k in _keys if k in kwargs}
                own = _fn(grid_thw, *args, **kw)
                own = own if isinstance(own, tuple) else (own,)
                handed.append(len(mine) == len(_keys) and all(
                    (torch.equal(a, b) if isinstance(a, torch.Tensor) else b is None or a == b)
                    for a, b in zip(mine.values(), own, strict=True)))
            return _fn(grid_thw, *args, kwargs=kwargs, **kw)

        monkeypatch.setitem(module_globals, helper, spy)
    model.zero_grad()
    out = packed_forward(model, batch, spec=spec)
    out.loss_sum.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert handed and all(handed), handed
    assert out.paths["vision.tables"] == "host"
    monkeypatch.undo()

    stock, _ = build_model(name, dtype=torch.float32, device="cpu", seed=0)
    for m in stock.model.visual.modules():  # transformers' own tower and vision attention
        m.__class__ = getattr(type(m), "_vlpack_stock", type(m))
    stock.zero_grad()
    ref = packed_forward(stock, batch, spec=spec)
    ref.loss_sum.backward()
    assert "vision.tables" not in ref.paths
    assert torch.equal(out.loss_sum, ref.loss_sum)
    ref_grads = [p.grad for p in stock.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


def test_text_boundaries_and_image_positions_come_from_the_host(monkeypatch):
    """The batch brings cu_seqlens_padded and the image-token positions as Python ints: building
    the forward's Boundaries reads nothing back from a tensor (a device sync on a GPU)."""
    model, spec = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu", seed=0)
    batch = _batch(spec)
    assert batch.padded_bounds == tuple(batch.cu_seqlens_padded.tolist())
    want = torch.nonzero(batch.input_ids == spec.image_token_id).squeeze(1)
    for t in (batch.input_ids, batch.cu_seqlens_padded, batch.image_grid_thw,
              batch.mm_token_type_ids, batch.vision_cu_seqlens):
        t.vlpack_device = True  # stands for a tensor on the GPU
    real = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "nonzero")}

    def guarded(name):
        def call(self, *args, **kwargs):
            assert not getattr(self, "vlpack_device", False), f"a batch tensor was read: {name}"
            return real[name](self, *args, **kwargs)
        return call

    for name in real:
        monkeypatch.setattr(torch.Tensor, name, guarded(name))
    bounds = packed_model_inputs(model, batch, spec)[BOUNDS_KWARG]
    monkeypatch.undo()
    assert bounds.text.host == batch.padded_bounds
    assert torch.equal(bounds.text.cu, batch.cu_seqlens_padded)
    assert torch.equal(bounds.image_index, want)  # the deepstack merge's positions
    assert bounds.vision.full.host == tuple(batch.vision_cu_seqlens.tolist())


@pytest.mark.parametrize("name", ["tiny-qwen2_vl", "tiny-qwen3_vl"])
def test_tables_on_the_device_are_never_read_back(name, monkeypatch):
    """The tables as a GPU would get them (copies of the host tables, here clones): the tower and
    the vision attention use them without reading any back, and the result is the host run's."""
    model, spec = build_model(name, dtype=torch.float32, device="cpu", seed=0)
    batch = _batch(spec)
    want = packed_forward(model, batch, spec=spec).loss_sum
    copies = []
    real = vision.to_device

    def to_device(value, device):
        copy = real(value, device).clone()
        copy.vlpack_device_copy = True  # marks the object itself
        copies.append(copy)
        return copy

    tolist = torch.Tensor.tolist

    def guarded_tolist(self):
        assert not getattr(self, "vlpack_device_copy", False), "a device table was read back"
        return tolist(self)

    monkeypatch.setattr(vision, "to_device", to_device)
    monkeypatch.setattr(torch.Tensor, "tolist", guarded_tolist)
    got = packed_forward(model, batch, spec=spec)
    assert copies and got.paths["vision.tables"] == "host"
    assert torch.equal(got.loss_sum, want)


@pytest.mark.parametrize("name", ["tiny-qwen3_vl", "tiny-qwen2_5_vl"])
def test_vision_tower_one_call_per_layer_with_the_rows_boundaries(name, monkeypatch):
    """In a packed forward each vision layer makes one attention call over all images of the
    row, with the per-image (or, in Qwen2.5-VL's windowed layers, per-window) boundaries;
    the text cu kwargs handed to the tower change nothing."""
    model, spec = build_model(name, device="cpu")
    samples = default_mix(spec, 4, seed=0)
    batch = build_thd_batch(samples, pad_token_id=spec.pad_token_id, pad_to_multiple_of=8,
                            spatial_merge_size=spec.merge_size, mrope_after_video="transformers")
    calls = []
    real = attention.attend

    def spy(name_, q, k, v, segs, **kw):
        calls.append((kw["stream"], segs.host))
        return real(name_, q, k, v, segs, **kw)

    monkeypatch.setattr(attention, "attend", spy)
    with torch.no_grad():
        out = packed_forward(model, batch, spec=spec, return_hidden=True)
    vision = [c for s, c in calls if s == "vision"]
    assert len(vision) == model.config.vision_config.depth
    assert tuple(batch.vision_cu_seqlens.tolist()) in vision
    if spec.family == "qwen2_5_vl":  # windowed layers see finer (window) boundaries
        assert any(len(c) > len(batch.vision_cu_seqlens) for c in vision)
    inputs = packed_model_inputs(model, batch, spec)
    with torch.no_grad():  # without the text kwargs (the tower drops them): the same features
        img = model.model.get_image_features(batch.pixel_values, batch.image_grid_thw,
                                             vlpack_bounds=inputs["vlpack_bounds"])
        dirty = model.model.get_image_features(batch.pixel_values, batch.image_grid_thw,
                                               **{k: v for k, v in inputs.items()
                                                  if k.startswith(("cu_", "max_", "vlpack"))})
    get = (lambda o: o.pooler_output) if hasattr(img, "pooler_output") else (lambda o: o)
    assert all(torch.equal(a, b) for a, b in zip(get(img), get(dirty), strict=True))
    assert torch.isfinite(out.hidden).all()
