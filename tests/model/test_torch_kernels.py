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
