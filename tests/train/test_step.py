"""One optimizer step over micro-batches (train/step.py): packed == padded training, the global
token mean over micro-batches, the sample-mean loss against a per-sample reference."""

from __future__ import annotations

import torch

from tests.helpers import CPU, GradRecorder
from vlpack.config import load_config
from vlpack.data.batch import build_thd_batch
from vlpack.data.padded import build_padded_batch
from vlpack.model.build import build_model
from vlpack.train.optim import build_optimizer, build_scheduler
from vlpack.train.setup.module import TrainModule
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
                batch = build_thd_batch(group, pad_token_id=spec.pad_token_id, pad_to_multiple_of=8,
                        mrope_after_video="transformers")
            else:
                batch = build_padded_batch(group, pad_token_id=spec.pad_token_id)
            step_losses.append(optimizer_step(module, opt, sched, [batch], topo=CPU,
                                              grad_clip=1.0, aux_coef=0.0).loss)
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
        mbs = [build_thd_batch(g, pad_token_id=spec.pad_token_id,
                pad_to_multiple_of=1, mrope_after_video="transformers") for g in groups]
        runs.append((optimizer_step(module, opt, sched, mbs, topo=CPU,
                grad_clip=0.0, aux_coef=0.0).loss, opt.grads))
    (loss_one, g_one), (loss_split, g_split) = runs
    assert abs(loss_one - loss_split) < 1e-5
    assert set(g_one) == set(g_split)
    worst = max((g_one[n] - g_split[n]).abs().max().item() for n in g_one)
    assert worst < 1e-6


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
        batch = (build_thd_batch(group, pad_token_id=spec.pad_token_id, pad_to_multiple_of=8,
                mrope_after_video="transformers")
                 if mode == "packed" else build_padded_batch(group, pad_token_id=spec.pad_token_id))
        r = optimizer_step(module, opt, build_scheduler(opt, cfg.optim, 5), [batch], topo=CPU,
                           loss_norm="sample", grad_clip=0.0, aux_coef=0.0)
        assert r.samples == 4
        assert abs(r.loss - want) < 1e-5, (mode, r.loss, want)


def test_phases_wrap_each_micro_batch_and_the_optimizer_in_order() -> None:
    """optimizer_step's `phase` (a benchmark's timer) opens around each micro-batch's forward
    and backward, then once around clipping, the optimizer's step and zeroing."""
    import contextlib
    from types import SimpleNamespace

    events: list[str] = []

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, b):
            events.append("module")
            return SimpleNamespace(loss_sum=(self.w * b.x).sum(), aux_loss=None)

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            events.append("optimizer.step")
            return super().step(closure)

    @contextlib.contextmanager
    def phase(name):
        events.append(f"{name} in")
        yield
        events.append(f"{name} out")

    module = Module()
    opt = Recording(module.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    mbs = [SimpleNamespace(x=torch.arange(3.0), num_label_tokens=3, num_samples=1)
           for _ in range(2)]
    r = optimizer_step(module, opt, sched, mbs, topo=CPU, phase=phase, grad_clip=0.0, aux_coef=0.0)
    micro = ["forward in", "module", "forward out", "backward in", "backward out"]
    assert events == [*micro, *micro, "optimizer in", "optimizer.step", "optimizer out"]
    assert r.loss == 1.0 and torch.equal(module.w.detach(), 1 - 0.1 * torch.arange(3.0) / 3)


def test_the_step_reads_the_device_once() -> None:
    """optimizer_step brings device values to the host once per step (loss, aux loss and gradient
    norm together, after clipping), however many micro-batches: on a GPU each read is a wait
    after which the GPU idles while the host launches the next pass. Counted on CPU as the
    tensor-to-host calls made from train/step.py."""
    import os
    import sys
    from types import SimpleNamespace

    from torch.overrides import TorchFunctionMode

    import vlpack.train.step as step_module

    reads = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
             torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__}
    torch_dir = os.path.dirname(torch.__file__)
    sites: list[int] = []

    class CountReads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in reads:
                f = sys._getframe(1)
                while f is not None and f.f_code.co_filename.startswith(torch_dir):
                    f = f.f_back
                if f is not None and f.f_code.co_filename == step_module.__file__:
                    sites.append(f.f_lineno)
            return func(*args, **(kwargs or {}))

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 2.0]))

        def forward(self, b):
            return SimpleNamespace(loss_sum=(self.w * b.x).sum(), aux_loss=self.w.sum() / 10)

    module = Module()
    opt = torch.optim.SGD(module.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    mbs = [SimpleNamespace(x=torch.ones(3) * k, num_label_tokens=3, num_samples=1)
           for k in (1.0, 2.0, 3.0)]
    with CountReads():
        r = optimizer_step(module, opt, sched, mbs, topo=CPU, aux_coef=1.0, grad_clip=0.0)
    assert len(sites) == 1, f"host reads at train/step.py lines {sites}"
    # loss: Σ_k 5k / 9 labels; aux: the mean over micro-batches of 0.5; the gradient of
    # Σ_k (w·x_k) / 9 + Σ_k (Σw / 10) / 3 is 6/9 + 1/10 per weight, its norm × √3
    assert abs(r.loss - 30 / 9) < 1e-12 and abs(r.aux_loss - 0.5) < 1e-12
    assert abs(r.grad_norm - (6 / 9 + 0.1) * 3**0.5) < 1e-6
