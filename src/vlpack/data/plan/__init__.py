"""Bin planning: pure functions and one bounded-buffer planner over sample lengths (no torch).

- `algorithms`: `plan_bins(lengths, capacity, algo)`, the one planning function: greedy
  knapsack, first fit decreasing or best fit decreasing by name (`Algo`), over a list of lengths
  (and ViT patches); `trees`: the segment trees its patch budget falls back on;
- `online`: `OnlinePlanner`, what the training stream runs: a bounded buffer planned by the same
  core, underfilled bins carried to the next round, exact resume from `state_dict()`;
- `ranks`: `estimate_bin_cost` and `assign_bins_to_ranks`, data-parallel balancing;
- `stats`: `bin_stats`, fill efficiency;
- `context`: `split_row`, the load-balanced context-parallel split of one row (2·cp chunks per
  segment) and each query chunk's key range, which the context-parallel forward
  (model/context.py) runs.
"""

from vlpack.data.plan.algorithms import ALGOS, Algo, check_algo, plan_bins
from vlpack.data.plan.context import ContextShard, QueryChunk, split_row
from vlpack.data.plan.online import OnlinePlanner
from vlpack.data.plan.ranks import assign_bins_to_ranks, estimate_bin_cost
from vlpack.data.plan.stats import bin_stats

__all__ = [
    "ALGOS",
    "Algo",
    "ContextShard",
    "OnlinePlanner",
    "QueryChunk",
    "assign_bins_to_ranks",
    "bin_stats",
    "check_algo",
    "estimate_bin_cost",
    "plan_bins",
    "split_row",
]
