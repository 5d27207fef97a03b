"""The trainer: builds model, data and optimizer, runs the packed SFT loop, checkpoints and resumes.

One optimizer step = `train.micro_batches` bins per rank (or as many as `train.tokens_per_step`
real tokens need, agreed across ranks). The loss of a step is the global token mean: the summed
cross-entropy over every label token of every micro-batch on every rank, divided by the
all-reduced label-token count, so packed and unpacked training of the same samples give the
same gradients (`train.loss_norm=sample` averages per-sample means instead).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from vlpack.config import Config, save_config
from vlpack.data.accounting import Tally
from vlpack.data.loader import build_loaders, data_fingerprints
from vlpack.train.distributed.parallel import (
    Topology,
    all_gather_object,
    all_reduce,
    barrier,
    context_group,
    init_distributed,
    per_replica,
)
from vlpack.train.epochs import steps_for_epochs
from vlpack.train.optim import (
    build_optimizer,
    build_scheduler,
    describe,
    group_settings,
    own_rates,
    resumed_scheduler,
)
from vlpack.train.resume import keep_changed_config, resumed_bins, run_id, warn_changed_data
from vlpack.train.run import checkpoint as ckpt
from vlpack.train.run.export import export_live, export_live_adapter
from vlpack.train.run.generate import HeldOutGeneration
from vlpack.train.run.metrics import MetricsWriter, alloc_retries, epoch_of, retry_note, step_row
from vlpack.train.run.plot import missing_matplotlib, plot_runs
from vlpack.train.run.profile import StepProfiler
from vlpack.train.run.progress import Eta, Progress
from vlpack.train.run.runlock import claim_output_dir
from vlpack.train.run.tracking import Tracker, start_trackers
from vlpack.train.setup import memory
from vlpack.train.setup.flops import peak_flops
from vlpack.train.setup.module import module_groups
from vlpack.train.setup.stack import build_stack
from vlpack.train.step import StepResult, optimizer_step

log = logging.getLogger("vlpack.train")


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the last good checkpoint is kept."""


class RunOutOfMemoryError(RuntimeError):
    """The accelerator ran out of memory in a step; the message says where and the ways out."""


REPEAT_S = 2.0
"""A second signal within this many seconds of the first is taken as the same interrupt."""
EXIT_STOPPED = 75
"""Exit status of a run stopped by SIGINT/SIGTERM after saving its checkpoint (EX_TEMPFAIL: run
the same command again to resume)."""
EXIT_ABORTED = 130
"""Exit status of a run aborted by a second signal, without saving."""


class Trainer:
    """Builds model, data, optimizer; runs, checkpoints and resumes."""

    def __init__(self, cfg: Config, topo: Topology | None = None):
        from vlpack.data.setup import build_encoder

        self.cfg = cfg
        self.topo = topo or init_distributed(cfg.parallel.cp)
        if self.topo.cp != cfg.parallel.cp:
            raise ValueError(f"the topology's cp={self.topo.cp} is not parallel.cp="
                             f"{cfg.parallel.cp}: build it with init_distributed(cfg.parallel.cp)")
        self.context = context_group(self.topo)
        """This rank's context-parallel group; its ranks read the same rows and split each."""
        _check_writable(Path(cfg.train.output_dir))
        claim_output_dir(cfg.train.output_dir, self.topo)  # one run per folder at a time
        self.run_id: str | None = run_id(cfg)
        # before the model is built: a tracker that cannot start ends the run in seconds
        self.trackers: list[Tracker] = start_trackers(
            cfg.train.report_to, out_dir=cfg.train.output_dir, run_id=self.run_id,
            errors=cfg.train.report_to_errors, topo=self.topo)
        stack = build_stack(cfg, self.topo, context=self.context, resumed_bins=resumed_bins(cfg))
        self.model, self.spec, self.module = stack.model, stack.spec, stack.module
        self.flops, self.autocast = stack.flops, stack.autocast
        self.plan, self.ways_out = stack.plan, stack.ways_out
        self.tuned_kernels = stack.tuned_kernels
        self.optimizer = build_optimizer(self.module.parameters(), cfg.optim,
                                         device_type="cpu" if cfg.train.cpu_offload
                                         else self.topo.device.type,
                                         parts=module_groups(self.model))

        self.encoder = build_encoder(cfg.data, self.spec, cfg.model.name,
                                     announce=self.topo.is_main)
        self.train_loader, self.eval_loader = self._loaders()
        self.data_files = data_fingerprints(cfg.data)
        """Fingerprint of each data file by path, kept in checkpoints to notice edited data."""
        self.held_out_generation = HeldOutGeneration(
            self.eval_loader, self.encoder, cfg.train.eval_generate_samples,
            cfg.train.eval_generate_max_new_tokens) if cfg.train.eval_generate_every else None
        if cfg.train.epochs is not None:  # the steps of that many passes, before the schedule
            cfg.train.max_steps, bins = steps_for_epochs(
                self.train_loader, cfg.train.epochs, dp=self.topo.dp, micro_batches=cfg.train.micro_batches)
            if self.topo.is_main:
                print(f"vlpack: train.epochs={cfg.train.epochs}: {bins} planned bins, "
                      f"train.max_steps={cfg.train.max_steps}", flush=True)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.max_steps)
        self.own_rates = own_rates(cfg.optim, module_groups(self.model))
        """`optim.lr_<part>` of the parts training at their own rate (metrics' `lr_<part>`)."""
        if self.topo.is_main:
            print(describe(cfg.optim, self.own_rates, cfg.train.max_steps), flush=True)
        self.step = 0
        self.totals = {"samples": 0, "real_tokens": 0, "tokens": 0, "seconds": 0.0}
        self._elapsed_before = 0.0  # wall-clock seconds of the earlier processes of this run
        self._started_at: float | None = None  # time.monotonic() when this process began training
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.eval_loss: float | None = None
        self.last_checkpoint: Path | None = None
        self.stop_signal: int | None = None  # the signal that stopped the run
        self._signal_at = 0.0
        self._grace_timer: threading.Timer | None = None
        self._stop = False
        self.progress = Progress(total=cfg.train.max_steps, initial=0, log_every=1, enabled=False)
        """The live view; `fit` shows it on rank 0 with train.progress."""

    # ------------------------------------------------------------------ data

    def _loaders(self):
        t = self.cfg.train
        return build_loaders(
            self.cfg.data, self.encoder, seed=t.seed, rank=self.topo.dp_rank,
            world_size=self.topo.dp,  # data-parallel: a context group shares rows
            per_round=t.micro_batches if t.tokens_per_step is None else 1,
            pad_token_id=self.spec.pad_token_id, spatial_merge_size=self.spec.merge_size,
            pin_memory=self.topo.device.type == "cuda", show_progress=t.progress and self.topo.is_main,
            report_skips=self.context.rank == 0)

    def _next_micro_batches(self, it) -> list:
        """This step's micro-batches; with a token budget every rank takes another one while
        any rank is still short (the same count everywhere, or collectives would hang)."""
        t = self.cfg.train
        if t.tokens_per_step is None:
            return [next(it) for _ in range(t.micro_batches)]
        mbs: list = []
        while True:
            mbs.append(next(it))
            short = sum(b.num_real_tokens for b in mbs) < t.tokens_per_step
            if not all_reduce([float(short)], self.topo, "max")[0]:
                return mbs

    # ------------------------------------------------------------------ step

    def _autocast(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.topo.device.type, dtype=self.autocast)

    def train_step(self, mbs: list) -> StepResult:
        """One optimizer step over this rank's micro-batches (see `optimizer_step`)."""
        t0 = time.perf_counter()
        stats = [  # host-side figures, before the batches move
            sum(b.num_real_tokens for b in mbs),
            sum(b.num_tokens for b in mbs),
            sum(self.flops.of_batch(b) for b in mbs),
            sum(self.flops.recomputed_of_batch(b) for b in mbs),
        ]
        # Pinned host batches (DataLoader pin_memory) copy asynchronously, overlapping compute.
        mbs = [b.to(self.topo.device, non_blocking=True) for b in mbs]
        anomaly = (torch.autograd.set_detect_anomaly(True, check_nan=False)
                   if self.cfg.train.detect_anomaly else contextlib.nullcontext())
        with anomaly:
            r = optimizer_step(
                self.module, self.optimizer, self.scheduler, mbs, topo=self.topo,
                loss_norm=self.cfg.train.loss_norm, aux_coef=self.cfg.train.aux_loss_coef,
                grad_clip=self.cfg.optim.grad_clip, autocast=self.autocast,
            )
        if not (math.isfinite(r.loss) and math.isfinite(r.grad_norm)):
            raise NonFiniteLossError(
                f"step {self.step + 1}: loss {r.loss} / grad norm {r.grad_norm} is not finite; "
                f"stopping. The last good checkpoint is {self.last_checkpoint or 'none'}; lower "
                "optim.lr or check the data, then resume with train.resume=auto"
            )
        real, tokens, flops, recomputed = all_reduce(stats, self.topo, axis="dp")
        # no wait for the optimizer's kernels here: the step's one host wait (after the backward,
        # optimizer_step) bounds each step, and the update's GPU time counts in the next step
        r.real_tokens, r.tokens, r.flops = int(real), int(tokens), flops
        r.flops_recomputed = recomputed
        r.seconds = time.perf_counter() - t0
        return r

    # ------------------------------------------------------------------ eval

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Token-mean loss over the held-out split (same packing)."""
        if self.eval_loader is None:
            return None
        self.module.eval()
        loss_sum, n = 0.0, 0
        self.eval_loader.load_state_dict({"consumed": 0})
        for b in self.eval_loader:
            with self._autocast():
                out = self.module(b)
            loss_sum += float(out.loss_sum)
            n += out.num_label_tokens
        loss_sum, n = all_reduce([loss_sum, n], self.topo)
        return loss_sum / n if n else None

    # ------------------------------------------------------------------ state

    def elapsed(self) -> float:
        """Wall-clock seconds since training started (evaluations and saves included), the
        earlier processes of a resumed run included."""
        if self._started_at is None:
            return self._elapsed_before
        return self._elapsed_before + time.monotonic() - self._started_at

    def state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "loader": self.train_loader.state_dict(),
            "totals": dict(self.totals),
            "elapsed_s": self.elapsed(),
            "first_loss": self.first_loss,
            "last_loss": self.last_loss,
            "data_files": self.data_files,
        }

    def save(self) -> Path:
        with self.progress.phase(f"saving step {self.step}", f"saved step {self.step}") as done:
            self.last_checkpoint = ckpt.save_checkpoint(
                self.cfg.train.output_dir, self.step, self.module, self.optimizer, self.state(),
                self.topo, run_id=self.run_id, keep=self.cfg.train.keep_checkpoints,
            )
            done["detail"] = f": {self.last_checkpoint}"
        if self._grace_timer is not None:  # a signal's checkpoint is saved: in time
            self._grace_timer.cancel()
        return self.last_checkpoint

    def _claim_output_dir(self) -> None:
        """A fresh run owns its output folder: another run's checkpoints there are refused, or
        deleted with train.overwrite=true (with the old metrics), before anything is written."""
        t = self.cfg.train
        out = Path(t.output_dir)
        other = ckpt.latest_checkpoint(out)
        if other is None:
            return
        if not t.overwrite:
            raise ValueError(
                f"{out} holds checkpoints of another run (latest {other.name}); train.resume=none "
                "would mix two runs in one folder. Continue that run with train.resume=auto, "
                "choose another train.output_dir, or delete them with train.overwrite=true"
            )
        barrier(self.topo)  # every rank has looked before the main rank deletes
        if self.topo.is_main:
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
            (out / "metrics.jsonl").unlink(missing_ok=True)
            print(f"vlpack: train.overwrite=true: deleted the checkpoints and metrics in {out}")
        barrier(self.topo)

    def maybe_resume(self) -> Path | None:
        r = self.cfg.train.resume
        if r == "none":
            self._claim_output_dir()
            return None
        path = ckpt.latest_checkpoint(self.cfg.train.output_dir) if r == "auto" else Path(r)
        if path is None:
            return None
        if not path.is_dir():
            raise ValueError(f"train.resume={r}: {path} is not a checkpoint folder")
        checked = (path / ckpt.MARKER).is_file()
        if checked:  # the files' digests, before anything is loaded
            path = ckpt.resume_point(path, self.topo,
                                     fallback=r == "auto" and self.cfg.train.resume_fallback)
        step = int(ckpt.marker(path)["step"]) if checked else None
        if step is not None and step > self.cfg.train.max_steps:
            raise ValueError(
                f"{path} is at step {step}, past train.max_steps={self.cfg.train.max_steps}: "
                "raise train.max_steps to train it further, or start anew in another "
                "train.output_dir (or here with train.resume=none train.overwrite=true)"
            )
        settings = group_settings(self.optimizer)
        st = ckpt.load_checkpoint(path, self.module, self.optimizer, self.topo, verify=not checked)
        self.run_id = ckpt.marker(path).get("run_id")
        self.step = st["step"]
        saved_lr = float(self.optimizer.param_groups[0]["lr"])  # the checkpoint's (a tensor in
        # torchao's AdamW8bit), for the note below
        self.scheduler = resumed_scheduler(self.optimizer, settings, self.cfg.optim,
                                           self.cfg.train.max_steps,
                                           st["scheduler"]["last_epoch"])
        if (lr := float(self.scheduler.get_last_lr()[0])) != saved_lr and self.topo.is_main:
            print(f"vlpack: step {self.step + 1} runs at lr {lr:.2e}, where the checkpoint's "
                  f"schedule had {saved_lr:.2e}: the schedule follows this run's optim.* and "
                  f"train.max_steps={self.cfg.train.max_steps}")
        self.train_loader.load_state_dict(st["loader"])
        self.totals = st["totals"]
        self._elapsed_before = st.get("elapsed_s", self.totals["seconds"])  # else its step time
        self.first_loss, self.last_loss = st["first_loss"], st["last_loss"]
        self.last_checkpoint = path
        warn_changed_data(st.get("data_files", {}), self.data_files, path)
        return path

    # ------------------------------------------------------------------ loop

    def _on_signal(self, signum, frame) -> None:
        """SIGINT/SIGTERM on any rank: finish the step, save, exit (the ranks agree at the step
        boundary). A second signal aborts at once; one arriving within REPEAT_S of the first is
        the same interrupt relayed (torchrun passes a terminal's Ctrl-C on to every worker)."""
        now = time.monotonic()
        if self.stop_signal is not None:
            if now - self._signal_at >= REPEAT_S:
                # at once, wherever the run is (a save in progress included: its .tmp folder is
                # never taken for a checkpoint); no exception a library could catch or wrap
                print("\nvlpack: interrupted again: stopped without saving; the last complete "
                      "checkpoint stays the resume point", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(EXIT_ABORTED)
            return
        self.stop_signal, self._signal_at = signum, now
        self._stop = True
        grace = self.cfg.train.stop_grace_s
        if grace is not None:
            self._grace_timer = threading.Timer(grace, _grace_expired, (grace,))
            self._grace_timer.daemon = True
            self._grace_timer.start()
        if self.topo.is_main:
            name = signal.Signals(signum).name
            within = f" within {grace:g} s" if grace is not None else ""
            print(f"\nvlpack: {name}: finishing this step, saving a checkpoint{within}, exiting "
                  f"(exit status {EXIT_STOPPED}; send it again to abort without saving)", flush=True)

    def fit(self) -> dict[str, Any]:
        """Train to `train.max_steps`; return the summary."""
        cfg, topo = self.cfg, self.topo
        out_dir = Path(cfg.train.output_dir)
        resumed = self.maybe_resume()
        if topo.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            if resumed:
                keep_changed_config(cfg, out_dir / "config.yaml", self.step)
            save_config(cfg, out_dir / "config.yaml")
            if resumed:
                print(f"vlpack: resumed from {resumed} at step {self.step}")
                if self.step >= cfg.train.max_steps:
                    print(f"vlpack: that run already reached train.max_steps={cfg.train.max_steps}"
                          ": nothing to train (raise train.max_steps to continue it)")
        handled = (signal.SIGINT, signal.SIGTERM)
        old = {s: signal.signal(s, self._on_signal) for s in handled}
        trackers = self.trackers  # started in __init__; the config and resume point known now
        for tracker in trackers:
            tracker.begin(cfg.to_dict(), self.step)
        writer = MetricsWriter(out_dir / "metrics.jsonl", resume_step=self.step, enabled=topo.is_main,
                               mirrors=tuple(trackers))
        peak = peak_flops(topo.device)
        self.progress = Progress(total=cfg.train.max_steps, initial=self.step,
                                 log_every=cfg.train.log_every,
                                 enabled=cfg.train.progress and topo.is_main)
        eta = Eta(self.step, cfg.train.max_steps)
        self._started_at = time.monotonic()
        it = iter(self.train_loader)
        first_step = self.step
        profiler = StepProfiler(out_dir / f"profile_rank{topo.rank}.txt", device=topo.device,
                                start=cfg.train.profile_from, count=cfg.train.profile_steps)
        plain_s, plain_n = 0.0, 0  # unprofiled step time after the first, the profile's reference
        told_retries = False  # retry_note, said once a run (metrics.jsonl counts every retry)
        stop = False  # whether the ranks agreed to stop early, after a step
        try:
            while self.step < cfg.train.max_steps:
                t_data = time.perf_counter()
                mbs = self._next_micro_batches(it)
                data_wait = time.perf_counter() - t_data
                if topo.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(topo.device)
                if self.step == first_step and topo.is_main and (w := _first_step_waits(
                        cfg, self.spec, topo.device, self.tuned_kernels)):
                    print(f"vlpack: step {self.step + 1} waits for {w}", flush=True)
                profiler.before(self.step + 1)
                retries = alloc_retries(topo.device)
                try:
                    r = self.train_step(mbs)
                except torch.OutOfMemoryError:
                    raise RunOutOfMemoryError(self._oom_message()) from None
                self.step += 1
                note = retry_note(self.step, retries, alloc_retries(topo.device),
                                  first=self.step == first_step + 1)
                if note and not told_retries:
                    told_retries = True
                    rank = f"rank {topo.rank}, " if topo.world_size > 1 else ""
                    print(f"vlpack: {rank}{note}", file=sys.stderr, flush=True)
                if not profiler.covers(self.step) and self.step > 1:
                    plain_s, plain_n = plain_s + r.seconds, plain_n + 1
                profiler.after(self.step, plain_s / plain_n if plain_n else None)
                self._record(r, data_wait, peak, writer, eta.update(self.step, time.monotonic()))
                if cfg.train.stop_after and self.step - first_step >= cfg.train.stop_after:
                    self._stop = self.step < cfg.train.max_steps
                # every rank learns whether any rank was signalled (and by which signal)
                flag = self.stop_signal or (0.5 if self._stop else 0.0)
                flag = all_reduce([float(flag)], topo, "max")[0]
                stop = flag > 0
                if flag >= 1:
                    self._stop, self.stop_signal = True, int(flag)
                if stop or (cfg.train.save_every and self.step % cfg.train.save_every == 0):
                    self.save()  # before evaluating: an evaluation that fails loses no step
                if flag < 1:  # unless signalled (every rank agrees): then exit once saved
                    if cfg.train.eval_every and self.step % cfg.train.eval_every == 0:
                        self._eval(writer)
                    if (cfg.train.eval_generate_every
                            and self.step % cfg.train.eval_generate_every == 0):
                        self._eval_generate(writer)
                if stop:
                    break
            if not stop:  # as every rank agreed after the last step, whatever comes since
                saved = self.last_checkpoint and self.last_checkpoint.name.endswith(
                    f"{self.step:08d}")
                if cfg.train.save_final and not saved:
                    self.save()  # before the final evaluation, as in the loop
                # the final evaluation, unless this step has one (the last step's, or an
                # earlier process's where a finished run is run again: its loss is reported);
                # the main rank's rows decide
                done = all_reduce([float(self.step in writer.evaluated)], topo, "max")[0]
                if not done and self.eval_loader is not None:
                    self._eval(writer)
                elif done and self.eval_loss is None:  # evaluated by an earlier process
                    self.eval_loss = writer.evaluated.get(self.step)
        finally:
            self.progress.close()
            writer.close()
            for tracker in trackers:
                tracker.close()
            if self.stop_signal is None:  # once signalled, a further signal aborts at once,
                for sig, handler in old.items():  # until the process ends
                    signal.signal(sig, handler)
        return self._finish(out_dir)

    def _oom_message(self) -> str:
        """One paragraph for an out-of-memory step: where, how much, the plan, the ways out."""
        dev = self.topo.device
        peak = (torch.cuda.max_memory_allocated(dev) / memory.GIB if dev.type == "cuda"
                else float("nan"))
        total = (torch.cuda.get_device_properties(dev).total_memory / memory.GIB
                 if dev.type == "cuda" else float("nan"))
        p = self.plan
        acts = sum(p.activations.values()) / memory.GIB
        auto = (f", model.checkpoint_share=auto having chosen {p.recompute_share!r} from it"
                if self.cfg.model.activation_checkpointing
                and self.cfg.model.checkpoint_share == "auto" else "")
        return (f"out of {dev.type} memory in step {self.step + 1} (rank {self.topo.rank}): "
                f"PyTorch had allocated up to {peak:.1f} GiB of the device's {total:.1f} GiB; the "
                f"memory plan counted {p.train_bytes / memory.GIB:.1f} GiB ({acts:.1f} GiB of it "
                f"activations for data.seq_len={self.cfg.data.seq_len}{auto}). The last good checkpoint "
                f"is {self.last_checkpoint or 'none'}. Ways out: " + "; ".join(self.ways_out)
                + ". `vlpack train ... --dry-run` prints the plan of a setting without training")

    def _eval(self, writer: MetricsWriter) -> None:
        with self.progress.phase(f"evaluating step {self.step}", f"evaluated step {self.step}") as done:
            self.eval_loss = self.evaluate()
            done["detail"] = f": eval loss {self.eval_loss:.4f}" if self.eval_loss is not None else ""
        writer.write({"step": self.step, "samples": self.totals["samples"], "eval_loss": self.eval_loss,
                      "eval_s": done["seconds"]})

    def _eval_generate(self, writer: MetricsWriter) -> None:
        """Generate and score held-out answers (train.eval_generate_every; every rank)."""
        assert self.held_out_generation is not None
        with self.progress.phase(f"generating step {self.step}", f"generated step {self.step}") as done, \
                self._autocast():
            row = self.held_out_generation(self.model, self.spec, self.topo.world_size)
            done["detail"] = f": token F1 {row['gen_token_f1']:.3f}"
        writer.write({"step": self.step, "samples": self.totals["samples"], **row,
                      "eval_generate_s": done["seconds"]})

    def _record(self, r: StepResult, data_wait: float, peak, writer, eta_s: float | None) -> None:
        t = self.totals
        t["samples"] += r.samples
        t["real_tokens"] += r.real_tokens
        t["tokens"] += r.tokens
        t["seconds"] += r.seconds + data_wait
        self.first_loss = r.loss if self.first_loss is None else self.first_loss
        self.last_loss = r.loss
        row = step_row(self.step, r, data_wait=data_wait, totals=t, peak_flops=peak,
                       world_size=self.topo.world_size, device=self.topo.device, eta_s=eta_s,
                       elapsed_s=self.elapsed())
        at = r.lr / float(self.scheduler.base_lrs[0])  # the schedule's factor, alike for every rate
        row.update({k: rate * at for k, rate in self.own_rates.items()})
        if self.step % self.cfg.train.log_every == 0:  # the same steps on every rank
            acc = self.accounting()
            row.update(skipped=sum(acc["skipped"].values()), truncated=acc["truncated"],
                       epoch=epoch_of(acc, len(getattr(self.train_loader, "items", ()))))
            if "sources" in acc:  # data.mix: samples trained from each source so far
                row["sources"] = acc["sources"]
            writer.write(row)
        self.progress.step(row)

    def _say(self, what: str) -> None:
        """One line on stderr for work after the progress bar closed (with train.progress)."""
        if self.cfg.train.progress and self.topo.is_main:
            print(f"vlpack: {what}", file=sys.stderr, flush=True)

    def accounting(self) -> dict[str, Any]:
        """Where the samples consumed so far went, summed over ranks (a collective)."""
        states = all_gather_object(self.train_loader.tally.state(), self.topo)
        return Tally.merged(per_replica(states, self.topo)).as_dict()

    def _finish(self, out_dir: Path) -> dict[str, Any]:
        self.train_loader.summarize_skips()
        acc = self.accounting()
        barrier(self.topo)  # no rank leaves for teardown while another is still in the gather
        summary = {
            "steps": self.step, "samples": self.totals["samples"], "truncated": acc["truncated"],
            "skipped": acc["skipped"], "epochs": acc["epochs"], "real_tokens": self.totals["real_tokens"],
            **({"sources": acc["sources"]} if "sources" in acc else {}),
            "tokens": self.totals["tokens"], "first_loss": self.first_loss,
            "last_loss": self.last_loss, "eval_loss": self.eval_loss,
            "seconds": self.totals["seconds"], "elapsed_s": self.elapsed(),
            "tokens_per_s": self.totals["real_tokens"] / max(self.totals["seconds"], 1e-9),
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "metrics": str(out_dir / "metrics.jsonl"), "plot": None,
        }
        if self.cfg.model.lora.rank:
            self._say("writing the LoRA adapter")
            summary["adapter"] = str(export_live_adapter(self.model, out_dir / "adapter", self.topo,
                                                         base=self.cfg.model.name))
        if self.cfg.train.export_hf:
            self._say("exporting the HF folder")
            hf = export_live(self.model, out_dir / "hf", self.topo, self.cfg,
                             out_dtype=self.cfg.train.export_dtype)
            summary["hf_export"] = str(hf)
        if self.topo.is_main and (why := missing_matplotlib()):
            summary["plot_skipped"] = f"no loss.png: {why}"
            log.info(summary["plot_skipped"])
        elif self.topo.is_main:
            self._say(f"plotting {out_dir / 'loss.png'}")
            summary["plot"] = str(plot_runs([out_dir], out_dir / "loss.png"))
        return summary


def _first_step_waits(cfg: Config, spec, device: torch.device, tuned: Path | None) -> str | None:
    """What the first step of a run waits for beyond its own work (None: nothing); `tuned`:
    the folder of fla kernel configurations in use (train/setup/kernel_cache.py)."""
    waits = []
    if device.type == "cuda" and spec.has_gdn:
        waits.append(
            f"Triton compiling fla's Gated-DeltaNet kernels in the configurations of {tuned.name} "
            "(under a minute on a fresh machine; a kernel whose shape has none autotunes)"
            if tuned is not None else
            "fla's Triton autotuning of the Gated-DeltaNet kernels (minutes on a fresh machine: "
            "about 3 for Qwen3.5-35B-A3B on an H200; cached for later runs)")
    if cfg.model.compile:
        waits.append("torch.compile of every layer")
    return " and ".join(waits) or None


def _grace_expired(grace: float) -> None:
    """train.stop_grace_s passed before the step and the save finished: exit now."""
    print(f"\nvlpack: train.stop_grace_s={grace:g} passed before the checkpoint was saved: "
          "stopped without saving; the last complete checkpoint stays the resume point",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_ABORTED)


def _check_writable(out: Path) -> None:
    """ValueError naming the folder when the run cannot write its outputs there."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"train.output_dir={out} is not writable ({type(e).__name__}: "
                         f"{e.strerror or e}): choose a folder you can write to") from None
