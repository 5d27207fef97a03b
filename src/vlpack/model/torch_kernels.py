"""transformers' pure-torch kernels of a modeling module, whatever is installed beside it.

transformers' Qwen3.5 modeling modules pick fla's or causal-conv1d's kernels where those
packages are importable, once, when the module is imported (`use_kernel_func_from_hub_with_
fallback`), and with the `kernels` package installed (transformers 5.25) each module-level kernel
name is a small `nn.Module` whose call goes to that pick. vlpack needs the torch kernels
themselves: as the exact reference of the packed Gated-DeltaNet path (float32, CPU) and in the
check's stock reference. `torch_kernel_module` executes a second instance of the modeling module
from its file while `KERNEL_PACKAGES` cannot be imported (None in `sys.modules` for that moment,
which makes their import fail), so every kernel name in it runs torch's code on any device.
transformers' own module and every name in it stay as they are.

Called on a GPU (fla's Hopper self-test compares fla with them), the copy's kernel wrappers log
transformers' "falling back to its reference PyTorch implementation because fla is not
installed" although fla is installed and runs the layers; `quiet_fallback` drops that warning
around such deliberate calls.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import sys
import types
from collections.abc import Callable, Iterator

from vlpack.families import TESTED_TRANSFORMERS

KERNEL_PACKAGES = ("fla", "causal_conv1d")
"""Packages whose kernels transformers' Qwen3.5 modeling modules pick at import when importable."""
FALLBACK_LOGGER = "transformers.integrations.hub_kernels"
"""The logger of transformers' kernel wrappers (`use_kernel_func_from_hub_with_fallback`)."""
FALLBACK_WARNING = "falling back to its reference PyTorch implementation"


class _DropFallback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return FALLBACK_WARNING not in record.getMessage()


@contextlib.contextmanager
def quiet_fallback() -> Iterator[None]:
    """Within the block, transformers' kernel wrappers' fallback warning is dropped (it is a
    `warning_once`: a dropped message counts as said for the rest of the process)."""
    log, drop = logging.getLogger(FALLBACK_LOGGER), _DropFallback()
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


@functools.cache
def torch_kernel_module(name: str) -> types.ModuleType:
    """A second instance of transformers' modeling module `name`, executed from its own file
    while `KERNEL_PACKAGES` cannot be imported, so that its kernel wrappers chose their torch
    functions; registered as `<package>._vlpack_torch_kernels_<module>` beside it (transformers'
    own module and every name in it stay as they are). Once per module and process."""
    package, leaf = name.rsplit(".", 1)
    alias = f"{package}._vlpack_torch_kernels_{leaf}"
    spec = importlib.util.spec_from_file_location(alias, sys.modules[name].__file__)
    module = importlib.util.module_from_spec(spec)
    saved = {k: sys.modules[k] for k in KERNEL_PACKAGES if k in sys.modules}
    sys.modules[alias] = module
    try:
        sys.modules.update(dict.fromkeys(KERNEL_PACKAGES))
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[alias]
        raise
    finally:
        for k in KERNEL_PACKAGES:
            del sys.modules[k]
        sys.modules.update(saved)
    return module


def torch_function(stock: type, name: str) -> Callable:
    """transformers' pure-torch `name` of the modeling module that defines `stock`. ValueError
    when that module has no such name (a transformers version vlpack does not support)."""
    fn = getattr(torch_kernel_module(stock.__module__), name, None)
    if fn is None:
        raise ValueError(f"{stock.__module__} has no {name}: this transformers version's "
                         f"Gated-DeltaNet is not supported by vlpack (tested: {TESTED_TRANSFORMERS})")
    return fn
