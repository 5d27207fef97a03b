"""Host metadata for the model, no device syncs: the vision tower's tables computed on the host
(`vlpack.model.vision_tables`), the same as the tower's own in every family; the text boundaries."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from tests.helpers import make_sample
from vlpack.data.batch import build_thd_batch
from vlpack.model import vision_tables
from vlpack.model.build import build_model
from vlpack.model.forward import packed_forward

FAMILIES = ["tiny-qwen2_vl", "tiny-qwen2_5_vl", "tiny-qwen3_vl", "tiny-qwen3_vl_moe",
            "tiny-qwen3_5", "tiny-qwen3_5_moe"]


def _batch(spec):
    rng = np.random.default_rng(0)
    rows = [make_sample("a", rng, text=(6, 12), grids=((1, 4, 4),), patch_dim=spec.patch_dim,
                        spec=spec),
            make_sample("b", rng, text=(5, 3, 7), grids=((1, 4, 6), (1, 2, 2)),
                        patch_dim=spec.patch_dim, spec=spec)]
    return build_thd_batch(rows, pad_token_id=spec.pad_token_id,
                           spatial_merge_size=spec.merge_size)


def _loss_and_grads(model, spec, batch):
    model.zero_grad()
    out = packed_forward(model, batch, spec=spec)
    out.loss_sum.backward()
    return out, [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("name", FAMILIES)
def test_host_tables_reach_the_helpers_and_change_nothing(name, monkeypatch):
    """After the first (recording) forward, the tower's helpers find every table they compute
    already in their kwargs; loss and gradients stay bitwise those of the stock tower."""
    model, spec = build_model(name, dtype=torch.float32, device="cpu", seed=0)
    stock, _ = build_model(name, dtype=torch.float32, device="cpu", seed=0)
    del stock.model.visual.forward  # the stock tower
    batch = _batch(spec)
    visual = model.model.visual
    module_globals = inspect.unwrap(type(visual).forward).__globals__
    handed = []
    for helper, keys in vision_tables._HELPERS.items():
        if helper in module_globals:
            fn = module_globals[helper]

            def spy(grid_thw, *args, kwargs=None, _fn=fn, _keys=keys, **kw):
                if kwargs is not None:  # the tower's own call
                    handed.append(all(k in kwargs for k in _keys if k != "max_seqlen"))
                return _fn(grid_thw, *args, kwargs=kwargs, **kw)

            monkeypatch.setitem(module_globals, helper, spy)

    first, _ = _loss_and_grads(model, spec, batch)  # records
    assert visual._vlpack_tables, "the host tables did not check out"
    handed.clear()
    out, grads = _loss_and_grads(model, spec, batch)
    assert handed and all(handed), handed
    assert out.paths["vision.tables"] == "host"
    ref, ref_grads = _loss_and_grads(stock, spec, batch)
    assert torch.equal(out.loss_sum, ref.loss_sum) and torch.equal(first.loss_sum, ref.loss_sum)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


def test_tables_that_differ_keep_the_tower_stock(monkeypatch, caplog):
    """A recorded helper that gives another result on the host grid leaves the tower stock."""
    model, spec = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu", seed=0)
    batch = _batch(spec)
    real = vision_tables._host_grid
    monkeypatch.setattr(vision_tables, "_host_grid", lambda grids: real(grids) * 2)
    packed_forward(model, batch, spec=spec)
    assert model.model.visual._vlpack_tables is False
    assert "differ" in caplog.text
    out = packed_forward(model, batch, spec=spec)
    assert out.paths["vision.tables"] == "device (stock)"


def test_text_boundaries_reach_the_layers_from_the_host(monkeypatch):
    """The batch brings cu_seqlens_padded as Python ints (`padded_bounds`): the layers' host copy
    of the boundaries then costs no read-back from the tensor (a device sync on a GPU)."""
    from vlpack.model.bounds import host_bounds
    from vlpack.model.forward import packed_model_inputs

    _, spec = build_model("tiny-qwen3_vl", dtype=torch.float32, device="meta", seed=0)
    batch = _batch(spec)
    assert batch.padded_bounds == tuple(batch.cu_seqlens_padded.tolist())
    cu = packed_model_inputs(batch)["cu_seq_lens_q"]

    def read_back(self):
        raise AssertionError("the boundaries were read back from the tensor")

    monkeypatch.setattr(torch.Tensor, "tolist", read_back)
    assert host_bounds(cu) == batch.padded_bounds


@pytest.mark.parametrize("name", ["tiny-qwen2_vl", "tiny-qwen3_vl"])
def test_tables_on_the_device_are_never_read_back(name, monkeypatch):
    """The tables as a GPU would get them (copies of the host tables, here clones): the tower and
    the vision attention use them without reading any back (`cu_seqlens`' host copy is the
    seeded one), and the result is the host run's."""
    model, spec = build_model(name, dtype=torch.float32, device="cpu", seed=0)
    batch = _batch(spec)
    want = packed_forward(model, batch, spec=spec).loss_sum  # records
    copies = []

    def to_device(value, device):
        if not isinstance(value, torch.Tensor):
            return value
        copy = value.clone()
        copy.vlpack_device_copy = True  # marks the object itself (ids get reused)
        copies.append(copy)
        return copy

    tolist = torch.Tensor.tolist

    def guarded_tolist(self):
        assert not getattr(self, "vlpack_device_copy", False), "a device table was read back"
        return tolist(self)

    monkeypatch.setattr(vision_tables, "_to", to_device)
    monkeypatch.setattr(torch.Tensor, "tolist", guarded_tolist)
    got = packed_forward(model, batch, spec=spec)
    assert copies and got.paths["vision.tables"] == "host"
    assert torch.equal(got.loss_sum, want)
