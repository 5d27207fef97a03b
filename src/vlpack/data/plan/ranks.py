"""Data-parallel balancing: a compute model for one bin, and bins split over ranks with an equal
number per rank."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["ATTN_COST", "PATCH_COST", "TOKEN_COST", "assign_bins_to_ranks", "estimate_bin_cost"]


TOKEN_COST = 1.0
"""Cost of one LLM token's linear layers (the unit)."""

ATTN_COST = 1.0 / (12 * 2048)
"""Cost per unit of Σ len² (causal attention). Per token, causal attention over L keys costs
≈ 2·d·L FLOPs against ≈ 24·d² for a layer's linear maps, so the ratio is L / (12·d); the
default takes d = 2048 (Qwen3-VL-2B); use 1/(12·d) for another hidden size."""

PATCH_COST = 0.25
"""Cost of one ViT patch relative to one LLM token: ≈ vision-tower params / LLM params
(≈ 0.4 B / 1.7 B for Qwen3-VL-2B; ≈ 0.1 for 7B models)."""


def estimate_bin_cost(
    seg_lengths: Sequence[int],
    patches: int,
    *,
    token_cost: float = TOKEN_COST,
    attn_cost: float = ATTN_COST,
    patch_cost: float = PATCH_COST,
) -> float:
    """Relative compute of one bin: token_cost·Σ len + attn_cost·Σ len² + patch_cost·patches.

    `seg_lengths` are the samples' token counts (attention stays inside a sample, so the
    quadratic term is per segment); `patches` is the bin's total of ViT patches.
    """
    if patches < 0 or any(v < 0 for v in seg_lengths):
        raise ValueError("seg_lengths and patches must be ≥ 0")
    return (
        token_cost * sum(seg_lengths)
        + attn_cost * sum(v * v for v in seg_lengths)
        + patch_cost * patches
    )


def assign_bins_to_ranks(bin_costs: Sequence[float], world_size: int) -> list[list[int]]:
    """Splits bins over data-parallel ranks: same NUMBER of bins per rank (unequal step counts
    hang collectives), compute balanced by LPT (costliest bin to the least-loaded rank that
    still has a free slot; ties: lower bin index, lower rank).

    Each rank's list is ordered by descending cost, so step k on every rank runs a bin of
    similar rank in cost (FSDP synchronises every micro-batch, not only per optimizer step).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be ≥ 1; got {world_size}")
    n = len(bin_costs)
    if n % world_size:
        raise ValueError(
            f"{n} bins cannot be split evenly over {world_size} ranks; plan a multiple of "
            f"world_size bins (carry {n % world_size} to the next step or add filler bins)"
        )
    slots = n // world_size
    order = sorted(range(n), key=lambda i: (-bin_costs[i], i))
    heap = [(0.0, r) for r in range(world_size)]
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        load, r = heapq.heappop(heap)
        out[r].append(i)
        if len(out[r]) < slots:
            heapq.heappush(heap, (load + bin_costs[i], r))
    return out
