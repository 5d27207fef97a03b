"""One optimizer step over a list of micro-batches, with the loss normalised globally.

Shared by the trainer, bench/train_throughput.py (which times its phases), bench/convergence.py
and the tests that compare packed with padded training step by step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlpack.train.distributed.parallel import Topology, all_reduce


@dataclass
class StepResult:
    loss: float
    aux_loss: float | None
    grad_norm: float
    lr: float
    label_tokens: int
    real_tokens: int
    tokens: int
    samples: int
    flops: float
    seconds: float
    flops_recomputed: float = 0.0
    """FLOPs performed again for recomputed layers (not in `flops`, which MFU counts)."""


def optimizer_step(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    mbs: list,
    *,
    topo: Topology,
    loss_norm: str = "token",
    aux_coef: float,
    grad_clip: float,
    autocast: torch.dtype | None = None,
    phase: Callable[[str], contextlib.AbstractContextManager] | None = None,
) -> StepResult:
    """Forward/backward every micro-batch, clip, step; the loss normalised globally.

    `token`: Σ CE over all label tokens of the step on all ranks / their all-reduced count.
    `sample`: mean over all samples of the step of each sample's token-mean CE (the reported
    loss is then that mean too).
    With context parallelism (`topo.cp` ranks share each row, `module` splits it) every rank of
    a group holds the same batches: their counts are the group's (reduced over the data-parallel
    axis), and each rank's loss and aux loss are its share of the group's.
    The optimizer is not stepped when the loss or gradient norm is not finite.
    `phase(name)`, when given, is entered around each micro-batch's `forward` and `backward` and
    around the `optimizer` part (clipping, the step, the schedule, zeroing): a benchmark's timer.
    """
    phase = phase or (lambda name: contextlib.nullcontext())
    ws = topo.world_size
    weights = [sample_mean_weights(b) if loss_norm == "sample" else (None, 0) for b in mbs]
    n_labels, n_samples, n_supervised = all_reduce([
        sum(b.num_label_tokens for b in mbs),
        sum(b.num_samples for b in mbs),
        sum(n for _, n in weights),
    ], topo, axis="dp")
    if n_labels == 0:
        raise ValueError("a step has no label tokens: does the data have assistant turns?")
    denom = n_labels if loss_norm == "token" else n_supervised
    module.train()
    # loss and aux loss are summed on the device and read with the gradient norm in one host
    # wait per step, after the backward: a read between forward and backward (or after each
    # micro-batch) would idle the GPU while the host launches the next pass
    loss_sum = aux_sum = None
    for i, b in enumerate(mbs):
        if hasattr(module, "set_requires_gradient_sync"):
            module.set_requires_gradient_sync(i == len(mbs) - 1)
        ctx = torch.autocast(topo.device.type, dtype=autocast) if autocast else contextlib.nullcontext()
        with phase("forward"), ctx:
            w = weights[i][0]
            out = module(b) if w is None else module(b, token_weights=w)
        # FSDP averages gradients over ranks, so scale by world size: the gradient is then the
        # global sum divided by the global count. The aux loss is averaged over data-parallel
        # replicas; a context-parallel rank's aux loss is its share of its group's (× ws / dp).
        obj = out.loss_sum * (ws / denom)
        if out.aux_loss is not None:
            obj = obj + aux_coef * (ws // topo.dp) * out.aux_loss / len(mbs)
            aux = out.aux_loss.detach().double() / len(mbs)
            aux_sum = aux if aux_sum is None else aux_sum + aux
        with phase("backward"):
            obj.backward()
        loss = out.loss_sum.detach().double()
        loss_sum = loss if loss_sum is None else loss_sum + loss
    has_aux = aux_sum is not None
    with phase("optimizer"):
        params = [p for p in module.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip or float("inf"))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        read = [loss_sum, aux_sum.to(loss_sum.device) if has_aux else loss_sum.new_zeros(()),
                grad_norm.to(loss_sum.device, torch.float64)]
        loss_local, aux_local, grad_norm = torch.stack(read).tolist()  # the step's host wait
        loss_total, aux_total = all_reduce([loss_local, aux_local], topo)
        loss = loss_total / denom
        lr = float(scheduler.get_last_lr()[0])  # a tensor under torchao's AdamW8bit
        if math.isfinite(loss) and math.isfinite(grad_norm):
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss=loss, aux_loss=aux_total / topo.dp if has_aux else None, grad_norm=grad_norm, lr=lr,
        label_tokens=int(n_labels), real_tokens=0, tokens=0, samples=int(n_samples), flops=0.0,
        seconds=0.0,
    )


def sample_mean_weights(batch) -> tuple[torch.Tensor, int]:
    """Per-token loss weights [T] (or [B·L]) that turn a summed CE into the sum of per-sample
    token means: 1 / (the sample's label tokens) on label positions, 0 elsewhere; and the
    number of samples that have label tokens."""
    from vlpack.data.batch import ThdBatch
    from vlpack.data.types import IGNORE_INDEX

    labels = batch.labels.reshape(-1)
    is_label = (labels != IGNORE_INDEX).double()
    dev = labels.device
    if isinstance(batch, ThdBatch):
        seg = torch.repeat_interleave(
            torch.arange(batch.num_samples, device=dev),
            torch.diff(batch.cu_seqlens_padded.to(dev).long()),
            output_size=labels.numel(),
        )
    else:
        L = batch.labels.shape[1]
        seg = torch.arange(batch.labels.shape[0], device=dev).repeat_interleave(L)
    n_seg = batch.num_samples if isinstance(batch, ThdBatch) else batch.labels.shape[0]
    counts = torch.zeros(n_seg, dtype=torch.float64, device=dev).index_add_(0, seg, is_label)
    return (is_label / counts[seg].clamp(min=1)).float(), int((counts > 0).sum())
