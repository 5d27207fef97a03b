"""Context parallelism inside the model: one packed row split across the ranks of a group, the
parallelism seam of the model code (the only model module that calls torch.distributed).

Each rank of a context-parallel group holds the same packed row and computes the layers on its
share of the tokens: every segment (sample) cut into 2·cp chunks, rank r holding chunks r and
2·cp−1−r (`vlpack.data.plan.context.split_row`, which says why). Per forward, `ContextSplit`
carries what the layers need, in the forward's `Boundaries` (`Boundaries.context`):

- the text attention gathers keys and values from every rank (`gather_rows`, whose backward
  sums the gradients back to the rank that owns each row) and runs each local query chunk
  against its segment's keys up to the chunk's end (`attention.attend_chunks`, causal aligned
  to the chunk's last key);
- the Gated-DeltaNet layers run on their own chunks: the short conv with each chunk's left
  halo gathered from the ranks holding it (`gdn.context_conv1d`), the delta rule with each
  sample's recurrent state passed from chunk to chunk across the ranks
  (`gdn.context_delta_rule`: per-chunk state maps gathered and scanned, exact);
- the vision tower encodes each image of the row on one rank of the group (`images_mine`,
  balanced by patches) and the features are gathered, so each rank keeps those of its own image
  tokens (`image_index_gathered`); the deepstack merge adds them at its local positions. A row
  with fewer images than ranks is encoded on every rank instead (`images_mine` None);
- MoE router statistics are summed over the group (`all_reduce`), each rank's load-balancing
  loss its share of the group's, so the shares add up to the whole row's loss.

Every rank holds T/cp tokens (segment lengths are multiples of 2·cp), so the gathers are even.

Legend: T = tokens of the row, R = tokens of this rank (T/cp), G = gathered rows (cp·R = T,
rank-major), Q/K = query/key rows of the chunks, N = image tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from vlpack.data.plan.context import ContextShard, split_row
from vlpack.model.bounds import Segments, to_device


@dataclass(frozen=True, slots=True, eq=False)
class ContextGroup:
    """The context-parallel group this process belongs to: its process group (None for a
    group of one), this process's rank in it and its size."""

    group: object | None
    rank: int
    size: int

    @classmethod
    def single(cls) -> ContextGroup:
        return cls(None, 0, 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the group (not differentiable: for statistics and counts)."""
        out = x.detach().clone()
        if self.size > 1:
            dist.all_reduce(out, group=self.group)
        return out


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 (rank-major); backward: each rank gets the sum over ranks of the
    gradient of its own rows (reduce-scatter; all-reduce + slice where the backend has no
    reduce-scatter, as gloo)."""

    @staticmethod
    def forward(ctx, x, group, rank: int, size: int):
        ctx.group, ctx.rank, ctx.size = group, rank, size
        x = x.contiguous()
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        n = grad.shape[0] // ctx.size
        if dist.get_backend(ctx.group) == "nccl":
            out = grad.new_empty((n, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        else:
            total = grad.clone()
            dist.all_reduce(total, group=ctx.group)
            out = total[ctx.rank * n : (ctx.rank + 1) * n]
        return out, None, None, None


class ContextSplit:
    """One row's split across a `ContextGroup`, built on the host from the row's segment
    boundaries (and image-token positions); device index tensors made once per forward."""

    __slots__ = ("chunks_k", "chunks_q", "group", "image_index", "image_index_gathered",
                 "image_rows", "image_select", "images_mine", "key_index", "local_rows",
                 "row_order", "row_segments", "shard", "token_index")

    def __init__(self, group: ContextGroup, padded_bounds: tuple[int, ...],
                 image_positions: tuple[int, ...], device: torch.device,
                 image_tokens: tuple[int, ...] = ()) -> None:
        """`image_tokens`: each image's LLM tokens (row order); without it every rank encodes
        every image."""
        device = torch.device(device)
        lengths = np.diff(np.asarray(padded_bounds)).tolist()
        shards = split_row(lengths, group.size)
        self.group = group
        self.shard: ContextShard = shards[group.rank]
        index_R = np.asarray(self.shard.token_index, dtype=np.int64)
        self.token_index = index_R
        self.local_rows = to_device(torch.from_numpy(index_R), device)
        # gathered row g (rank-major) is row position gathered_G[g]; row_order_T[p] is the
        # gathered row holding row position p
        gathered_G = np.concatenate([np.asarray(s.token_index, dtype=np.int64) for s in shards])
        row_order_T = np.empty_like(gathered_G)
        row_order_T[gathered_G] = np.arange(len(gathered_G))
        self.row_order = to_device(torch.from_numpy(row_order_T), device)
        keys_K = np.concatenate([np.arange(c.k_start, c.k_end) for c in self.shard.chunks])
        self.key_index = to_device(torch.from_numpy(row_order_T[keys_K]), device)
        cu_q = np.cumsum([0] + [c.length for c in self.shard.chunks])
        cu_k = np.cumsum([0] + [c.k_end - c.k_start for c in self.shard.chunks])
        self.chunks_q = Segments.from_host(tuple(cu_q.tolist()), device)
        self.chunks_k = Segments.from_host(tuple(cu_k.tolist()), device)
        self.row_segments = Segments.from_host(tuple(padded_bounds), device)
        # this rank's image tokens: their index among the row's image tokens, and their local
        # positions (both ascending: a rank's tokens are in row order)
        positions_N = np.asarray(image_positions, dtype=np.int64)
        local_pos = np.searchsorted(index_R, positions_N)
        mine = (local_pos < len(index_R)) & (
            index_R[np.minimum(local_pos, len(index_R) - 1)] == positions_N)
        select_n = np.flatnonzero(mine)
        self.image_select = to_device(torch.from_numpy(select_n), device)
        self.image_index = to_device(torch.from_numpy(local_pos[mine]), device)
        self.images_mine: tuple[int, ...] | None = None
        self.image_rows = 0
        self.image_index_gathered = None
        if len(image_tokens) >= group.size:
            owner = assign_images(image_tokens, group.size)
            self.images_mine = tuple(i for i, o in enumerate(owner) if o == group.rank)
            # each rank's encoded features, in its images' order, padded to the longest
            # rank's rows; gathered rank-major: image i's tokens are rows owner·rows + offset
            rows = [sum(n for n, o in zip(image_tokens, owner, strict=True) if o == r)
                    for r in range(group.size)]
            self.image_rows = max(rows)
            offset, start = [0] * group.size, []
            for n, o in zip(image_tokens, owner, strict=True):
                start.append(o * self.image_rows + offset[o])
                offset[o] += n
            gathered_n = np.concatenate([np.arange(a, a + n)
                                         for a, n in zip(start, image_tokens, strict=True)])
            assert len(gathered_n) == len(positions_N), "image tokens do not match the grids"
            self.image_index_gathered = to_device(torch.from_numpy(gathered_n[select_n]), device)

    @property
    def num_local(self) -> int:
        return len(self.token_index)

    def gather_rows(self, x_R: torch.Tensor) -> torch.Tensor:
        """This rank's rows [R, ...] from every rank → [G, ...] rank-major (differentiable)."""
        g = self.group
        return _GatherRows.apply(x_R, g.group, g.rank, g.size)

    def chunk_row(self, sample: int, index: int) -> int:
        """Where chunk `index` (0 … 2·cp−1, row order) of sample `sample` is among per-chunk
        rows gathered rank-major (`gather_rows` of one row per local chunk): rank r holds
        chunks r and 2·cp−1−r of every sample, in that order."""
        cp, n = self.group.size, len(self.shard.chunks)
        owner, second = (index, 0) if index < cp else (2 * cp - 1 - index, 1)
        return owner * n + 2 * sample + second

    def gather_keys(self, k_RKD: torch.Tensor) -> torch.Tensor:
        """Keys (or values) of this rank's tokens → the key rows of its query chunks [K, ...]."""
        return self.gather_rows(k_RKD).index_select(0, self.key_index.to(k_RKD.device))

    def gather_row(self, x_R: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's tokens along `dim` → the whole row's, in row order."""
        x = x_R.movedim(dim, 0)
        full = self.gather_rows(x).index_select(0, self.row_order.to(x.device))
        return full.movedim(0, dim)

    def keep_local(self, x_T: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The whole row's tokens along `dim` → this rank's."""
        return x_T.index_select(dim, self.local_rows.to(x_T.device))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the group (not differentiable: for statistics and counts)."""
        return self.group.all_reduce(x)

    def my_image_features(self, feats_NC: torch.Tensor) -> torch.Tensor:
        """Features of the images this rank encoded ([rows, C]; all the row's images when
        `images_mine` is None) → those of this rank's image tokens, in their local order."""
        if self.images_mine is None:
            return feats_NC.index_select(0, self.image_select.to(feats_NC.device))
        pad = self.image_rows - feats_NC.shape[0]
        padded = torch.cat([feats_NC, feats_NC.new_zeros(pad, *feats_NC.shape[1:])]) if pad \
            else feats_NC
        return self.gather_rows(padded).index_select(
            0, self.image_index_gathered.to(feats_NC.device))


def assign_images(image_tokens: tuple[int, ...], size: int) -> list[int]:
    """The rank that encodes each image: largest first to the least-loaded rank (by tokens,
    i.e. patches / merge²; ties to the lower rank), so with at least `size` images every rank
    encodes at least one."""
    load = [0] * size
    owner = [0] * len(image_tokens)
    for i in sorted(range(len(image_tokens)), key=lambda i: (-image_tokens[i], i)):
        r = min(range(size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += image_tokens[i]
    return owner
