"""The single forward entry of the trainer: one packed THD row in, summed loss out.

`packed_forward` adds the batch dimension and calls the base model with
  position_ids [4, 1, T] (row 0 text positions restarting per sample, rows 1-3 per-sample MRoPE),
  vlpack_bounds = the row's `Boundaries` (bounds.py: text segments = batch.cu_seqlens_padded,
  the vision tower's tables, the image-token positions), cu_seq_lens_q/k and max_length_q/k for
  transformers' own use, pixel_values / image_grid_thw / mm_token_type_ids, use_cache=False and
  NO 2-D attention mask,
then computes the loss from the hidden states (never the full [T, vocab] logits unless asked).
The layers record the kernels they ran in the Boundaries; the forward returns them as `paths`.

Legend: T = tokens of the row, H = hidden size, V = vocabulary, L = tokens of one sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from vlpack.data.batch import ThdBatch, shifted_labels
from vlpack.data.types import EncodedSample
from vlpack.families import family
from vlpack.model import loss
from vlpack.model.bounds import BOUNDS_KWARG, Boundaries, Segments, to_device
from vlpack.model.build import ModelSpec
from vlpack.model.context import ContextGroup, ContextSplit
from vlpack.model.moe import RouterCapture, RouterStats, router_stats


@dataclass
class ForwardOut:
    """loss_sum: summed CE over label tokens (fp32 scalar); num_label_tokens: their count;
    aux_loss: MoE load-balancing loss over real tokens (None for dense models);
    logits: [T, V] only when asked; router_stats: per-expert counts (MoE);
    paths: the kernels that ran (attention, GDN, MoE experts, loss); hf_loss: transformers' own token-mean
    loss (`unpacked_forward(..., hf_labels=True)` only); hidden: [T, H] final hidden states,
    only when asked; split: this rank's share of a context-parallel row (None otherwise)."""

    loss_sum: torch.Tensor
    num_label_tokens: int
    aux_loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    router_stats: RouterStats | None = None
    paths: dict[str, str] = field(default_factory=dict)
    hf_loss: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    split: ContextSplit | None = None


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def stock_visuals(spec: ModelSpec, **inputs) -> dict:
    """transformers' image and video keyword arguments from `EncodedSample.hf_visuals`-style
    inputs (arrays or tensors): those the sample has, and `second_per_grid_ts` only for the
    family whose positions use it (Qwen2.5-VL)."""
    out = {}
    for name, value in inputs.items():
        if value is None or len(value) == 0:
            continue
        if name == "second_per_grid_ts" and not spec.tokens_per_second:
            continue
        out[name] = torch.as_tensor(value)
    if "pixel_values" not in out:
        out.pop("image_grid_thw", None)
    return out


def visual_placeholders(input_ids_T: torch.Tensor, types_T: torch.Tensor,
                        spec: ModelSpec) -> torch.Tensor:
    """`input_ids` with every visual token as the image placeholder: the packed row's images and
    videos are one stream (batch.py) that the stock merge places at image placeholders. The
    merge replaces the embeddings there, so the ids at those positions change nothing else."""
    return torch.where(types_T != 0, torch.full_like(input_ids_T, spec.image_token_id),
                       input_ids_T)


def boundaries(model: nn.Module, batch: ThdBatch, spec: ModelSpec) -> Boundaries:
    """The row's Boundaries, from the batch's host fields (no device sync)."""
    from vlpack.model.vision import vision_tables

    device = _device(model)
    text = Segments(batch.cu_seqlens_padded.to(device, torch.int32), batch.padded_bounds,
                    int(batch.max_seqlen))
    vision = index = None
    if batch.image_grids and batch.pixel_values is not None:
        vision = vision_tables(model.model.visual, spec.family, batch.image_grids, device)
        if family(spec.family).deepstack:  # the deepstack merge's positions
            index = to_device(torch.tensor(batch.image_positions, dtype=torch.long), device)
    return Boundaries(text=text, vision=vision, image_index=index)


def context_model_inputs(model: nn.Module, batch: ThdBatch, spec: ModelSpec,
                         split: ContextSplit) -> dict:
    """Keyword arguments of the base-model call for one rank's share of a context-parallel
    row: its tokens, their positions (computed on the whole row, per sample), the row's images."""
    from vlpack.model.vision import vision_tables

    device = _device(model)
    has_images = batch.pixel_values is not None and batch.image_grid_thw.shape[0] > 0
    pixels, grid, grids = batch.pixel_values, batch.image_grid_thw, batch.image_grids
    if has_images and split.images_mine is not None:  # this rank encodes its share
        starts = np.cumsum([0] + [t * h * w for t, h, w in grids]).tolist()
        mine = split.images_mine
        pixels = torch.cat([pixels[starts[i] : starts[i + 1]] for i in mine])
        grid, grids = grid[list(mine)], tuple(grids[i] for i in mine)
    vision = vision_tables(model.model.visual, spec.family, grids, device) if has_images else None
    index = split.image_index if has_images and family(spec.family).deepstack else None
    bounds = Boundaries(text=None, vision=vision, image_index=index, context=split)
    if has_images:
        bounds.paths["vision.context"] = (
            "every rank encodes the row's images" if split.images_mine is None else
            "each image encoded on one rank, features gathered")
    rows = split.local_rows.to(batch.input_ids.device)
    return dict(
        input_ids=visual_placeholders(batch.input_ids[rows], batch.mm_token_type_ids[rows],
                                      spec)[None],
        position_ids=batch.position_ids[:, rows][:, None, :],
        mm_token_type_ids=batch.mm_token_type_ids[rows][None],
        pixel_values=pixels if has_images else None,
        image_grid_thw=grid if has_images else None,
        use_cache=False,
        **{BOUNDS_KWARG: bounds},
    )


def packed_model_inputs(model: nn.Module, batch: ThdBatch, spec: ModelSpec) -> dict:
    """Keyword arguments of the base-model call for one packed row."""
    has_images = batch.pixel_values is not None and batch.image_grid_thw.shape[0] > 0
    bounds = boundaries(model, batch, spec)
    return dict(
        input_ids=visual_placeholders(batch.input_ids, batch.mm_token_type_ids, spec)[None],
        position_ids=batch.position_ids[:, None, :],
        mm_token_type_ids=batch.mm_token_type_ids[None],
        pixel_values=batch.pixel_values if has_images else None,
        image_grid_thw=batch.image_grid_thw if has_images else None,
        cu_seq_lens_q=bounds.text.cu,
        cu_seq_lens_k=bounds.text.cu,
        max_length_q=bounds.text.max_len,
        max_length_k=bounds.text.max_len,
        use_cache=False,
        **{BOUNDS_KWARG: bounds},
    )


def _moe_stats(spec: ModelSpec, capture: RouterCapture | None, real_T: torch.Tensor,
               split: ContextSplit | None = None):
    if capture is None:
        return None
    return router_stats(capture.logits, real_T, spec.num_experts, spec.num_experts_per_tok,
                        group_sum=None if split is None else split.all_reduce,
                        chosen=capture.indices)


def _experts_implementation(model: nn.Module) -> str:
    config = model.config
    config = getattr(config, "text_config", config)
    return getattr(config, "_experts_implementation", None) or "eager"


def packed_forward(
    model: nn.Module,
    batch: ThdBatch,
    *,
    spec: ModelSpec,
    return_logits: bool = False,
    return_hidden: bool = False,
    loss_method: str = "auto",
    chunk_size: int = 1024,
    token_weights: torch.Tensor | None = None,
    context: ContextGroup | None = None,
) -> ForwardOut:
    """Forward one packed row; loss summed over its label tokens (labels already shifted),
    weighted per token when `token_weights` [T] is given.

    With a `context` group of several ranks, this rank computes its share of the row
    (context.py): the loss, label count, hidden states and logits are those of its own tokens
    (in `ContextSplit.token_index` order), the MoE statistics the group's, the aux loss this
    rank's share of the group's."""
    device = _device(model)
    if batch.input_ids.device != device:
        batch = batch.to(device)
    if batch.position_ids.shape[0] != 4:
        raise ValueError("position_ids must have 4 rows (text, t, h, w): build the batch with "
                         "vlpack.data.batch.build_thd_batch")
    split = None
    if context is not None and context.size > 1:
        from vlpack.model.attention import VARLEN

        if model.config._attn_implementation != VARLEN:
            raise ValueError(f"context parallelism runs vlpack's {VARLEN} attention across "
                             f"ranks, not {model.config._attn_implementation!r}: build the "
                             "model with backend auto or varlen")
        merge = spec.merge_size ** 2
        split = ContextSplit(context, batch.padded_bounds, batch.image_positions, device,
                             image_tokens=tuple(t * h * w // merge for t, h, w in batch.image_grids))
    capture = RouterCapture(model) if spec.is_moe else None
    if capture is not None:
        capture.__enter__()
    inputs = packed_model_inputs(model, batch, spec) if split is None else \
        context_model_inputs(model, batch, spec, split)
    paths = inputs[BOUNDS_KWARG].paths
    if spec.is_moe:
        paths["moe.experts"] = _experts_implementation(model)
    try:
        out = model.model(**inputs)
    finally:
        if capture is not None:
            capture.__exit__()
    hidden_TH = out.last_hidden_state[0]
    labels_T, real_T = batch.labels, ~batch.padding_mask
    weight_T = None if token_weights is None else token_weights.to(hidden_TH.device)
    if split is not None:
        labels_T, real_T = split.keep_local(labels_T), split.keep_local(real_T)
        weight_T = None if weight_T is None else split.keep_local(weight_T)
    loss_sum, n = loss.linear_ce_sum(
        hidden_TH, model.lm_head, labels_T, method=loss_method, chunk_size=chunk_size,
        token_weight_T=weight_T, paths=paths,
        num_label_tokens=batch.num_label_tokens if split is None else None)
    stats = _moe_stats(spec, capture, real_T, split)
    return ForwardOut(
        loss_sum=loss_sum,
        num_label_tokens=n,
        aux_loss=None if stats is None else stats.aux_loss,
        logits=model.lm_head(hidden_TH) if return_logits else None,
        router_stats=stats,
        paths={k if k.startswith(("gdn.", "vision.", "moe.", "loss")) else f"attention.{k}": v
               for k, v in sorted(paths.items())},
        hidden=hidden_TH if return_hidden else None,
        split=split,
    )


def unpacked_forward(model: nn.Module, sample: EncodedSample, *, spec: ModelSpec,
                     hf_labels: bool = False) -> ForwardOut:
    """Stock transformers forward of ONE sample (the reference of `vlpack check`).

    Positions come from the model's own get_rope_index; logits are returned ([L, V]). With
    `hf_labels` the call is the model's own `model(..., labels=...)` with the sample's unshifted
    labels, and `hf_loss` is the token-mean loss transformers computes (its own shift; it keeps
    its graph, so a caller can take gradients of transformers' loss).
    """
    device = _device(model)
    visuals = {k: v.to(device) for k, v in stock_visuals(spec, **sample.hf_visuals()).items()}
    inputs = dict(
        input_ids=torch.as_tensor(sample.input_ids, device=device)[None],
        mm_token_type_ids=torch.as_tensor(sample.mm_token_type_ids.astype(np.int32),
                                          device=device)[None],
        use_cache=False,
        **visuals,
    )
    model.model.rope_deltas = None  # the model caches it across calls
    capture = RouterCapture(model) if spec.is_moe else None
    if capture is not None:
        capture.__enter__()
    hf_loss = None
    try:
        if hf_labels:
            extra = dict(output_router_logits=False) if spec.is_moe else {}
            out = model(**inputs, labels=torch.as_tensor(sample.labels, device=device)[None],
                        **extra)
            logits_LV, hf_loss = out.logits[0], out.loss
        else:
            logits_LV = model.lm_head(model.model(**inputs).last_hidden_state[0])
    finally:
        if capture is not None:
            capture.__exit__()
    labels_L = torch.as_tensor(shifted_labels(sample.labels), device=device)
    stats = _moe_stats(spec, capture, torch.ones(len(sample), dtype=torch.bool, device=device))
    return ForwardOut(
        loss_sum=loss.plain_ce_sum(logits_LV, labels_L),
        num_label_tokens=int((labels_L != -100).sum()),
        aux_loss=None if stats is None else stats.aux_loss,
        logits=logits_LV,
        router_stats=stats,
        hf_loss=None if hf_loss is None or not torch.isfinite(hf_loss) else hf_loss,
    )
