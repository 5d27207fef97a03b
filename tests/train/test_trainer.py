"""The trainer (train/trainer.py): exact resume, faults, outputs and export, and its switches."""

from __future__ import annotations

import itertools
import json
import logging
import math
import signal
import time
import types
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import CPU, losses, small_cfg
from vlpack.train.run import checkpoint as ckpt
from vlpack.train.setup.module import module_groups
from vlpack.train.trainer import NonFiniteLossError, Trainer


@pytest.mark.parametrize("extra", [(), ("data.eval_samples=4", "train.eval_every=3",
                                         "model.lora.rank=4", "model.lora.dropout=0.2")])
def test_resume_is_bit_identical(tmp_path: Path, extra: tuple[str, ...]) -> None:
    """6 steps straight == 3 steps, stop (Ctrl-C path saves), resume, 3 more; also where the
    stop's save comes before an evaluation at that step, with LoRA dropout drawing random
    numbers in every step (the evaluation takes none from the training's stream)."""
    straight = Trainer(small_cfg(tmp_path / "a", "train.max_steps=6", *extra), CPU)
    straight.fit()
    interrupted = Trainer(small_cfg(tmp_path / "b", "train.max_steps=6", *extra), CPU)
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
    resumed = Trainer(small_cfg(tmp_path / "b", "train.max_steps=6", *extra), CPU)
    resumed.fit()
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    evals = [[r["eval_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text()
              .splitlines()) if "eval_loss" in r] for run in (tmp_path / "a", tmp_path / "b")]
    assert evals[0] == evals[1] and len(evals[0]) == (2 if extra else 0)
    pa = dict(straight.model.named_parameters())
    assert all(torch.equal(p, pa[n]) for n, p in resumed.model.named_parameters())


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


def test_elapsed_eta_and_the_summary_time_are_wall_clock(tmp_path: Path, monkeypatch) -> None:
    """Under a clock that only an evaluation advances (44 s each), `elapsed_s`, `eta_s` and the
    summary count the evaluations; the step time (`step_s`, the summary's steps share) stays
    apart. A run stopped after step 2 and resumed continues its elapsed time from its
    checkpoint, which is saved before step 2's evaluation: that evaluation's 44 s, like any
    time after a checkpoint, is not carried over."""
    from vlpack.train import trainer
    from vlpack.train.run.metrics import format_summary

    now = [1000.0]
    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(
        perf_counter=time.perf_counter, monotonic=lambda: now[0]))

    def evaluate(self) -> float:
        now[0] += 44.0
        return 2.0

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    args = ("train.max_steps=3", "train.eval_every=1", "data.eval_samples=4")
    summary = Trainer(small_cfg(tmp_path / "a", *args), CPU).fit()
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [(r["elapsed_s"], r["eta_s"]) for r in steps] == [(0.0, None), (44.0, 44.0), (88.0, 0.0)]
    assert summary["elapsed_s"] == 132.0 and 0 < summary["seconds"] < 44
    assert f"  time        132.0s wall clock, {summary['seconds']:.1f}s of it in steps (" in (
        format_summary(summary))
    Trainer(small_cfg(tmp_path / "b", *args, "train.stop_after=2"), CPU).fit()
    now[0] = 5000.0
    resumed = Trainer(small_cfg(tmp_path / "b", *args), CPU).fit()
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["elapsed_s"] for r in rows if "loss" in r] == [0.0, 44.0, 44.0]
    assert resumed["elapsed_s"] == 88.0


def test_per_part_rates_are_logged_and_in_the_metrics(tmp_path: Path, capfd) -> None:
    """optim.lr_vision / lr_merger: the start-up line names every rate, and each metrics row has
    the parts' scheduled rates beside `lr` (warmup over 2 steps: half, then whole)."""
    Trainer(small_cfg(tmp_path, "train.max_steps=2", "optim.warmup_steps=2", "optim.lr_vision=1e-5",
                      "optim.lr_merger=2e-5"), CPU).fit()
    out = capfd.readouterr().out.splitlines()
    assert [x for x in out if x.startswith("vlpack: AdamW")] == [
        "vlpack: AdamW lr 2.00e-03, lr_vision 1.00e-05, lr_merger 2.00e-05; weight decay 0 (none on "
        "norms and biases); warmup 2 steps, the whole run of 2, no decay (optim.warmup_steps "
        "below train.max_steps gives the cosine decay)"]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["lr"], r["lr_vision"], r["lr_merger"]) for r in rows] == [
        pytest.approx((1e-3, 5e-6, 1e-5)), pytest.approx((2e-3, 1e-5, 2e-5))]
    assert "lr_llm" not in rows[0]


def test_run_outputs_metrics_plot_and_summary(tmp_path: Path, capfd) -> None:
    t = Trainer(small_cfg(tmp_path, "train.max_steps=3", "data.eval_samples=4", "train.progress=true",
                          "train.export_hf=true", "train.export_dtype=float32",
                          "train.report_to=[tensorboard]"), CPU)
    summary = t.fit()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for key in ("lr", "grad_norm", "real_tokens", "padded_tokens", "tokens_per_s", "mfu",
                "peak_mem_gib", "peak_reserved_gib", "alloc_retries", "skipped", "packing_efficiency",
                "time", "elapsed_s", "eta_s"):
        assert key in steps[0]
    assert steps[0]["alloc_retries"] is None  # no caching allocator on a CPU
    assert [r["tokens_seen"] for r in steps] == list(itertools.accumulate(r["real_tokens"] for r in steps))
    assert [r["epoch"] for r in steps] == [round(r["samples"] / 20, 4) for r in steps]  # 24 - 4 eval
    assert steps[0]["eta_s"] is None and steps[2]["eta_s"] == 0.0
    # stderr is no terminal here: one plain line per step, then the final save and eval, named
    err = [x for x in capfd.readouterr().err.splitlines() if x.startswith("vlpack: ")]
    assert [x.split(" loss ")[0] for x in err[:3]] == [f"vlpack: step {s}/3" for s in (1, 2, 3)]
    assert err[3] == "vlpack: saving step 3…" and err[4].startswith("vlpack: saved step 3 in ")
    assert err[5:7] == ["vlpack: evaluating step 3…", err[6]] and err[6].startswith(
        "vlpack: evaluated step 3 in ") and err[6].endswith(f": eval loss {summary['eval_loss']:.4f}")
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert summary["eval_loss"] is not None and math.isfinite(summary["eval_loss"])
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3] and evals[0]["eval_loss"] == summary["eval_loss"]
    assert evals[0]["eval_s"] > 0
    # train.report_to mirrors every row (tests/train/run/test_tracking.py reads the trackers back in detail)
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


# --- trainer switches --------------------------------------------------------------------------------
# Trainer switches: freezing, anomaly mode, token-budget accumulation, rows padded to seq_len.
def test_freeze_vision_and_merger_keeps_them_fixed(tmp_path: Path) -> None:
    t = Trainer(small_cfg(tmp_path, "train.max_steps=2", "model.freeze_vision=true",
                          "model.freeze_merger=true"), CPU)
    groups = module_groups(t.model)
    before = {g: [p.detach().clone() for p in ps] for g, ps in groups.items()}
    t.fit()
    for g in ("vision", "merger"):
        assert all(torch.equal(a, p) for a, p in zip(before[g], groups[g], strict=True)), g
    assert any(not torch.equal(a, p) for a, p in zip(before["llm"], groups["llm"], strict=True))


def test_detect_anomaly_runs_the_step_in_anomaly_mode(tmp_path: Path) -> None:
    """`train.detect_anomaly=true` turns autograd's anomaly mode on for the step only."""
    t = Trainer(small_cfg(tmp_path, "train.max_steps=1", "train.detect_anomaly=true"), CPU)
    seen = []
    t.model.model.language_model.norm.register_forward_hook(
        lambda *_: seen.append(torch.is_anomaly_enabled()))
    t.fit()
    assert seen and all(seen) and not torch.is_anomaly_enabled()


def test_token_budget_accumulates_micro_batches(tmp_path: Path) -> None:
    t = Trainer(small_cfg(tmp_path, "train.max_steps=1", "train.tokens_per_step=1200"), CPU)
    mbs = t._next_micro_batches(iter(t.train_loader))
    assert sum(b.num_real_tokens for b in mbs) >= 1200 > sum(b.num_real_tokens for b in mbs[:-1])


def test_pad_to_seq_len_gives_static_rows_and_the_same_loss(tmp_path: Path) -> None:
    a = Trainer(small_cfg(tmp_path / "a", "train.max_steps=1"), CPU)
    b = Trainer(small_cfg(tmp_path / "b", "train.max_steps=1", "data.pad_to_seq_len=true"), CPU)
    rows = [next(iter(t.train_loader)) for t in (a, b)]
    assert rows[1].num_tokens == 512 and rows[0].num_tokens < 512
    assert rows[0].sample_keys == rows[1].sample_keys
    assert abs(a.fit()["last_loss"] - b.fit()["last_loss"]) < 1e-5


# --- run messages ------------------------------------------------------------------------------------
# What a user sees when a run cannot start or changes under a resume: an unwritable output folder, changed
# settings on resume.
def test_unwritable_output_folder_is_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "run"  # below a regular file: no folder can be made there
    with pytest.raises(ValueError, match=rf"train.output_dir={out} is not writable .*choose a"):
        Trainer(small_cfg(out), CPU)



@pytest.mark.parametrize(("change", "order_changes"), [
    ("data.num_workers=2", False), ("data.pad_to_seq_len=true", False),
    ("data.max_bad_fraction=0.5", False), ("data.seq_len=1024", True),
])
def test_resume_warning_names_an_order_change_only_where_there_is_one(
        tmp_path: Path, caplog, change: str, order_changes: bool) -> None:
    """The worker count, padding and bad-sample limits change no sample's place in the stream:
    the resume warning lists them without saying which samples come next changes."""
    from vlpack.train.resume import keep_changed_config

    (tmp_path / "config.yaml").write_text(yaml.safe_dump(small_cfg(tmp_path).to_dict()))
    caplog.set_level(logging.WARNING, logger="vlpack.train")
    keep_changed_config(small_cfg(tmp_path, change), tmp_path / "config.yaml", 3)
    (text,) = [r.getMessage() for r in caplog.records]
    assert f"{change.split('=')[0]} " in text
    assert ("which samples come next" in text) is order_changes, text

def test_resume_with_changed_settings_warns_and_keeps_the_old_config(tmp_path: Path,
                                                                      caplog, capfd) -> None:
    Trainer(small_cfg(tmp_path, "train.max_steps=1", "optim.lr=1e-4", "train.progress=true"),
            CPU).fit()
    err = capfd.readouterr().err  # with train.progress the work after the last step is named
    assert "vlpack: saving step 1…\n" in err and "vlpack: saved step 1 in " in err
    assert f"vlpack: plotting {tmp_path / 'loss.png'}" in err
    caplog.set_level(logging.WARNING, logger="vlpack.train")
    Trainer(small_cfg(tmp_path, "train.max_steps=2", "optim.lr=2e-4", "data.seq_len=1024"),
            CPU).fit()
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "resuming at step 1 with changed settings" in text, text
    assert "data.seq_len 512 → 1024" in text and "optim.lr 0.0001 → 0.0002" in text
    assert "which samples come next" in text and "max_steps" not in text
    old = yaml.safe_load((tmp_path / "config.step00000001.yaml").read_text())
    new = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert (old["optim"]["lr"], new["optim"]["lr"]) == (1e-4, 2e-4)


@pytest.mark.parametrize("change", [["optim.lr=3e-4"], [], ["optim.weight_decay=0.5"]])
def test_a_resumed_run_follows_its_own_rate_and_length(tmp_path: Path, capfd,
                                                       change: list[str]) -> None:
    """A 2-step run resumed with train.max_steps=4 and another optim.lr, or weight decay, or
    nothing else, runs steps 3 and 4 at the rates of a 4-step run started with those settings,
    with their weight decay: the checkpoint brings the optimizer's moments, not its settings.
    The resume says that the rate differs from the checkpoint's schedule."""
    args = ("optim.warmup_steps=1", "optim.min_lr_ratio=0.1")
    straight = Trainer(small_cfg(tmp_path / "s", "train.max_steps=4", *args, *change), CPU)
    straight.fit()
    Trainer(small_cfg(tmp_path / "r", "train.max_steps=2", *args), CPU).fit()
    capfd.readouterr()
    resumed = Trainer(small_cfg(tmp_path / "r", "train.max_steps=4", *args, *change), CPU)
    resumed.fit()
    assert "vlpack: step 3 runs at lr " in capfd.readouterr().out

    def lrs(run: Path) -> list[float]:
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["lr"] for r in rows if "lr" in r]

    assert len(lrs(tmp_path / "r")) == 4
    assert lrs(tmp_path / "r")[2:] == lrs(tmp_path / "s")[2:]
    decay = [[g["weight_decay"] for g in t.optimizer.param_groups] for t in (resumed, straight)]
    assert decay[0] == decay[1]


def test_a_bad_held_out_split_stops_the_run_before_its_first_step(tmp_path: Path) -> None:
    """A missing image among the last data.eval_samples samples breaks max_bad_fraction there
    (1 of 4): the run stops while building, naming the split and the sample, not at its first
    evaluation after training; the same data with the sample inside the training split trains
    (1 of 22 is within the limit)."""
    import shutil

    from vlpack.data.admission import DataLimitError
    from vlpack.data.synth import default_dataset

    data = tmp_path / "data"
    shutil.copytree(default_dataset(n=24).parent, data)
    lines = (data / "data.jsonl").read_text().splitlines()
    ask = [{"from": "human", "value": "<image>\nTotal?"}, {"from": "gpt", "value": "1"}]
    gone = json.dumps({"id": "gone", "conversations": ask, "image": "nope.png"})
    args = (f"data.path={data / 'data.jsonl'}", "data.source=jsonl", "model.init=random",
            "data.eval_samples=4",
            "train.eval_every=1", "train.max_steps=1")
    (data / "data.jsonl").write_text("\n".join([*lines[:-2], gone, *lines[-2:]]) + "\n")
    with pytest.raises(DataLimitError, match=r"the held-out split .*data\.eval_samples=4.*"
                       r"1 of 4 samples were skipped.*Bad samples: gone: .*nope\.png.*"
                       r"\[data\.jsonl:23\]"):
        Trainer(small_cfg(tmp_path / "run", *args), CPU)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    (data / "data.jsonl").write_text("\n".join([gone, *lines]) + "\n")
    Trainer(small_cfg(tmp_path / "ok", *args), CPU).fit()
    assert len(losses(tmp_path / "ok")) == 1


def test_a_finished_run_run_again_adds_no_evaluation(tmp_path: Path) -> None:
    """The same command run again after a run finished trains nothing and evaluates nothing:
    metrics.jsonl keeps one eval row for the last step."""
    args = ("train.max_steps=2", "data.eval_samples=4")
    summaries = [Trainer(small_cfg(tmp_path, *args), CPU).fit() for _ in range(2)]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert summaries[1]["eval_loss"] == summaries[0]["eval_loss"] is not None


def test_a_signal_saves_and_exits_within_its_grace_without_evaluating(tmp_path: Path,
                                                                      monkeypatch) -> None:
    """SIGTERM during step 2, an evaluation due at step 2 that would take 2 s, and
    train.stop_grace_s=1: the run saves step 2 and stops without evaluating, so the grace
    timer (exit 130, "stopped without saving") never fires."""
    from vlpack.train import trainer

    fired: list = []
    monkeypatch.setattr(trainer, "_grace_expired", fired.append)
    t = Trainer(small_cfg(tmp_path, "train.max_steps=4", "data.eval_samples=4",
                          "train.eval_every=2", "train.stop_grace_s=1"), CPU)
    step, evaluated = t.train_step, []

    def signalled(mbs):
        r = step(mbs)
        if t.step == 1:  # the step being run is the second
            t._on_signal(signal.SIGTERM, None)
        return r

    def slow() -> float:
        evaluated.append(t.step)
        time.sleep(2.0)
        return 1.0

    monkeypatch.setattr(t, "train_step", signalled)
    monkeypatch.setattr(t, "evaluate", slow)
    summary = t.fit()
    time.sleep(1.5)  # a timer left running would fire by now
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000002"
    assert t.stop_signal == signal.SIGTERM and evaluated == [] and fired == []
    assert "eval_loss" not in summary or summary["eval_loss"] is None


@pytest.mark.parametrize("edit", [True, False])
def test_resume_warns_when_the_data_file_changed(tmp_path: Path, caplog, edit: bool) -> None:
    """A data file edited between runs is named on resume; an unchanged one is not."""
    import shutil

    from vlpack.data.synth import default_dataset

    data = tmp_path / "data" / "data.jsonl"
    shutil.copytree(default_dataset(n=24).parent, data.parent)
    args = ["data.source=jsonl", f"data.path={data}", "data.shuffle=false", "model.init=random"]
    Trainer(small_cfg(tmp_path / "run", "train.max_steps=1", *args), CPU).fit()
    if edit:
        lines = data.read_text().splitlines()
        data.write_text("\n".join(lines[1:] + lines[:1]) + "\n")  # the same rows, reordered
    caplog.set_level(logging.WARNING, logger="vlpack.train")
    Trainer(small_cfg(tmp_path / "run", "train.max_steps=2", *args), CPU).fit()
    text = " ".join(r.getMessage() for r in caplog.records if r.name == "vlpack.train")
    assert (f"the data file {data} changed since the checkpoint "
            f"{tmp_path / 'run' / 'checkpoints' / 'step_00000001'} was saved" in text) is edit, text


def test_the_first_step_says_what_it_waits_for() -> None:
    from vlpack.config import load_config
    from vlpack.train.trainer import _first_step_waits

    gdn = type("Spec", (), {"has_gdn": True})
    cuda = torch.device("cuda")
    lora = load_config("qwen3.5-35b-a3b-lora")
    assert "fla's Triton autotuning" in _first_step_waits(lora, gdn, cuda, None)
    tuned = _first_step_waits(lora, gdn, cuda, Path("fla_configs/NVIDIA_H200"))
    assert "compiling" in tuned and "NVIDIA_H200" in tuned and "autotuning of" not in tuned
    cpu = torch.device("cpu")
    assert "torch.compile" in _first_step_waits(load_config("qwen3-vl-2b"), gdn, cpu, None)
    assert _first_step_waits(load_config("tiny"), gdn, cpu, None) is None


def test_allocator_retries_are_said_once_from_the_second_step(tmp_path: Path, capfd, monkeypatch) -> None:
    """A step in which PyTorch's caching allocator released its cache and retried (read before
    and after each step) gets one line on stderr, the first time after step 1 (which compiles
    and autotunes): here the counter reads 0, 1 | 1, 1 | 1, 3 | 3, 5 over steps 1-4."""
    from vlpack.train import trainer as trainer_module

    reads = iter([0, 1, 1, 1, 1, 3, 3, 5])
    monkeypatch.setattr(trainer_module, "alloc_retries", lambda device: next(reads))
    Trainer(small_cfg(tmp_path, "train.max_steps=4"), CPU).fit()
    err = [x for x in capfd.readouterr().err.splitlines() if "caching allocator" in x]
    assert len(err) == 1 and err[0].startswith(
        "vlpack: step 3: a CUDA allocation failed for lack of memory 2 time(s) and PyTorch's "
        "caching allocator freed its cache to retry"), err


def test_a_resumed_run_names_its_own_step_and_exempts_its_first() -> None:
    """The note names the run's step (a resumed run's too), never for the process's first step
    (a resume compiles again), and only where the count grew."""
    from vlpack.train.run.metrics import retry_note

    assert retry_note(103, 4, 7, first=False).startswith(
        "step 103: a CUDA allocation failed for lack of memory 3 time(s)")
    assert retry_note(101, 0, 5, first=True) is None
    assert retry_note(103, 7, 7, first=False) is None
    assert retry_note(103, None, None, first=False) is None
