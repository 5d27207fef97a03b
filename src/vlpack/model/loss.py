"""Summed token cross-entropy over label tokens, plus the label-token count.

Labels in a ThdBatch are already shifted per sample (labels[t] is the target of position t):
the loss never shifts again. It returns a SUM and a count so the trainer can normalise by the
global number of label tokens across micro-batches and ranks.

Paths (all equal to the plain computation):
  plain   — logits = lm_head(hidden) for the label rows, then cross-entropy in fp32.
  chunked — never holds [T, vocab] logits: a custom autograd function walks the label rows in
            chunks, computes loss and both gradients chunk by chunk, and keeps only the gradients.
  liger   — liger-kernel's fused linear cross-entropy (GPU, when importable); opt-in only: it
            is several times slower than chunked at the 2B shape (docs/benchmarks.md, loss paths).
  auto    — chunked.

Legend: T = tokens, N = label tokens, H = hidden size, V = vocabulary, C = chunk rows.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from vlpack.data.types import IGNORE_INDEX

logger = logging.getLogger(__name__)

LOSS_METHODS = ("auto", "plain", "chunked", "liger")


def _label_rows(hidden_TH: torch.Tensor, labels_T: torch.Tensor, weight_T: torch.Tensor | None = None,
                count: int | None = None):
    """The rows that carry a label: hidden states, labels, weights. Given their `count` (the
    batch's host `num_label_tokens`) the host does not wait for the device; the count is then
    checked on the device (an asynchronous assert). Without it, one host sync."""
    labels_T = labels_T.to(hidden_TH.device)
    has_label_T = labels_T != IGNORE_INDEX
    if count is None:
        idx_N = torch.nonzero(has_label_T).squeeze(1)
    else:
        torch._assert_async(has_label_T.sum() == count,
                            "vlpack: the batch's num_label_tokens does not match its labels")
        idx_N = torch.nonzero_static(has_label_T, size=count).squeeze(1)
    w_N = None if weight_T is None else weight_T.reshape(-1).index_select(0, idx_N).float()
    return hidden_TH.index_select(0, idx_N), labels_T.index_select(0, idx_N), w_N


def plain_ce_sum(
    logits_TV: torch.Tensor, labels_T: torch.Tensor, weight_T: torch.Tensor | None = None
) -> torch.Tensor:
    """Summed (optionally per-token weighted) CE of full logits against already-shifted labels
    (fp32 math)."""
    if weight_T is None:
        return F.cross_entropy(logits_TV.float(), labels_T, ignore_index=IGNORE_INDEX, reduction="sum")
    ce_T = F.cross_entropy(logits_TV.float(), labels_T, ignore_index=IGNORE_INDEX, reduction="none")
    return (ce_T * weight_T.float()).sum()


class _ChunkedLinearCE(torch.autograd.Function):
    """sum_n CE(h_n @ W^T, y_n), computed and differentiated chunk by chunk."""

    @staticmethod
    def forward(ctx, h_NH, w_VH, y_N, chunk: int, need_w_grad: bool, r_N=None):
        loss = torch.zeros((), dtype=torch.float32, device=h_NH.device)
        gh_NH = torch.empty_like(h_NH)
        gw_VH = torch.zeros(w_VH.shape, dtype=torch.float32, device=w_VH.device) if need_w_grad else None
        # the matmul dtype: autocast's, else the weights' own (bf16 parameters under FSDP2)
        dev = h_NH.device.type
        mm = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else w_VH.dtype
        half = mm if mm in (torch.float16, torch.bfloat16) else None
        for s in range(0, h_NH.shape[0], chunk):
            h_CH, y_C = h_NH[s : s + chunk], y_N[s : s + chunk]
            logits_CV = (h_CH @ w_VH.T).float()
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            ce_C = lse_C - logits_CV.gather(1, y_C[:, None]).squeeze(1)
            r_C = None if r_N is None else r_N[s : s + chunk]
            loss += ce_C.sum() if r_C is None else (ce_C * r_C).sum()
            # d loss / d logits = (softmax - onehot) · row weight, reusing the logits buffer
            grad_CV = logits_CV.sub_(lse_C[:, None]).exp_()
            grad_CV[torch.arange(len(y_C), device=y_C.device), y_C] -= 1.0
            if r_C is not None:
                grad_CV.mul_(r_C[:, None])
            gh_NH[s : s + chunk] = (grad_CV.to(w_VH.dtype) @ w_VH).to(h_NH.dtype)
            if gw_VH is not None:
                if half is not None:
                    # as a half-precision linear layer's weight gradient runs: the [V, H]
                    # product in that dtype (fp32 accumulation inside the GEMM), summed into
                    # fp32 here. In fp32 it would run on CUDA cores (slow) under FSDP2's bf16
                    # parameters, where no autocast applies.
                    gw_VH.add_(grad_CV.to(half).T @ h_CH.to(half))
                else:
                    gw_VH.addmm_(grad_CV.T, h_CH.float())
        ctx.save_for_backward(gh_NH, gw_VH.to(w_VH.dtype) if gw_VH is not None else None)
        return loss

    @staticmethod
    def backward(ctx, g):
        gh_NH, gw_VH = ctx.saved_tensors
        return gh_NH * g.to(gh_NH.dtype), (None if gw_VH is None else gw_VH * g.to(gw_VH.dtype)), \
            None, None, None, None


def chunked_linear_ce_sum(
    hidden_TH, weight_VH, labels_T, *, chunk_size: int = 1024, token_weight_T=None
) -> torch.Tensor:
    """Summed (optionally per-token weighted) CE of lm_head(hidden) without materialising
    [T, vocab] logits."""
    return _chunked_rows(hidden_TH, weight_VH, *_label_rows(hidden_TH, labels_T, token_weight_T),
                         chunk_size)


def _chunked_rows(hidden_TH, weight_VH, h_NH, y_N, r_N, chunk_size: int) -> torch.Tensor:
    if h_NH.shape[0] == 0:
        return (hidden_TH.sum() * 0.0).float() + (weight_VH.sum() * 0.0).float()
    return _ChunkedLinearCE.apply(h_NH, weight_VH, y_N, chunk_size, weight_VH.requires_grad, r_N)


@functools.cache
def _liger() -> Callable | None:
    try:
        mod = importlib.import_module("liger_kernel.transformers.fused_linear_cross_entropy")
        return mod.LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
    except Exception:
        return None


def linear_ce_sum(
    hidden_TH: torch.Tensor,
    lm_head: torch.nn.Linear,
    labels_T: torch.Tensor,
    *,
    method: str = "auto",
    chunk_size: int = 1024,
    token_weight_T: torch.Tensor | None = None,
    paths: dict[str, str] | None = None,
    num_label_tokens: int | None = None,
) -> tuple[torch.Tensor, int]:
    """(summed CE over label tokens, number of label tokens) from hidden states and lm_head.

    With `token_weight_T` the sum is weighted per token (e.g. 1/label tokens of the token's
    sample, for a per-sample mean); liger has no weights, so the chunked path runs then. The
    method that ran lands in `paths["loss"]` when given. `num_label_tokens`, the count known on
    the host, spares the host a wait for the device.
    """
    if method not in LOSS_METHODS:
        raise ValueError(f"unknown loss method {method!r}: use one of {', '.join(LOSS_METHODS)}")
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("lm_head with a bias is not supported by vlpack's loss")
    if method == "auto":
        method = "chunked"
    if method == "liger" and token_weight_T is not None:
        method = "chunked"
    if method == "liger" and (not hidden_TH.is_cuda or _liger() is None):
        logger.warning("vlpack: liger-kernel is not usable here; using the chunked loss")
        method = "chunked"
    if paths is not None:
        paths["loss"] = method
    h_NH, y_N, r_N = _label_rows(hidden_TH, labels_T, token_weight_T, num_label_tokens)
    n = y_N.numel()
    if method == "plain":
        return plain_ce_sum(lm_head(h_NH), y_N, r_N), n
    if method == "liger":
        if n == 0:
            return (hidden_TH.sum() * 0.0).float(), 0
        return _liger()(lm_head.weight, h_NH, y_N).float(), n
    return _chunked_rows(hidden_TH, lm_head.weight, h_NH, y_N, r_N, chunk_size), n
