"""The gradient of a whole training step, read from the trainer's own step, against the gradient
of the global token-mean loss computed without packing.

The step (`vlpack.train.step.optimizer_step`, what `Trainer.train_step` runs) takes micro-batches
of very different label counts on an MoE model with the aux loss on. Its gradient is read where
the optimizer sees it. The reference is written from transformers alone, in one process: each
sample through the stock model unpacked, transformers' own loss function summed over all label
tokens of the step and divided by their global count (`num_items_in_batch`), plus the aux
coefficient times the mean over micro-batches of transformers' `load_balancing_loss_func` over
each micro-batch's samples. One process, and two gloo ranks under FSDP2.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import GradRecorder, run_ranks
from vlpack.data.batch import build_thd_batch
from vlpack.model.build import build_model, set_attn_implementation
from vlpack.model.synthetic import synthetic_sample
from vlpack.train.distributed.parallel import Topology
from vlpack.train.setup.module import TrainModule
from vlpack.train.step import optimizer_step

NAME, AUX = "tiny-qwen3_vl_moe", 0.5
CPU = Topology(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def _samples(spec) -> list:
    """Micro-batches of 1 label-poor sample and of 3 label-rich ones, per rank."""
    rng = np.random.default_rng(3)
    mk = lambda k, n, g: synthetic_sample(spec, rng, k, text_len=n, grids=g)  # noqa: E731
    return [[mk("r0a", 8, [(1, 4, 4)])], [mk("r0b", 40, []), mk("r0c", 30, [(1, 4, 6)]),
                                          mk("r0d", 36, [])],
            [mk("r1a", 60, [(1, 8, 4)]), mk("r1b", 44, [])], [mk("r1c", 6, [])]]


def _trainer_grads(mbs_samples, topo: Topology, fsdp: bool) -> dict[str, torch.Tensor]:
    model, spec = build_model(NAME, dtype=torch.float32, device="cpu", seed=0)
    module = TrainModule(model, spec, loss_method="chunked", touch_vision=fsdp)
    if fsdp:
        from vlpack.train.distributed.parallel import apply_fsdp

        apply_fsdp(module, model, topo, param_dtype=None)
    opt = GradRecorder(list(model.named_parameters()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    mbs = [build_thd_batch(s, pad_token_id=spec.pad_token_id, pad_to_multiple_of=8,
            mrope_after_video="transformers")
           for s in mbs_samples]
    optimizer_step(module, opt, sched, mbs, topo=topo, aux_coef=AUX, grad_clip=0.0)
    return opt.grads


def _reference_grads(mbs_samples) -> dict[str, torch.Tensor]:
    """transformers only: unpacked samples, its own loss function and load-balancing loss."""
    model, spec = build_model(NAME, dtype=torch.float32, device="cpu", seed=0)
    set_attn_implementation(model, "sdpa")
    lb = importlib.import_module(type(model).__module__).load_balancing_loss_func
    samples = [s for mb in mbs_samples for s in mb]
    n_items = sum(int((s.labels[1:] != -100).sum()) for s in samples)
    total, aux = 0.0, []
    for mb in mbs_samples:
        routers = []
        for s in mb:
            model.model.rope_deltas = None
            has_img = len(s.image_grid_thw) > 0
            out = model(input_ids=torch.as_tensor(s.input_ids)[None],
                        mm_token_type_ids=torch.as_tensor(s.mm_token_type_ids.astype(np.int32))[None],
                        pixel_values=torch.as_tensor(s.pixel_values) if has_img else None,
                        image_grid_thw=torch.as_tensor(s.image_grid_thw) if has_img else None,
                        use_cache=False, output_router_logits=True)
            total = total + model.loss_function(
                logits=out.logits, labels=torch.as_tensor(s.labels)[None],
                vocab_size=spec.vocab_size, num_items_in_batch=n_items)
            routers.append(out.router_logits)
        per_layer = tuple(torch.cat(layer) for layer in zip(*routers, strict=True))
        aux.append(lb(per_layer, spec.num_experts, spec.num_experts_per_tok))
    (total + AUX * sum(aux) / len(aux)).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(got: dict, want: dict) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    assert any(".experts." in n for n in want) and any("mlp.gate." in n for n in want)
    for n, g in want.items():
        err = float((got[n] - g).norm() / (g.norm() + 1e-12))
        assert err <= 1e-5, (n, err)


@pytest.fixture(scope="module")
def mbs_samples():
    spec = build_model(NAME, device="meta", dtype="float32")[1]
    return _samples(spec)


def test_one_process_step_gradient_is_the_global_token_mean(mbs_samples) -> None:
    counts = [sum(int((s.labels[1:] != -100).sum()) for s in mb) for mb in mbs_samples]
    assert max(counts) >= 4 * min(counts), counts  # very different label counts
    _assert_close(_trainer_grads(mbs_samples, CPU, fsdp=False), _reference_grads(mbs_samples))


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from vlpack.train.distributed.parallel import init_distributed, shutdown

    topo = init_distributed()
    spec = build_model(NAME, device="meta", dtype="float32")[1]
    mbs = _samples(spec)[2 * rank : 2 * rank + 2]  # two micro-batches per rank
    grads = _trainer_grads(mbs, topo, fsdp=True)
    if rank == 0:
        torch.save(grads, out)
    shutdown()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_two_rank_step_gradient_is_the_global_token_mean(tmp_path: Path, mbs_samples) -> None:
    out = tmp_path / "grads.pt"
    codes = run_ranks(_worker, str(out))
    assert codes == [0, 0], codes
    _assert_close(torch.load(out), _reference_grads(mbs_samples))
