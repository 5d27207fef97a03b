"""The vision tower on packed rows: its tables from the host, one varlen call per block.

Three subclasses, installed by class at build time (seams.py):

- `VisionTower` overrides the tower's `forward`. At the start of every forward, transformers'
  vision towers derive tables from `grid_thw` with the helpers of `transformers.vision_utils`
  (rotary position ids, the position-embedding interpolation taps of Qwen3-VL and Qwen3.5,
  Qwen2.5-VL's window index, `cu_seqlens`); on a GPU grid each helper makes the host wait for
  the GPU. Each helper returns a precomputed value instead when the tower's kwargs carry it.
  `vision_tables` calls the same helpers on the batch's grids (Python ints, on the host), with
  the arguments each tower family passes; the override hands the results over, copied to the
  device without blocking. The boundaries the blocks then receive are the ones vlpack built,
  with their host copies, in the forward's `Boundaries`.
- `VisionAttention` overrides the vision attention's `forward`: with those boundaries it runs
  one varlen call per block over all images of the row (`attend_row`, never traced). Stock transformers
  instead calls attention once per image unless flash attention is requested. Its q/k/v and
  rotary steps are the stock ones (the same in every supported family and version).

- `ImageFeatures` overrides the base model's `get_image_features`: in a context-parallel
  forward (context.py) each rank encodes its share of the row's images, and the features are
  gathered so each rank keeps those of its own image tokens, in their order: the stock merge
  fills exactly this rank's placeholders. It also overrides `get_placeholder_mask`, to run the
  stock placeholder check on the device.

Without the forward's Boundaries (a stock call, the unpacked reference, a rank's blank image)
the three run the stock code.

Legend: P = patches of the row, H = heads, D = head dim.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from vlpack.families import family as family_of
from vlpack.model import attention
from vlpack.model.attention import TEXT_VARLEN_KWARGS
from vlpack.model.bounds import BOUNDS_KWARG, Segments, VisionTables, to_device


def vision_tables(tower: nn.Module, family: str, grids: tuple, device: torch.device) -> VisionTables:
    """The tables `tower` would compute from `grids` ((t, h, w) per image), on the host."""
    from transformers import vision_utils as vu

    kind = family_of(family).tower  # which helpers the tower calls, with which arguments
    grid = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
    host: dict = {}
    if kind == "qwen3":
        host["interp_indices"], host["interp_weights"] = (
            vu.get_vision_interpolation_indices_and_weights(
                grid, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
                align_corners=tower.interpolation_align_corners,
                spatial_merge_size=tower.config.spatial_merge_size))
    host["position_ids"] = vu.get_vision_position_ids(grid, tower.spatial_merge_size)
    cu = vu.get_vision_cu_seqlens(grid)
    full = Segments.from_host(tuple(cu.tolist()), device)
    tables = {k: to_device(v, device) for k, v in host.items()}
    tables.update(cu_seqlens=full.cu, max_seqlen=full.max_len)
    window = None
    if kind == "qwen2_5":
        index, cu_window = vu.get_vision_window_index(
            grid, spatial_merge_size=tower.spatial_merge_size, window_size=tower.window_size,
            patch_size=tower.patch_size)
        window = Segments.from_host(tuple(cu_window.tolist()), device)
        tables.update(window_index=to_device(index, device), cu_window_seqlens=window.cu,
                      max_window_seqlen=window.max_len)
    return VisionTables(tables, full, window, grid)


class VisionTower(nn.Module):
    """Mixin for a vision tower class: the forward's host-built tables, handed over."""

    def forward(self, hidden_states, grid_thw=None, **kwargs):
        bounds = kwargs.get(BOUNDS_KWARG)
        if bounds is not None and bounds.vision is not None:
            kwargs.update(bounds.vision.tables)
            bounds.paths["vision.tables"] = "host"
        else:  # no row tables (e.g. an unpacked sample): the blocks run the stock attention
            kwargs.pop(BOUNDS_KWARG, None)
        for k in TEXT_VARLEN_KWARGS:  # the text boundaries, which the model call hands on too
            kwargs.pop(k, None)
        return super().forward(hidden_states, grid_thw, **kwargs)


class VisionAttention(nn.Module):
    """Mixin for a vision attention class: one varlen call over all images of the row.

    The projections, rotary and casts may be traced inside a compiled vision block
    (`compile_layers(..., trace_vision_attention=True)`); the kernel call (`attend_row`) never
    is. The forward touches the row's Boundaries only by handing them to that call, so a traced
    block holds no guard on them and serves every row."""

    def forward(self, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None,
                **kwargs):
        bounds = kwargs.pop(BOUNDS_KWARG, None)  # only with the row's tables (VisionTower)
        for k in TEXT_VARLEN_KWARGS:
            kwargs.pop(k, None)
        if bounds is None:
            return super().forward(hidden_states, cu_seqlens, position_embeddings=position_embeddings,
                                   max_seqlen=max_seqlen, **kwargs)
        P = hidden_states.shape[0]
        q_PHD, k_PHD, v_PHD = (
            self.qkv(hidden_states).reshape(P, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0))
        cos, sin = position_embeddings
        # the family's own rotary (compiled by model.compile), else where the stock forward
        # looks it up
        rotary = self.__dict__.get("vlpack_rotary") or sys.modules[
            self._vlpack_stock.__module__].apply_rotary_pos_emb_vision
        q_PHD, k_PHD = rotary(q_PHD, k_PHD, cos, sin)
        q, k, v = attention.autocast_qkv(q_PHD, k_PHD, v_PHD)  # as the interface casts them
        out = attend_row(self.config._attn_implementation, q, k, v, bounds, cu_seqlens,
                         self.scaling)
        return self.proj(out.reshape(P, -1).contiguous())


@torch.compiler.disable
def attend_row(name: str, q_PHD, k_PHD, v_PHD, bounds, cu_seqlens, scale: float):
    """Bidirectional attention within each image of the row, with the segments whose device
    tensor the tower handed this block (`cu_seqlens`: full or windowed). Never traced: the
    segments are host ints that change with every row."""
    if bounds.vision is None:
        raise ValueError("the vision attention got a packed forward's Boundaries without the "
                         "row's vision tables: vision blocks are run through the tower "
                         "(VisionTower.forward), which hands them over or drops the Boundaries")
    segs = bounds.vision.segments(cu_seqlens)
    return attention.attend(name, q_PHD, k_PHD, v_PHD, segs, causal=False, scale=scale,
                            paths=bounds.paths, stream="vision")


class ImageFeatures(nn.Module):
    """Mixin for a base model class: the image features and their placeholders without host
    waits, and a context-parallel rank's own image features."""

    def get_image_features(self, pixel_values, image_grid_thw=None, **kwargs):
        bounds = kwargs.get(BOUNDS_KWARG)
        if bounds is not None and bounds.vision is not None:
            # the same grids, on the host: the stock split of the features per image reads
            # them with .tolist(), which on the device waits for the whole vision tower
            assert image_grid_thw is None or image_grid_thw.shape == bounds.vision.grid.shape, \
                "the packed row's visuals are one stream: only its grids reach get_image_features"
            image_grid_thw = bounds.vision.grid
        out = super().get_image_features(pixel_values, image_grid_thw, **kwargs)
        split = bounds.context if bounds is not None else None
        if split is None:
            return out

        def whole(feats):  # per-image tensors (transformers 5.24) or one tensor (5.17)
            return torch.cat(feats, 0) if isinstance(feats, list | tuple) else feats

        deepstack = getattr(out, "deepstack_features", None) or []
        parts = [whole(out.pooler_output), *(whole(f) for f in deepstack)]
        widths = [p.shape[-1] for p in parts]
        # one gather for the merged features and every deepstack level
        mine = split.my_image_features(torch.cat(parts, -1)).split(widths, -1)
        out.pooler_output = (mine[0],)
        if deepstack:
            out.deepstack_features = [(m,) if isinstance(f, list | tuple) else m
                                      for m, f in zip(mine[1:], deepstack, strict=True)]
        return out

    def get_placeholder_mask(self, input_ids, inputs_embeds, image_features=None,
                             video_features=None):
        """The stock masks and the stock check that the placeholders match the features, run
        on the device (an asynchronous assert; on the CPU it raises at once): the stock check
        formats and reads the count on the host, two waits for the device per forward.
        vlpack's encoder makes placeholders and features agree, so the check is an invariant."""
        image_mask, video_mask = super().get_placeholder_mask(input_ids, inputs_embeds)
        width = inputs_embeds.shape[-1]
        for mask, feats, what in ((image_mask, image_features, "image"),
                                  (video_mask, video_features, "video")):
            if feats is not None:
                torch._assert_async(mask[..., 0].sum() * width == feats.numel(),
                                    f"{what} features and {what} tokens do not match")
        return image_mask, video_mask
