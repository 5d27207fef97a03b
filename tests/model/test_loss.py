"""The summed token cross-entropy (model/loss.py): chunked equals plain, the host label count,
bf16 under autocast, labels never shifted again, a frozen head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlpack.model.loss import chunked_linear_ce_sum, linear_ce_sum, plain_ce_sum


@pytest.mark.parametrize("chunk", [1, 5, 1024])
def test_chunked_loss_equals_plain(chunk):
    g = torch.Generator().manual_seed(0)
    T, H, V = 37, 16, 3001
    h1 = torch.randn(T, H, generator=g, requires_grad=True)
    w1 = torch.randn(V, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::3] = -100
    h2, w2 = h1.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
    want = plain_ce_sum(h1 @ w1.T, labels)
    got = chunked_linear_ce_sum(h2, w2, labels, chunk_size=chunk)
    (2.0 * want).backward()
    (2.0 * got).backward()
    assert abs(float(got.detach()) - float(want.detach())) <= 1e-5 * abs(float(want.detach()))
    for a, b in ((h2.grad, h1.grad), (w2.grad, w1.grad)):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


@pytest.mark.parametrize("method", ["plain", "chunked"])
def test_loss_with_the_host_label_count(method):
    """Given the label count from the host, the loss picks the same rows as without it (the
    literal sum of per-token CE), and a count that does not match the labels is refused."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(9, 8, generator=g)
    head = torch.nn.Linear(8, 11, bias=False)
    labels = torch.tensor([3, -100, 5, 0, -100, -100, 10, 1, -100])
    keep = labels != -100
    want = F.cross_entropy(head(h[keep]), labels[keep], reduction="sum")
    got, n = linear_ce_sum(h, head, labels, method=method, num_label_tokens=5)
    assert n == 5 and torch.allclose(got, want, atol=1e-5)
    with pytest.raises(RuntimeError, match="num_label_tokens does not match"):
        linear_ce_sum(h, head, labels, method=method, num_label_tokens=4)


def test_chunked_loss_under_bf16_autocast_matches_plain():
    """Under autocast the chunked loss runs its matmuls in bf16 (weight gradient included) and
    stays within bf16 rounding of the plain path run under the same autocast."""
    g = torch.Generator().manual_seed(0)
    T, H, V = 64, 32, 3001
    h1 = torch.randn(T, H, generator=g, requires_grad=True)
    w1 = (0.1 * torch.randn(V, H, generator=g)).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::4] = -100
    h2, w2 = h1.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain_ce_sum(h1 @ w1.T, labels)
        got = chunked_linear_ce_sum(h2, w2, labels, chunk_size=16)
    want.backward()
    got.backward()
    assert got.dtype == torch.float32 and w2.grad.dtype == torch.float32
    assert abs(float(got) - float(want)) <= 1e-2 * abs(float(want))
    for a, b in ((h2.grad, h1.grad), (w2.grad, w1.grad)):
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.abs().max()


@pytest.mark.parametrize("weights", ["bf16 parameters", "fp32 under bf16 autocast"])
def test_chunked_loss_weight_gradient_runs_in_half_precision(weights):
    """The [V, H] weight-gradient product runs in bf16 whether the bf16 comes from the weights
    themselves (FSDP2's parameter dtype, no autocast) or from autocast: in fp32 it is the
    largest matmul of the loss on CUDA cores."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Matmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                self.seen.append((tuple(out.shape), out.dtype))
            return out

    g = torch.Generator().manual_seed(0)
    T, H, V = 40, 16, 3001
    dtype = torch.bfloat16 if weights == "bf16 parameters" else torch.float32
    h = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    w = (0.1 * torch.randn(V, H, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g)
    auto = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.float32)
    with auto, Matmuls() as spy:
        chunked_linear_ce_sum(h, w, labels, chunk_size=16)
    weight_grads = [dt for shape, dt in spy.seen if shape == (V, H)]
    assert weight_grads and set(weight_grads) == {torch.bfloat16}, spy.seen


def test_loss_counts_labels_and_never_shifts():
    lm = torch.nn.Linear(8, 50, bias=False)
    h = torch.randn(6, 8)
    labels = torch.tensor([3, -100, 7, 7, -100, -100])
    for method in ("plain", "chunked"):
        s, n = linear_ce_sum(h, lm, labels, method=method)
        assert n == 3
        want = F.cross_entropy(lm(h), labels, ignore_index=-100, reduction="sum")
        assert abs(float(s) - float(want)) < 1e-5
    s, n = linear_ce_sum(h, lm, torch.full((6,), -100), method="chunked")
    assert n == 0 and float(s) == 0.0


def test_frozen_lm_head_gets_no_grad():
    lm = torch.nn.Linear(8, 50, bias=False).requires_grad_(False)
    h = torch.randn(6, 8, requires_grad=True)
    s, _ = linear_ce_sum(h, lm, torch.tensor([1, 2, 3, 4, 5, 6]), method="chunked")
    s.backward()
    assert lm.weight.grad is None and h.grad is not None


def test_weighted_chunked_loss_matches_plain() -> None:
    """Per-token weights (sample-mean path): chunked loss and gradients == plain computation."""
    from vlpack.model.loss import linear_ce_sum

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    h = torch.randn(40, 16, requires_grad=True)
    labels = torch.randint(0, 50, (40,))
    labels[::3] = -100
    w = torch.rand(40)
    grads = []
    for method in ("plain", "chunked"):
        head.zero_grad()
        h.grad = None
        total, _ = linear_ce_sum(h, head, labels, method=method, chunk_size=7, token_weight_T=w)
        total.backward()
        grads.append((total.detach(), h.grad.clone(), head.weight.grad.clone()))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
