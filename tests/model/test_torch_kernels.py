"""transformers' torch kernels as vlpack calls them (model/torch_kernels.py)."""

from __future__ import annotations

import logging


def _recorded(log: logging.Logger) -> tuple[logging.Handler, list[str]]:
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log.addHandler(handler)
    return handler, seen


def test_quiet_fallback_drops_only_the_fallback_warning_and_only_inside():
    from vlpack.model.torch_kernels import FALLBACK_LOGGER, quiet_fallback

    log = logging.getLogger(FALLBACK_LOGGER)
    fallback = ("`chunk_gated_delta_rule` is falling back to its reference PyTorch implementation "
                "because `flash-linear-attention` is not installed.")
    handler, seen = _recorded(log)
    try:
        with quiet_fallback():
            log.warning(fallback)
            log.warning("another warning")
        log.warning(fallback)
    finally:
        log.removeHandler(handler)
    assert seen == ["another warning", fallback]
    assert not log.filters


def test_transformers_kernel_wrapper_warns_and_is_quiet_inside():
    """transformers' own torch kernel, called through its wrapper in the copy vlpack runs, logs
    the fallback warning on transformers' kernel logger (named here, not taken from vlpack)
    and none inside `quiet_fallback` (warning_once's memory cleared before each call)."""
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    from vlpack.model.torch_kernels import quiet_fallback, torch_function

    fn = torch_function(m.Qwen3_5GatedDeltaNet, "torch_chunk_gated_delta_rule")
    gen = torch.Generator().manual_seed(0)
    inputs = dict(query=torch.randn(1, 8, 2, 16, generator=gen),
                  key=torch.randn(1, 8, 2, 16, generator=gen),
                  value=torch.randn(1, 8, 2, 16, generator=gen),
                  g=-torch.rand(1, 8, 2, generator=gen), beta=torch.rand(1, 8, 2, generator=gen))
    log = logging.getLogger("transformers.integrations.hub_kernels")
    handler, seen = _recorded(log)
    try:
        logging.Logger.warning_once.cache_clear()
        with quiet_fallback():
            fn(**inputs)
        quiet = list(seen)
        logging.Logger.warning_once.cache_clear()
        fn(**inputs)
    finally:
        log.removeHandler(handler)
    assert quiet == []
    assert any("falling back to its reference PyTorch implementation" in s for s in seen), seen
