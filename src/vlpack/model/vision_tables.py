"""The vision tower's per-patch tables from the host: no device sync before its first block.

At the start of every forward, transformers' vision towers derive tables from `grid_thw` with
the helpers of `transformers.vision_utils`: rotary position ids, the position-embedding
interpolation taps (Qwen3-VL, Qwen3.5) and `cu_seqlens`. On a GPU grid each helper makes the
host wait for the GPU (12 of the 20 host syncs of a qwen3-vl-2b step on the H200,
docs/benchmarks.md). Each helper returns a precomputed value instead when the tower's kwargs
carry it, and the batch brings its grids as Python ints. So inside `packed_forward`
(`supplied(batch)`) the wrapped tower forward computes the tables on the host, copies them from
pinned memory without blocking, and hands them over.

Nothing here restates how a tower calls its helpers. The first forward of each tower runs stock
and records each helper's arguments and result (the helpers are globals of the tower's modeling
module, replaced for that one call). The recorded call, repeated on the host grid, must give the
recorded result exactly (one sync, once per tower); if it does not, or raises, the tower stays
stock, with a warning. Towers whose helpers are not in `_HELPERS` (Qwen2.5-VL's window index)
keep computing those on the device.

Outside `supplied` (stock models, the unpacked reference, a rank's blank image) the stock forward
runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import threading
from collections.abc import Iterator

import torch
from torch import nn

from vlpack.model.bounds import seed_host_bounds

logger = logging.getLogger(__name__)

_HELPERS = {  # transformers.vision_utils helper -> the kwargs keys it takes precomputed values from
    "get_vision_position_ids": ("position_ids",),
    "get_vision_interpolation_indices_and_weights": ("interp_indices", "interp_weights"),
    "get_vision_attention_seqlens": ("cu_seqlens", "max_seqlen"),
}
_GRIDS = contextvars.ContextVar("vlpack_vision_grids", default=None)
_RECORDING = threading.Lock()  # the helpers are module globals: one recording at a time
PATHS_USED: dict[str, str] = {}


@contextlib.contextmanager
def supplied(grid_thw: torch.Tensor | None, grids: tuple) -> Iterator[None]:
    """Within this block a wrapped tower called with this `grid_thw` tensor takes its tables from
    `grids` (the same (t, h, w) rows as Python ints)."""
    usable = grid_thw is not None and len(grids) == grid_thw.shape[0] > 0
    token = _GRIDS.set((grid_thw, grids) if usable else None)
    try:
        yield
    finally:
        _GRIDS.reset(token)


def install_vision_tables(model: nn.Module) -> bool:
    """Wrap the forward of the vision tower (`model.model.visual`) if it calls any helper."""
    visual = getattr(getattr(model, "model", None), "visual", None)
    if visual is None or "forward" in visual.__dict__ or not _helpers(type(visual)):
        return False
    visual.forward = _forward.__get__(visual)
    return True


def _helpers(cls: type) -> tuple[str, ...]:
    """The helpers the tower's forward calls (names it reads that are its module's functions)."""
    forward = inspect.unwrap(cls.forward)
    return tuple(h for h in _HELPERS
                 if h in forward.__code__.co_names and callable(forward.__globals__.get(h)))


def _forward(self, hidden_states, grid_thw=None, **kwargs):
    stock = type(self).forward
    ctx = _GRIDS.get()
    if ctx is None or ctx[0] is not grid_thw:
        return stock(self, hidden_states, grid_thw, **kwargs)
    recipe = self.__dict__.get("_vlpack_tables")
    if recipe is None:
        out, calls = _recorded(self, lambda: stock(self, hidden_states, grid_thw, **kwargs))
        self._vlpack_tables = _checked(type(self).__name__, calls, ctx[1])
        PATHS_USED["tables"] = ("device, recorded: host from the next forward"
                                if self._vlpack_tables else "device (stock)")
        return out
    if recipe:
        kwargs.update(_host_tables(recipe, ctx[1], grid_thw.device))
        PATHS_USED["tables"] = "host"
    return stock(self, hidden_states, grid_thw, **kwargs)


def _recorded(self, run) -> tuple[object, dict]:
    """Run the stock forward with its helpers recording (arguments after the grid, result)."""
    names = _helpers(type(self))
    module_globals = inspect.unwrap(type(self).forward).__globals__
    calls: dict = {}

    def recorder(name, fn):
        def call(grid_thw, *args, kwargs=None, **kw):
            out = fn(grid_thw, *args, kwargs=kwargs, **kw)
            if kwargs is not None:  # a helper given no kwargs could not take a table from them
                calls[name] = (fn, args, kw, out)
            return out
        return call

    with _RECORDING:
        saved = {name: module_globals[name] for name in names}
        try:
            module_globals.update({name: recorder(name, fn) for name, fn in saved.items()})
            return run(), calls
        finally:
            module_globals.update(saved)


def _checked(tower: str, calls: dict, grids: tuple) -> dict | bool:
    """The recorded calls, if repeating them on the host grid gives the recorded results. Calls
    with a tensor argument besides the grid (a per-image value) are not replayed."""
    if any(isinstance(a, torch.Tensor) for _, args, kw, _ in calls.values()
           for a in (*args, *kw.values())):
        logger.warning("vlpack: %s passes tensors to its vision helpers; its vision tables stay "
                       "on the device", tower)
        return False
    try:
        grid = _host_grid(grids)
        same = all(_equal(fn(grid, *args, **kw), out) for fn, args, kw, out in calls.values())
    except Exception as e:  # any failure means: stay stock
        logger.warning("vlpack: %s's vision tables stay on the device (%s: %s)", tower,
                       type(e).__name__, e)
        return False
    if not same:
        logger.warning("vlpack: %s's vision tables computed on the host differ from its own; "
                       "they stay on the device", tower)
        return False
    return {name: (fn, args, kw) for name, (fn, args, kw, _) in calls.items()}


def _host_grid(grids: tuple) -> torch.Tensor:
    return torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)


def _equal(a, b) -> bool:
    if isinstance(a, tuple) or isinstance(b, tuple):
        return (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b)
                and all(_equal(x, y) for x, y in zip(a, b, strict=True)))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and torch.equal(a, b.to(a.device)))
    return a == b


def _host_tables(recipe: dict, grids: tuple, device: torch.device) -> dict:
    """The tower's kwargs: each recorded helper repeated on the host grid, moved to `device`."""
    grid = _host_grid(grids)
    host = {}
    for name, (fn, args, kw) in recipe.items():
        out = fn(grid, *args, **kw)
        for key, value in zip(_HELPERS[name], out if isinstance(out, tuple) else (out,),
                              strict=True):
            if value is not None:
                host[key] = value
    tables = {key: _to(value, device) for key, value in host.items()}
    if isinstance(cu := tables.get("cu_seqlens"), torch.Tensor) and cu is not host["cu_seqlens"]:
        # the vision attention's host copy of these boundaries, known without asking the device
        seed_host_bounds(cu, tuple(host["cu_seqlens"].tolist()))
    return tables


def _to(value, device: torch.device):
    if not isinstance(value, torch.Tensor) or device.type == "cpu":
        return value
    return value.pin_memory().to(device, non_blocking=True)
