"""MoE router statistics over REAL tokens only.

Stock transformers pools router logits of every token of the batch into its load-balancing
loss; the only way it excludes padding is a 2-D attention mask, which also turns off its packed
path. vlpack captures the router logits with forward hooks on the router modules and computes
the same quantity (Switch-Transformer loss, pooled over layers and tokens, exactly as
transformers' `load_balancing_loss_func` with a mask) over the real tokens of the packed row.
Padding tokens may still be routed through experts; only the statistics exclude them.

Legend: L = MoE layers, T = tokens, E = experts, k = experts per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from vlpack.model.seams import classes_of


def routers(model: nn.Module) -> list[nn.Module]:
    """The MoE router modules of `model`, layer order (none for a dense family)."""
    router = classes_of(model).router
    return [] if router is None else [m for m in model.modules() if isinstance(m, router)]


class RouterCapture:
    """Context manager collecting each router's logits [T, E] during a forward, layer order,
    and the experts it chose [T, k] where the router returns them (transformers' top-k routers
    return (logits, weights, indices)), so that `router_stats` need not choose them again."""

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        self.logits: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] | None = []
        self._handles: list = []

    def _hook(self, module, args, output):
        self.logits.append(output[0] if isinstance(output, tuple) else output)
        chosen = output[2] if isinstance(output, tuple) and len(output) == 3 else None
        if chosen is None or chosen.is_floating_point() or self.indices is None:
            self.indices = None  # a router that does not say: router_stats takes the top-k
        else:
            self.indices.append(chosen)

    def __enter__(self) -> RouterCapture:
        self.logits, self.indices = [], []
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@dataclass
class RouterStats:
    """aux_loss: load-balancing loss over real tokens (scalar, differentiable);
    tokens_per_expert: [L, E] int64 top-k assignments of real tokens per layer;
    num_tokens: real tokens counted per layer, a 0-d device tensor (reading it is the caller's
    host sync, none happens inside the step)."""

    aux_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_tokens: torch.Tensor


def router_stats(
    router_logits: list[torch.Tensor], real_T: torch.Tensor, num_experts: int, top_k: int,
    group_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    chosen: list[torch.Tensor] | None = None,
) -> RouterStats:
    """Load-balancing loss and per-expert counts over the tokens where `real_T` is True.

    `chosen`, each router's experts per token [T, k] as it routed them (`RouterCapture.indices`),
    are the top-k of its softmax that the counts take; without them the top-k is taken here.
    With `group_sum` (the sum over a context-parallel group, context.py) the counts and token
    numbers are the group's, and the aux loss is this rank's share of the group's: its own
    routing probabilities against the group's assignment fractions, so the shares add up to
    the loss of the whole row (and so do their gradients)."""
    if not router_logits:
        raise ValueError("no router logits were captured: is this an MoE model?")
    w_T = real_T.reshape(-1).to(torch.float32)
    counts, probs_sum = [], torch.zeros(num_experts, dtype=torch.float32, device=w_T.device)
    if chosen is not None and len(chosen) != len(router_logits):
        raise ValueError(f"{len(chosen)} routers' choices for {len(router_logits)} routers' logits")
    for i, logits_TE in enumerate(router_logits):
        if logits_TE.shape[0] != w_T.shape[0]:
            raise ValueError(f"router logits have {logits_TE.shape[0]} rows but the mask has "
                             f"{w_T.shape[0]} tokens")
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        top_Tk = (chosen[i] if chosen is not None
                  else torch.topk(probs_TE, top_k, dim=-1).indices)
        counts.append(torch.zeros(num_experts, device=w_T.device).scatter_add_(
            0, top_Tk.reshape(-1), w_T.repeat_interleave(top_k)))
        probs_sum = probs_sum + (probs_TE * w_T[:, None]).sum(0)
    counts_LE = torch.stack(counts)
    num_T = w_T.sum()
    if group_sum is not None:
        counts_LE, num_T = group_sum(counts_LE), group_sum(num_T)
    rows = num_T.clamp(min=1) * len(router_logits)  # no real token (a filler row): aux 0
    aux = num_experts * torch.sum((counts_LE.sum(0) / rows) * (probs_sum / rows))
    return RouterStats(aux_loss=aux, tokens_per_expert=counts_LE.round().long(),
                       num_tokens=num_T.long())
