"""Packed == separate for every family (CPU, float32), MoE statistics, GDN leak regression.

One module-scoped fixture per family builds the tiny model once and runs the same bin both ways:
vlpack's packed row (alignment padding to 8 plus tail padding) and stock transformers on each
sample alone. The bin mixes a two-image sample, a text-only sample and single-image samples.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from vlpack.check.run import isolation, run_packed, run_unpacked
from vlpack.data.batch import build_thd_batch
from vlpack.families import FAMILIES
from vlpack.model import build_model, packed_forward
from vlpack.model.moe import RouterCapture, router_stats
from vlpack.model.synthetic import default_mix

TINY = [f"tiny-{f}" for f in FAMILIES]


@pytest.fixture(scope="module", params=TINY)
def family_run(request):
    torch.manual_seed(0)
    model, spec = build_model(request.param, device="cpu", dtype=torch.float32)
    model.train()
    samples = default_mix(spec, 4, seed=1)
    aligned = sum(-(-len(s) // 8) * 8 for s in samples)
    packed = run_packed(model, spec, samples, pad_to=8, total_len=aligned + 13)
    ref = run_unpacked(model, spec, samples)
    return dict(model=model, spec=spec, samples=samples, packed=packed, ref=ref)


def _param_errors(packed, ref) -> tuple[dict[str, float], list[str]]:
    """This test's own comparison (not the check's): every parameter's ‖Δgrad‖ over the larger
    of its reference norm and 5× its even share of the whole reference gradient's norm; and
    the parameters with a non-zero gradient on one side only (None, absent or zeros on the
    other)."""
    def nz(g):
        return g is not None and bool(g.abs().sum() > 0)

    live = [n for n in ref.grads if nz(ref.grads[n])]
    total = sum(float(ref.grads[n].double().pow(2).sum()) for n in live) ** 0.5
    n_all = sum(ref.grads[n].numel() for n in live)
    errors, one_sided = {}, []
    for n in sorted(set(packed.grads) | set(ref.grads)):
        a, b = packed.grads.get(n), ref.grads.get(n)
        if nz(a) != nz(b):
            one_sided.append(n)
        elif nz(b):
            share = total * (b.numel() / n_all) ** 0.5
            errors[n] = float((a - b).norm()) / max(float(b.norm()), 5 * share)
    return errors, one_sided


def test_bin_mixes_sample_kinds(family_run):
    kinds = {len(s.image_grid_thw) for s in family_run["samples"]}
    assert {0, 1, 2} <= kinds
    assert any(len(s) % 8 for s in family_run["samples"]), "no alignment padding in the bin"


def test_logits_equal(family_run):
    for a, b in zip(family_run["packed"].logits, family_run["ref"].logits, strict=True):
        assert a.shape == b.shape and float((a - b).abs().max()) <= 1e-5


def test_loss_equal(family_run):
    p, r = family_run["packed"], family_run["ref"]
    n = [int((s.labels != -100).sum()) - (s.labels[0] != -100) for s in family_run["samples"]]
    for lp, lr, k in zip(p.losses, r.losses, n, strict=True):
        assert abs(lp - lr) / max(k, 1) <= 1e-5  # per-token mean loss
    assert abs(sum(p.losses) - sum(r.losses)) <= 1e-5 * abs(sum(r.losses))


def test_loss_equals_transformers_own_labels_loss(family_run):
    """Each packed sample's token-mean loss equals the stock model's `model(..., labels=)` loss
    on that sample alone: transformers shifts the labels itself, so a wrong shift in vlpack
    (by two, or the last label kept) cannot hide behind a reference that shares it."""
    packed, ref = family_run["packed"], family_run["ref"]
    for s, lp, hf in zip(family_run["samples"], packed.losses, ref.hf_losses, strict=True):
        n = int((s.labels[1:] != -100).sum())  # the targets transformers' shift leaves
        assert hf is not None and n > 0
        assert abs(lp / n - hf) <= 1e-5 * max(1.0, abs(hf)), (s.key, lp / n, hf)


def test_grads_equal(family_run):
    """Every parameter's gradient, each against its own reference (names in the message)."""
    model, packed, ref = family_run["model"], family_run["packed"], family_run["ref"]
    errors, one_sided = _param_errors(packed, ref)
    assert not one_sided, one_sided
    assert set(errors) == {n for n, p in model.named_parameters() if p.requires_grad} - {
        n for n in ref.grads if not ref.grads[n].any()}
    kinds = {n.split(".")[1] if n.startswith("model.") else n for n in errors}
    assert {"visual", "language_model"} <= kinds, kinds
    if family_run["spec"].is_moe:
        assert any(".experts." in n for n in errors) and any(".gate." in n for n in errors)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-4, (worst, errors[worst])


def test_grads_compare_sees_one_parameter_zeroed(family_run):
    """The comparison above fails on one small parameter's gradient zeroed or dropped (the
    smallest-norm one: a whole-group norm would not see it)."""
    packed, ref = family_run["packed"], family_run["ref"]
    small = min((n for n in ref.grads if ref.grads[n].any()), key=lambda n: ref.grads[n].norm())
    for broken in ({**packed.grads, small: torch.zeros_like(ref.grads[small])},
                   {k: v for k, v in packed.grads.items() if k != small}):
        _, one_sided = _param_errors(replace(packed, grads=broken), ref)
        assert one_sided == [small]


def test_changing_one_sample_leaves_the_others_bitwise_unchanged(family_run):
    """Isolation by perturbation: each sample's tokens and pixels replaced in turn, the other
    samples' final hidden states are bitwise equal (per-segment kernels on CPU), and so is a
    repeat of the bin after the ones before it."""
    iso = isolation(family_run["model"], family_run["spec"], family_run["samples"], pad_to=8)
    assert len(iso["per_sample"]) == len(family_run["samples"])
    assert iso["max_diff"] == 0.0, iso["per_sample"]
    assert iso["repeat_diff"] == 0.0


def test_paths_named(family_run):
    paths = family_run["packed"].paths
    assert paths["attention.text"] == "per-segment SDPA"
    assert paths["attention.vision"] == "per-segment SDPA"
    if family_run["spec"].has_gdn:
        assert "per-segment" in paths["gdn.conv"] and "per-segment" in paths["gdn.delta_rule"]


# --- MoE statistics --------------------------------------------------------------------------
def _padded_router_logits(model, spec, samples):
    """Stock forward of the samples as one right-padded batch with a 2-D mask (images and
    videos as transformers' own inputs)."""
    from vlpack.data.padded import build_padded_batch
    from vlpack.model.build import set_attn_implementation
    from vlpack.model.forward import stock_visuals

    b = build_padded_batch(samples, pad_token_id=spec.pad_token_id)
    ids, mask, types = b.input_ids, b.attention_mask, b.mm_token_type_ids
    visuals = stock_visuals(spec, pixel_values=b.pixel_values, image_grid_thw=b.image_grid_thw,
                            pixel_values_videos=b.pixel_values_videos,
                            video_grid_thw=b.video_grid_thw,
                            second_per_grid_ts=b.second_per_grid_ts)

    set_attn_implementation(model, "sdpa")
    model.model.rope_deltas = None
    try:
        with torch.no_grad(), RouterCapture(model) as cap:
            model.model(input_ids=ids, attention_mask=mask, mm_token_type_ids=types,
                        use_cache=False, **visuals)
    finally:
        set_attn_implementation(model, spec.attn_implementation)
    return tuple(cap.logits), mask


def test_moe_aux_equals_hf_padded(family_run):
    spec, model = family_run["spec"], family_run["model"]
    if not spec.is_moe:
        pytest.skip("dense model")
    import importlib

    hf = importlib.import_module(type(model).__module__).load_balancing_loss_func
    logits, mask = _padded_router_logits(model, spec, family_run["samples"])
    want = float(hf(logits, spec.num_experts, spec.num_experts_per_tok, attention_mask=mask))
    assert abs(family_run["packed"].aux - want) <= 1e-5
    # Our function on the padded batch equals transformers' masked value too.
    ours = router_stats(list(logits), mask.bool(), spec.num_experts, spec.num_experts_per_tok)
    assert abs(float(ours.aux_loss) - want) <= 1e-6


def test_moe_counts_exclude_padding(family_run):
    spec, model = family_run["spec"], family_run["model"]
    if not spec.is_moe:
        pytest.skip("dense model")
    samples = family_run["samples"]
    batch = build_thd_batch(samples, pad_token_id=spec.pad_token_id, pad_to_multiple_of=8,
                            total_len=sum(len(s) for s in samples) + 64,
                            spatial_merge_size=spec.merge_size, mrope_after_video="transformers")
    with torch.no_grad():
        out = packed_forward(model, batch, spec=spec)
    stats = out.router_stats
    real = sum(len(s) for s in samples)
    assert stats.num_tokens == real < batch.num_tokens
    assert stats.tokens_per_expert.shape[1] == spec.num_experts
    assert (stats.tokens_per_expert.sum(1) == real * spec.num_experts_per_tok).all()
    logits, mask = _padded_router_logits(model, spec, samples)
    want = router_stats(list(logits), mask.bool(), spec.num_experts, spec.num_experts_per_tok)
    assert torch.equal(stats.tokens_per_expert, want.tokens_per_expert)


# --- the GDN leak that stock transformers has ---------------------------------------------------
def test_stock_qwen3_5_leaks_vlpack_does_not():
    model, spec = build_model("tiny-qwen3_5", device="cpu", dtype=torch.float32)
    import transformers

    stock = getattr(transformers, FAMILIES["qwen3_5"].hf_class)._from_config(
        model.config, attn_implementation="sdpa", dtype=torch.float32)
    stock.load_state_dict(model.state_dict())
    stock.config.use_cache = False
    samples = default_mix(spec, 2, seed=3)[::-1]  # text-only first, then two images
    batch = build_thd_batch(samples, pad_token_id=spec.pad_token_id,
                            spatial_merge_size=spec.merge_size,
                                    pad_to_multiple_of=1, mrope_after_video="transformers")
    seg = batch.segment(1)
    with torch.no_grad():
        alone = stock(input_ids=torch.as_tensor(samples[1].input_ids)[None],
                      mm_token_type_ids=torch.as_tensor(samples[1].mm_token_type_ids)[None],
                      pixel_values=torch.as_tensor(samples[1].pixel_values),
                      image_grid_thw=torch.as_tensor(samples[1].image_grid_thw),
                      use_cache=False).logits[0]
        # Stock packing: 4-row positions, no mask, no cache. Attention is isolated; GDN is not.
        stock_packed = stock(input_ids=batch.input_ids[None],
                             position_ids=batch.position_ids[:, None],
                             mm_token_type_ids=batch.mm_token_type_ids[None],
                             pixel_values=batch.pixel_values, image_grid_thw=batch.image_grid_thw,
                             use_cache=False).logits[0]
        ours = packed_forward(model, batch, spec=spec, return_logits=True).logits
    assert (stock_packed[seg] - alone).abs().max() > 1e-3  # the leak
    assert (ours[seg] - alone).abs().max() <= 1e-5


def test_filler_row_leaves_moe_statistics_untouched():
    """The loader's one-token filler row (a bin whose samples all failed to encode) is not a
    real token: no aux loss, no expert counts, no router gradient, and no NaN from counting
    nothing."""
    from vlpack.data.types import EncodedSample
    from vlpack.model.moe import routers

    model, spec = build_model("tiny-qwen3_vl_moe", device="cpu", dtype=torch.float32)
    model.train()
    batch = build_thd_batch([EncodedSample.filler(spec.pad_token_id)],
                            pad_token_id=spec.pad_token_id, pad_to_multiple_of=8,
                            spatial_merge_size=spec.merge_size, mrope_after_video="transformers")
    assert batch.padding_mask.all()
    out = packed_forward(model, batch, spec=spec)
    stats = out.router_stats
    assert int(stats.num_tokens) == 0 and int(stats.tokens_per_expert.sum()) == 0
    assert float(out.aux_loss) == 0.0
    (out.loss_sum + out.aux_loss).backward()
    for r in routers(model):
        for p in r.parameters():
            assert p.grad is None or not p.grad.any()
