"""LoRA through peft on the packed path: packed ≡ padded, only adapters train, the adapter loads
in peft and the merged export in transformers with the trained model's logits, exact resume."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import CPU, losses, small_cfg
from vlpack.config import LoraConfig, load_config
from vlpack.data.batch import build_thd_batch
from vlpack.data.padded import build_padded_batch
from vlpack.model import lora
from vlpack.model.build import build_model
from vlpack.train.optim import build_optimizer, build_scheduler
from vlpack.train.setup.module import TrainModule
from vlpack.train.step import optimizer_step
from vlpack.train.trainer import Trainer

peft = pytest.importorskip("peft")
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2", "optim.warmup_steps=0"]


def test_packed_lora_training_equals_padded(samples):
    """3 AdamW steps of LoRA (rank 4, vision adapted too) on the same samples: packed (varlen)
    vs right-padded (sdpa, transformers' own path); the adapters end within 1e-5, the base
    weights do not move."""
    cfg = load_config("tiny", ["optim.lr=1e-2", "optim.warmup_steps=0"])
    runs = {}
    for mode in ("packed", "padded"):
        model, spec = build_model("tiny-qwen3_vl", backend="auto" if mode == "packed" else "sdpa",
                                  dtype=torch.float32, device="cpu", seed=0)
        base = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.manual_seed(1)
        n = lora.apply_lora(model, LoraConfig(rank=4, alpha=8, vision=True))
        assert n > 0
        module = TrainModule(model, spec, loss_method="plain")
        trainable = [p for p in module.parameters() if p.requires_grad]
        opt = build_optimizer(trainable, cfg.optim, device_type="cpu")
        sched = build_scheduler(opt, cfg.optim, 3)
        step_losses = []
        for k in range(3):
            group = samples[3 * k : 3 * k + 3]
            batch = (build_thd_batch(group, pad_token_id=spec.pad_token_id, pad_to_multiple_of=8,
                    mrope_after_video="transformers")
                     if mode == "packed" else build_padded_batch(group, pad_token_id=spec.pad_token_id))
            step_losses.append(optimizer_step(module, opt, sched, [batch], topo=CPU,
                    grad_clip=0.0, aux_coef=0.0).loss)
        params = dict(model.named_parameters())
        moved = [k for k, v in base.items() if not torch.equal(_wrapped(params, k), v)]
        assert not moved, moved[:3]
        runs[mode] = (step_losses, {k: v for k, v in params.items() if "lora_" in k})
    (lp, pp), (lq, pq) = runs["packed"], runs["padded"]
    assert any(".visual." in k for k in pp) and any("language_model" in k for k in pp)
    assert max(abs(a - b) for a, b in zip(lp, lq, strict=True)) <= 1e-5, (lp, lq)
    assert max((pp[k] - pq[k]).abs().max().item() for k in pp) <= 1e-5
    assert max(v.abs().max().item() for k, v in pp.items() if "lora_B" in k) > 0  # it trained


def _wrapped(params: dict, name: str) -> torch.Tensor:
    """A base parameter under its LoRA-wrapped name, where LoRA wrapped its layer."""
    parent, leaf = name.rsplit(".", 1)
    return params.get(f"{parent}.base_layer.{leaf}", params.get(name))


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_adapter_loads_in_peft_and_merged_export_in_transformers(tmp_path: Path):
    """`vlpack train model.lora.rank=4` writes an adapter that `PeftModel.from_pretrained` loads
    on the base model, and (`train.export_hf`) a merged folder the family class loads; both give
    the trained model's logits."""
    from transformers import Qwen3VLForConditionalGeneration

    t = Trainer(small_cfg(tmp_path / "run", "train.max_steps=3", "train.export_hf=true",
                          "train.export_dtype=float32", *LORA), CPU)
    summary = t.fit()
    adapter = Path(summary["adapter"])
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    ids = torch.randint(0, 150000, (1, 23), generator=torch.Generator().manual_seed(0))
    want = _logits(t.model, ids)
    base, _ = build_model("tiny-qwen3_vl", backend="sdpa", dtype=torch.float32, device="cpu", seed=0)
    untrained = _logits(base, ids)
    loaded = peft.PeftModel.from_pretrained(base, str(adapter))
    got = _logits(loaded, ids)
    assert (got - want).abs().max() <= 1e-5
    assert (untrained - want).abs().max() > 1e-3  # the adapter changed the model
    merged = Qwen3VLForConditionalGeneration.from_pretrained(summary["hf_export"])
    assert not any("lora" in k for k in merged.state_dict())
    assert (_logits(merged, ids) - want).abs().max() <= 1e-4
    # the export serves: greedy generation runs and agrees with the adapter loaded in peft
    a = merged.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    b = loaded.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert a.shape == (1, ids.shape[1] + 4) and torch.equal(a, b)


def test_lora_resume_is_exact(tmp_path: Path):
    """4 LoRA steps straight == 2 steps, stop, resume, 2 more (same losses)."""
    Trainer(small_cfg(tmp_path / "a", "train.max_steps=4", *LORA), CPU).fit()
    Trainer(small_cfg(tmp_path / "b", "train.max_steps=4", "train.stop_after=2", *LORA), CPU).fit()
    Trainer(small_cfg(tmp_path / "b", "train.max_steps=4", *LORA), CPU).fit()
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(a) == 4 and a == b[-4:], (a, b)


def test_lora_config_errors():
    model, _ = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu", seed=0)
    with pytest.raises(ValueError, match="matches no linear"):
        lora.apply_lora(model, LoraConfig(rank=4, target_modules=["nope"]))
    with pytest.raises(ValueError, match=r"\['nope'\] match no linear"):
        lora.apply_lora(model, LoraConfig(rank=4, target_modules=["q_proj", "nope"]))
    with pytest.raises(ValueError, match=r"model\.lora\.rank"):
        LoraConfig(rank=-1)
    moe, _ = build_model("tiny-qwen3_5_moe", dtype=torch.float32, device="cpu", seed=0)
    with pytest.raises(ValueError, match=r"\['gate_up_proj'\]: the routed experts"):
        lora.apply_lora(moe, LoraConfig(rank=4, target_modules=["q_proj", "gate_up_proj"]))
    assert lora.apply_lora(moe, LoraConfig(rank=4, target_modules=["q_proj", "down_proj"])) > 0


def test_lora_with_recompute_and_compiled_layers(tmp_path: Path):
    """LoRA under activation checkpointing and whole compiled layers trains as eager LoRA."""
    from vlpack.model.recompute import layer_stacks

    Trainer(small_cfg(tmp_path / "a", "train.max_steps=3", *LORA), CPU).fit()
    t = Trainer(small_cfg(tmp_path / "b", "train.max_steps=3", "model.activation_checkpointing=true",
                          "model.compile=true", "model.compile_scope=layers", *LORA), CPU)
    layers = [x for stack in layer_stacks(t.model).values() for x in stack]
    assert layers and all(getattr(x, "_compiled_call_impl", None) is not None for x in layers)
    t.fit()
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(a) == 3 and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4, (a, b)


def test_lora_targets():
    """Default and named targets stay in the text model; `vision=True` adds every linear of the
    vision tower and its merger (Qwen2.5-VL: gated MLPs and `merger.mlp.0/2`)."""
    model, _ = build_model("tiny-qwen2_5_vl", dtype=torch.float32, device="cpu", seed=0)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    vision = {n for n in linears if ".visual." in f".{n}."}
    assert any(".merger." in n for n in vision) and any("gate_proj" in n for n in vision)
    named = lora.target_names(model, LoraConfig(rank=4, target_modules=["gate_proj", "down_proj"]))
    assert named and not set(named) & vision
    assert all(n.rsplit(".", 1)[-1] in ("gate_proj", "down_proj") for n in named)
    assert set(lora.target_names(model, LoraConfig(rank=4, vision=True))) >= vision
    assert not set(lora.target_names(model, LoraConfig(rank=4))) & vision


def _fused_and_peft_runs(m, x, grad, autocast: bool) -> list[list[torch.Tensor]]:
    """Output and input, A and B gradients of LoRA linear `m` as vlpack runs it, then as peft
    ships it (its own forward, its default input cast)."""
    from peft.tuners.lora.layer import Linear

    runs = []
    for cls, cast in ((type(m), False), (Linear, True)):
        m.__class__, m.cast_input_dtype_enabled = cls, cast
        m.zero_grad()
        leaf = x.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = m(leaf)
        out.float().backward(grad)
        runs.append([out.detach().float(), leaf.grad.float()]
                    + [p.grad.float() for n, p in m.named_parameters() if "lora_" in n])
    m.__class__, m.cast_input_dtype_enabled = lora.fused_lora_linear(), False
    return runs


def test_fused_adapters_equal_peft_and_are_no_farther_from_float32():
    """Every adapted linear runs vlpack's `FusedLoraLinear` (the scale and the sum inside one
    addmm; peft's input cast off). In float32 its output and the input's and adapters'
    gradients equal peft's forward to rounding; under bf16 autocast with the frozen base in bf16
    (a LoRA run on a GPU) they are no farther from float32 than peft's own bf16 path (within a
    quarter of its error), for float32 inputs (after a norm) and bf16 ones (after attention),
    and the output is not peft's bit for bit (the fused path ran: it rounds once, where peft
    rounds after each of its passes). A DoRA adapter runs peft's forward."""
    from vlpack.train.setup.precision import hold_parameters

    model, _ = build_model("tiny-qwen3_5_moe", dtype=torch.float32, device="cpu", seed=0)
    torch.manual_seed(1)
    lora.apply_lora(model, LoraConfig(rank=4, alpha=8))
    adapted = [m for m in model.modules() if hasattr(m, "lora_A")]
    assert adapted and all(type(m) is lora.fused_lora_linear() and not m.cast_input_dtype_enabled
                           for m in adapted)
    m = next(m for n, m in model.named_modules() if n.endswith("linear_attn.in_proj_qkv"))
    torch.nn.init.normal_(m.lora_B["default"].weight, std=0.1)  # B = 0 would hide the adapter
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 37, m.in_features, generator=g)
    grad = torch.randn(2, 37, m.out_features, generator=g)
    truth, stock = _fused_and_peft_runs(m, x, grad, autocast=False)
    for a, b in zip(truth, stock, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    hold_parameters(m, torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16):
        ours, pefts = _fused_and_peft_runs(m, x.to(dtype), grad, autocast=True)
        for i, (a, b, t) in enumerate(zip(ours, pefts, truth, strict=True)):
            err_a, err_b = (float((y - t).norm() / t.norm()) for y in (a, b))
            assert 0 < err_a <= 1.25 * err_b + 1e-4, (dtype, i, err_a, err_b)
        assert not torch.equal(ours[0], pefts[0])
    dora, _ = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu", seed=0)
    lora.apply_lora(dora, LoraConfig(rank=4, alpha=8, use_dora=True))
    d = next(m for m in dora.modules() if hasattr(m, "lora_A"))
    torch.nn.init.normal_(d.lora_B["default"].weight, std=0.1)
    x = torch.randn(3, d.in_features, generator=g)
    ours, pefts = _fused_and_peft_runs(d, x, torch.randn(3, d.out_features, generator=g), False)
    assert all(torch.equal(a, b) for a, b in zip(ours, pefts, strict=True))


def test_lora_on_routed_experts(tmp_path: Path):
    """`model.lora.experts=true` on an MoE family: a rank-r update per expert of the routed
    experts' weights (peft `target_parameters`). Packed (vlpack's dispatch, the adapters as
    grouped factors: no adapted weight is formed) equals unpacked (transformers' experts with
    peft's parametrization W + B·A) in logits and in the adapters' gradients; the adapter loads
    in peft and the merged weights in the plain model, both with the adapted model's logits; a
    dense family is refused."""
    from vlpack.check.run import compare, run_packed, run_unpacked
    from vlpack.model.synthetic import default_mix

    model, spec = build_model("tiny-qwen3_vl_moe", dtype=torch.float32, device="cpu", seed=0)
    lora.apply_lora(model, LoraConfig(rank=4, alpha=8, experts=True))
    adapted = [n for n, p in model.named_parameters() if p.requires_grad and ".experts." in n]
    assert len(adapted) == 4 * len(model.model.language_model.layers)  # A, B × 2 weights
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # stand in for training: B = 0 would leave the model unchanged
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.train()
    mix = default_mix(spec, 4, seed=1)
    calls = []  # how each experts module ran: with factors, or with peft's adapted weight
    for m in model.modules():
        if type(m).__name__.endswith("Experts"):
            m.register_forward_pre_hook(
                lambda m, args, kwargs: calls.append(
                    ("adapters" in kwargs, hasattr(m, "parametrizations"))), with_kwargs=True)
    packed = run_packed(model, spec, mix, 8)
    assert calls and set(calls) == {(True, False)}, set(calls)
    calls.clear()
    d = compare(packed, run_unpacked(model, spec, mix))
    assert calls and set(calls) == {(False, True)}, set(calls)  # the reference: peft's own path
    assert max(d["logits"]) <= 1e-4 and max(d["grad"].values()) <= 1e-4, d

    ids = torch.randint(0, 150000, (1, 19), generator=torch.Generator().manual_seed(0))
    want = _logits(model, ids)
    base, _ = build_model("tiny-qwen3_vl_moe", backend="sdpa", dtype=torch.float32, device="cpu",
                          seed=0)
    untrained = _logits(base, ids)
    assert (untrained - want).abs().max() > 1e-3  # the experts' adapters change the model
    merged = lora.merged_state_dict(model, model.state_dict())
    assert not any("lora" in k or "base_layer" in k for k in merged)
    plain, _ = build_model("tiny-qwen3_vl_moe", backend="sdpa", dtype=torch.float32, device="cpu",
                           seed=0)
    plain.load_state_dict(merged, strict=True)
    assert (_logits(plain, ids) - want).abs().max() <= 1e-4
    lora.save_adapter(model, tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    assert (_logits(loaded, ids) - want).abs().max() <= 1e-5
    dense, _ = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu", seed=0)
    with pytest.raises(ValueError, match="no routed experts"):
        lora.apply_lora(dense, LoraConfig(rank=4, experts=True))
    with pytest.raises(ValueError, match=r"lora\.dropout=0"):
        LoraConfig(rank=4, experts=True, dropout=0.1)


@pytest.mark.parametrize(("family", "cfg"), [
    ("tiny-qwen3_vl", LoraConfig(rank=4, vision=True)),
    ("tiny-qwen3_5", LoraConfig(rank=8)),
    ("tiny-qwen3_vl_moe", LoraConfig(rank=4, experts=True)),
    ("tiny-qwen3_5", LoraConfig(rank=8, vision=True, use_dora=True)),
])
def test_shape_adapters_count_what_peft_adds(family: str, cfg: LoraConfig):
    """The stand-ins the memory plan uses without peft hold peft's trainable weights exactly
    (rank·(in + out) per linear, and `out` more under DoRA; rank·E·(a + b) per expert weight)
    and freeze the same rest."""
    from vlpack.model.build import meta_model

    counts = []
    for adapt in (lora.apply_lora, lora.shape_adapters):
        model = meta_model(family)
        n = adapt(model, cfg)
        params = list(model.parameters())
        counts.append((n, sum(p.numel() for p in params if p.requires_grad),
                       sum(p.numel() for p in params)))
    assert counts[0] == counts[1] and counts[0][1] > 0, counts


def test_dry_run_of_a_lora_recipe_without_peft(monkeypatch, capsys):
    """`vlpack train qwen3-vl-8b-lora --dry-run` plans the same memory with peft made
    unimportable as with peft; building the LoRA model without peft says how to install it."""
    from vlpack.cli import main

    args = ["train", "qwen3-vl-8b-lora", "--dry-run", "--device-memory", "79.2GiB"]
    assert main(args) == 0
    with_peft = capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "peft", None)
    assert main(args) == 0
    assert capsys.readouterr().out == with_peft
    assert "(8.81 B parameters, 0.044 B trainable;" in with_peft
    model, _ = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu", seed=0)
    with pytest.raises(ValueError, match=r"needs peft: pip install 'vlpack\[lora\]'"):
        lora.apply_lora(model, LoraConfig(rank=4))


def test_rslora_scales_by_alpha_over_sqrt_rank():
    """alpha 16, rank 4: every adapted linear scales its update by 16 / 4 = 4.0, under rsLoRA
    by 16 / sqrt(4) = 8.0, and the merged export folds it in with that factor."""
    for rslora, want in ((False, 4.0), (True, 8.0)):
        model, _ = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu", seed=0)
        lora.apply_lora(model, LoraConfig(rank=4, alpha=16, use_rslora=rslora))
        scales = {m.scaling["default"] for m in model.modules() if hasattr(m, "lora_A")}
        assert scales == {want} and lora.lora_scale(model._vlpack_lora) == want
        assert ("rsLoRA" in lora.describe(model)) == rslora
        _check_merged_export(model)


def test_dora_adds_magnitudes_and_starts_as_the_base_model():
    """DoRA adds one trained magnitude per output feature of each adapted linear (initialised
    to the base weight's row norms), so the model's logits at init are the base model's; the
    memory plan counts those magnitudes as trainable; the merged export of a trained adapter
    gives the adapted model's logits; DoRA on the routed experts is refused. The plan adds the
    norm's working memory of the widest adapted linear, the MLP's 64 × 128: 16 · 8,192 bytes
    (peft's layers or the stand-ins without peft)."""
    from vlpack.model.build import meta_model
    from vlpack.train.setup.memory import RunShape, activation_bytes, plan

    ids = torch.randint(0, 150000, (1, 19), generator=torch.Generator().manual_seed(0))
    base, _ = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu", seed=0)
    want = _logits(base, ids)
    model, _ = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu", seed=0)
    cfg = LoraConfig(rank=4, alpha=8, use_dora=True)
    lora.apply_lora(model, cfg)
    adapted = [m for m in model.modules() if hasattr(m, "lora_A")]
    mags = {n: p for n, p in model.named_parameters() if "lora_magnitude_vector" in n}
    assert len(mags) == len(adapted) > 0 and all(p.requires_grad for p in mags.values())
    assert sorted(p.numel() for p in mags.values()) == sorted(m.out_features for m in adapted)
    assert (_logits(model, ids) - want).abs().max() <= 1e-5
    plain = sum(4 * (m.in_features + m.out_features) for m in adapted)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == plain + sum(m.out_features for m in adapted)
    shapes = meta_model("tiny-qwen3_vl")
    lora.apply_lora(shapes, cfg)
    assert plan(shapes, None, world_size=1).trainable == trainable
    run = RunShape(seq_len=16, patches=0)
    assert activation_bytes(shapes, run)["DoRA weight norm"] == 16 * 8192
    stand_ins = meta_model("tiny-qwen3_vl")
    lora.shape_adapters(stand_ins, cfg)
    assert activation_bytes(stand_ins, run)["DoRA weight norm"] == 16 * 8192
    lora.apply_lora(lora_only := meta_model("tiny-qwen3_vl"), LoraConfig(rank=4))
    assert "DoRA weight norm" not in activation_bytes(lora_only, run)
    _check_merged_export(model)
    with pytest.raises(ValueError, match=r"model\.lora\.experts=false, or model\.lora\.use_dora"):
        LoraConfig(rank=4, experts=True, use_dora=True)


def _check_merged_export(model):
    """With random B and magnitudes (trained adapters), the merged state loads in the plain
    model and gives the adapted model's logits."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "lora_magnitude" in n:
                p.mul_(1.5) if "lora_magnitude" in n else p.copy_(
                    0.3 * torch.randn(p.shape, generator=g))
    ids = torch.randint(0, 150000, (1, 19), generator=torch.Generator().manual_seed(1))
    want = _logits(model, ids)
    plain, _ = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu", seed=0)
    assert (_logits(plain, ids) - want).abs().max() > 1e-3  # the adapters change the model
    plain.load_state_dict(lora.merged_state_dict(model, model.state_dict()), strict=True)
    assert (_logits(plain, ids) - want).abs().max() <= 1e-4


def test_dora_and_rslora_train_under_fsdp_and_export(tmp_path: Path):
    """DoRA with rsLoRA: 3 steps under FSDP2 on one process give the plain run's losses, and the
    merged export gathered from the shards (magnitudes in their base weight's group) gives the
    plain run's trained logits."""
    from transformers import Qwen3VLForConditionalGeneration

    from vlpack.train.distributed.parallel import shutdown

    args = ["train.max_steps=3", *LORA, "model.lora.use_dora=true", "model.lora.use_rslora=true"]
    plain = Trainer(small_cfg(tmp_path / "a", *args), CPU)
    plain.fit()
    try:
        summary = Trainer(small_cfg(tmp_path / "b", *args, "train.fsdp=always",
                                    "train.export_hf=true", "train.export_dtype=float32"),
                          CPU).fit()
    finally:
        shutdown()
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(a) == 3 and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)
    ids = torch.randint(0, 150000, (1, 17), generator=torch.Generator().manual_seed(0))
    merged = Qwen3VLForConditionalGeneration.from_pretrained(summary["hf_export"])
    assert (_logits(merged, ids) - _logits(plain.model, ids)).abs().max() <= 1e-4
