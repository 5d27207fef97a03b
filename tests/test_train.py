"""The trainer: packed == padded training, exact resume, checkpoints, faults, export, outputs."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers import CPU, GradRecorder, losses, small_cfg
from vlpack.config import load_config
from vlpack.data.batch import build_thd_batch
from vlpack.data.padded import build_padded_batch
from vlpack.model.build import build_model
from vlpack.train import checkpoint as ckpt
from vlpack.train.loop import NonFiniteLossError, Trainer
from vlpack.train.module import TrainModule
from vlpack.train.optim import build_optimizer, build_scheduler
from vlpack.train.step import optimizer_step


def test_packed_training_equals_padded_training(samples) -> None:
    """5 AdamW steps on the same samples per step: packed (varlen) vs right-padded (sdpa)."""
    cfg = load_config("tiny", ["optim.lr=1e-3", "optim.warmup_steps=0"])
    runs = {}
    for mode in ("packed", "padded"):
        model, spec = build_model("tiny-qwen3_vl", backend="auto" if mode == "packed" else "sdpa",
                                  dtype=torch.float32, device="cpu", seed=0)
        module = TrainModule(model, spec, loss_method="plain")
        opt = build_optimizer(module.parameters(), cfg.optim, device_type="cpu")
        sched = build_scheduler(opt, cfg.optim, 5)
        step_losses = []
        for k in range(5):
            group = samples[3 * k : 3 * k + 3]
            if mode == "packed":
                batch = build_thd_batch(group, pad_token_id=spec.pad_token_id, pad_to_multiple_of=8)
            else:
                batch = build_padded_batch(group, pad_token_id=spec.pad_token_id)
            step_losses.append(optimizer_step(module, opt, sched, [batch], info=CPU,
                                              grad_clip=1.0).loss)
        runs[mode] = (step_losses, dict(model.named_parameters()))
    (lp, pp), (lq, pq) = runs["packed"], runs["padded"]
    assert max(abs(a - b) for a, b in zip(lp, lq, strict=True)) <= 1e-5, (lp, lq)
    worst = max((pp[n] - pq[n]).abs().max().item() for n in pp)
    assert worst <= 1e-5, worst
    assert lp[-1] < lp[0]


def test_micro_batches_normalise_by_global_token_count(samples) -> None:
    """Two micro-batches of a step == one bin holding the same samples (global token mean):
    the same loss and the same gradient, read where the step hands it to the optimizer."""
    cfg = load_config("tiny")
    runs = []
    for split in (False, True):
        model, spec = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu", seed=0)
        module = TrainModule(model, spec, loss_method="plain")
        opt = GradRecorder(list(model.named_parameters()))
        sched = build_scheduler(opt, cfg.optim, 5)
        groups = [samples[:1], samples[1:5]] if split else [samples[:5]]
        mbs = [build_thd_batch(g, pad_token_id=spec.pad_token_id) for g in groups]
        runs.append((optimizer_step(module, opt, sched, mbs, info=CPU).loss, opt.grads))
    (loss_one, g_one), (loss_split, g_split) = runs
    assert abs(loss_one - loss_split) < 1e-5
    assert set(g_one) == set(g_split)
    worst = max((g_one[n] - g_split[n]).abs().max().item() for n in g_one)
    assert worst < 1e-6


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    """6 steps straight == 3 steps, stop (Ctrl-C path saves), resume, 3 more."""
    straight = Trainer(small_cfg(tmp_path / "a", "train.max_steps=6"), CPU)
    straight.fit()
    interrupted = Trainer(small_cfg(tmp_path / "b", "train.max_steps=6"), CPU)
    original = interrupted.train_step

    def stop_after_three(mbs):
        r = original(mbs)
        if interrupted.step == 2:  # the step being run is the third
            interrupted._stop = True
        return r

    interrupted.train_step = stop_after_three
    interrupted.fit()
    assert interrupted.step == 3
    assert ckpt.latest_checkpoint(tmp_path / "b").name == "step_00000003"
    resumed = Trainer(small_cfg(tmp_path / "b", "train.max_steps=6"), CPU)
    resumed.fit()
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    pa = dict(straight.model.named_parameters())
    assert all(torch.equal(p, pa[n]) for n, p in resumed.model.named_parameters())


def test_interrupted_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    t = Trainer(small_cfg(tmp_path, "train.max_steps=2"), CPU)
    t.fit()
    good = ckpt.latest_checkpoint(tmp_path)
    broken = good.parent / "step_00000009.tmp"  # a save killed half-way
    broken.mkdir()
    (broken / "trainer_rank0.pt").write_bytes(b"partial")
    assert ckpt.latest_checkpoint(tmp_path) == good


def test_non_finite_loss_stops_with_a_clear_error(tmp_path: Path) -> None:
    t = Trainer(small_cfg(tmp_path, "train.max_steps=4", "train.save_every=1"), CPU)
    original = t.train_step

    def poison(mbs):
        if t.step == 2:
            with torch.no_grad():
                next(t.model.parameters()).fill_(float("nan"))
        return original(mbs)

    t.train_step = poison
    with pytest.raises(NonFiniteLossError, match=r"last good checkpoint is .*step_00000002"):
        t.fit()
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000002"


def test_run_outputs_metrics_plot_and_summary(tmp_path: Path, capfd) -> None:
    t = Trainer(small_cfg(tmp_path, "train.max_steps=3", "data.eval_samples=4", "train.progress=true",
                          "train.export_hf=true", "train.export_dtype=float32",
                          "train.report_to=[tensorboard]"), CPU)
    summary = t.fit()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for key in ("lr", "grad_norm", "real_tokens", "padded_tokens", "tokens_per_s", "mfu",
                "peak_mem_gib", "peak_reserved_gib", "skipped", "packing_efficiency", "time",
                "elapsed_s", "eta_s"):
        assert key in steps[0]
    assert [r["tokens_seen"] for r in steps] == list(itertools.accumulate(r["real_tokens"] for r in steps))
    assert [r["epoch"] for r in steps] == [round(r["samples"] / 20, 4) for r in steps]  # 24 - 4 eval
    assert steps[0]["eta_s"] is None and steps[2]["eta_s"] == 0.0
    # stderr is no terminal here: one plain line per step, then the final eval and save, named
    err = [x for x in capfd.readouterr().err.splitlines() if x.startswith("vlpack: ")]
    assert [x.split(" loss ")[0] for x in err[:3]] == [f"vlpack: step {s}/3" for s in (1, 2, 3)]
    assert err[3:5] == ["vlpack: evaluating step 3…", err[4]] and err[4].startswith(
        "vlpack: evaluated step 3 in ") and err[4].endswith(f": eval loss {summary['eval_loss']:.4f}")
    assert err[5] == "vlpack: saving step 3…" and err[6].startswith("vlpack: saved step 3 in ")
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert summary["eval_loss"] is not None and math.isfinite(summary["eval_loss"])
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3] and evals[0]["eval_loss"] == summary["eval_loss"]
    assert evals[0]["eval_s"] > 0
    # train.report_to mirrors every row (tests/test_tracking.py reads the trackers back in detail)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [
        (r["step"], pytest.approx(r["loss"])) for r in steps]
    assert [(e.step, e.value) for e in acc.Scalars("eval_loss")] == [(3, pytest.approx(summary["eval_loss"]))]
    assert summary["steps"] == 3 and summary["samples"] > 0

    # The HF export loads in transformers and fine-tunes further as model.name=FOLDER.
    import transformers

    hf = Path(summary["hf_export"])
    reloaded = transformers.Qwen3VLForConditionalGeneration.from_pretrained(hf)
    for n, p in t.model.named_parameters():
        torch.testing.assert_close(reloaded.get_parameter(n), p, rtol=0, atol=0)
    # A folder's own chat template renders the next run's samples and travels to its export.
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}"
                "{{ m.content }}{% else %}{% for c in m.content %}{% if c.type == 'image' %}"
                "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c.text }}{% endif %}"
                "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}")
    (hf / "chat_template.jinja").write_text(template)
    again = Trainer(small_cfg(tmp_path / "ft", "train.max_steps=1", f"model.name={hf}"), CPU)
    assert again.encoder.chat_template.file == str(hf / "chat_template.jinja")
    assert again.fit()["steps"] == 1
    # data.chat_template=FILE overrides the folder's, and the export carries the one used
    other = tmp_path / "other.jinja"
    other.write_text(template.replace("<|im_end|>\n", "<|im_end|>\n\n"))
    third = Trainer(small_cfg(tmp_path / "ft2", "train.max_steps=1", f"model.name={hf}",
                              f"data.chat_template={other}", "train.export_hf=true"), CPU)
    summary = third.fit()
    assert (Path(summary["hf_export"]) / "chat_template.jinja").read_text() == other.read_text()


def test_sample_mean_loss_equals_per_sample_reference(samples) -> None:
    """train.loss_norm=sample: packed and padded steps equal the mean of per-sample token means
    computed one sample at a time with stock transformers."""
    from vlpack.model.forward import unpacked_forward

    group = samples[:4]
    model, spec = build_model("tiny-qwen3_vl", backend="sdpa", dtype=torch.float32, device="cpu",
                              seed=0)
    per_sample = []
    for s in group:
        out = unpacked_forward(model, s, spec=spec)
        per_sample.append(float(out.loss_sum.detach()) / out.num_label_tokens)
    want = sum(per_sample) / len(per_sample)
    cfg = load_config("tiny")
    for mode in ("packed", "padded"):
        m, _ = build_model("tiny-qwen3_vl", backend="auto" if mode == "packed" else "sdpa",
                           dtype=torch.float32, device="cpu", seed=0)
        module = TrainModule(m, spec, loss_method="chunked")
        opt = torch.optim.SGD(module.parameters(), lr=0.0)
        batch = (build_thd_batch(group, pad_token_id=spec.pad_token_id, pad_to_multiple_of=8)
                 if mode == "packed" else build_padded_batch(group, pad_token_id=spec.pad_token_id))
        r = optimizer_step(module, opt, build_scheduler(opt, cfg.optim, 5), [batch], info=CPU,
                           loss_norm="sample")
        assert r.samples == 4
        assert abs(r.loss - want) < 1e-5, (mode, r.loss, want)


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
