"""Context parallelism on CPU (gloo, 2 processes): a packed row split across two ranks gives
the single-process forward's logits, loss, MoE statistics and every parameter gradient
(vision tower included), for all six tiny families.

The reference is the same packed row in one process (CP=1), whose equality with the unpacked
stock model the packed-model suite proves. The row mixes a two-image sample, a text-only
sample, single-image samples and a 2-token sample whose chunks are one token each (two of them
padding); every sample straddles the split, since each is cut into 2·cp chunks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import finished, run_ranks
from vlpack.data.types import IGNORE_INDEX, EncodedSample
from vlpack.families import FAMILIES

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")

CP = 2
AUX = 0.1  # weight of the aux loss in the objective whose gradients are compared


def _row(spec, one_image: bool = False):
    """The test row; `one_image`: only the first single-image sample and the 2-token one (fewer
    images than ranks: every rank encodes the image)."""
    from vlpack.data.batch import build_thd_batch
    from vlpack.model.synthetic import default_mix

    samples = default_mix(spec, 4, seed=1)
    if one_image:
        samples = [next(s for s in samples if len(s.image_grid_thw) == 1)]
    two = np.array([11, 12], dtype=np.int64)
    samples.append(EncodedSample(key="two", input_ids=two, labels=np.array([IGNORE_INDEX, 12]),
                                 mm_token_type_ids=np.zeros(2, np.int8),
                                 image_grid_thw=np.zeros((0, 3), np.int64), pixel_values=None))
    parts = 2 * CP
    aligned = sum(-(-len(s) // parts) * parts for s in samples)
    return samples, build_thd_batch(samples, pad_token_id=spec.pad_token_id,
                                    pad_to_multiple_of=parts, total_len=aligned + 2 * parts,
                                    spatial_merge_size=spec.merge_size, mrope_after_video="transformers")


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rechunked(forward, model, batch, spec):
    """`forward(model, batch)` with the Gated-DeltaNet recurrence of each segment run in its
    2·CP context-parallel chunks in turn, the state passed from one to the next."""
    import itertools

    from vlpack.model import gdn

    def chunked(query, key, value, g, beta, segs, bounds, *, torch_fn, torch_only=False):
        outs = []
        for s, e in itertools.pairwise(segs.host):
            size, state = (e - s) // (2 * CP), None
            for a in range(s, e, size):
                o, state = torch_fn(query[:, a : a + size], key[:, a : a + size],
                                    value[:, a : a + size], g=g[:, a : a + size],
                                    beta=beta[:, a : a + size], initial_state=state,
                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
                outs.append(o)
        return torch.cat(outs, dim=1)

    stock, gdn.segment_delta_rule = gdn.segment_delta_rule, chunked
    try:
        return forward(model, batch, spec=spec, loss_method="plain")
    finally:
        gdn.segment_delta_rule = stock


def _worker(rank: int, port: int, path: str, families: list[str]) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=CP)
    from vlpack.model import build_model, packed_forward
    from vlpack.model.context import ContextGroup, ContextSplit

    group = ContextGroup(dist.group.WORLD, rank, CP)
    results = {}
    for name in families:
        torch.manual_seed(0)
        model, spec = build_model(f"tiny-{name}", device="cpu", dtype=torch.float32)
        model.train()
        _, batch = _row(spec)

        def objective(o):
            return o.loss_sum + (AUX * o.aux_loss if o.aux_loss is not None else 0.0)

        ref = packed_forward(model, batch, spec=spec, return_logits=True, loss_method="plain")
        objective(ref).backward()
        ref_grads = _grads(model)
        model.zero_grad(set_to_none=True)
        # the noise floor: the same objective's gradient in one process, as two backward
        # passes split by the ranks' tokens and added (what CP adds up across ranks)
        split = ContextSplit(group, batch.padded_bounds, batch.image_positions, torch.device("cpu"))
        mine = torch.as_tensor(split.token_index)
        own = torch.zeros(batch.num_tokens)
        own[mine] = 1.0
        for r, weights in enumerate((own, 1.0 - own) if rank == 0 else (1.0 - own, own)):
            o = packed_forward(model, batch, spec=spec, loss_method="plain", token_weights=weights)
            (o.loss_sum + (AUX * o.aux_loss if o.aux_loss is not None and r == 0 else 0.0)).backward()
        floor = {n: float((g - ref_grads[n]).abs().max()) for n, g in _grads(model).items()}
        model.zero_grad(set_to_none=True)
        # and the delta rule's: the same objective in one process with each sample's recurrence
        # run chunk by chunk at the split's chunk boundaries, the state handed on (the same
        # math; the gate gradients of the stock kernel are ill-conditioned enough that where
        # its internal blocks start moves them by up to ~1%)
        if spec.has_gdn:
            o = _rechunked(packed_forward, model, batch, spec)
            objective(o).backward()
            for n, g in _grads(model).items():
                floor[n] = max(floor[n], float((g - ref_grads[n]).abs().max()))
            model.zero_grad(set_to_none=True)

        out = packed_forward(model, batch, spec=spec, return_logits=True, loss_method="plain",
                             context=group)
        objective(out).backward()
        grads = _grads(model)
        # the error scale of a summed gradient: the sum of the ranks' magnitudes (a rank's
        # share can be far larger than the total, and the stock Gated-DeltaNet rounds its gate
        # gradients to float32 whatever the model's dtype)
        scale = {}
        for n, g in grads.items():
            mag = g.abs()
            dist.all_reduce(mag)
            dist.all_reduce(g)
            scale[n] = float(mag.max())
        totals = torch.tensor([float(out.loss_sum.detach()), float(out.num_label_tokens),
                               float(out.aux_loss.detach()) if out.aux_loss is not None else 0.0,
                               float(split.image_select.numel())], dtype=torch.float64)
        dist.all_reduce(totals)
        res = {
            "logits": float((out.logits - ref.logits[mine]).abs().max().detach()),
            "tokens": split.num_local, "row_tokens": batch.num_tokens,
            "loss": abs(float(totals[0]) - float(ref.loss_sum)) / abs(float(ref.loss_sum)),
            "labels": [int(totals[1]), ref.num_label_tokens],
            "image_tokens": [int(totals[3]), len(batch.image_positions)],
            "grad_names": [sorted(grads) == sorted(ref_grads)],
            "grad": max(float((grads[n] - g).abs().max()) / max(scale.get(n, 0.0), 1e-12)
                        for n, g in ref_grads.items() if n in grads),
            # per parameter: CP's error over (1e-5 of its scale + 3× the noise floor)
            "worst": sorted((float((grads[n] - g).abs().max())
                             / (1e-5 * scale.get(n, 0.0) + 3 * floor[n] + 1e-30), n)
                            for n, g in ref_grads.items() if n in grads)[-3:],
            "floor": max(floor[n] / max(scale.get(n, 0.0), 1e-12) for n in ref_grads),
            "vision_grads": sum(1 for n in grads if "visual" in n),
            "paths": out.paths,
        }
        # a row with one image: every rank encodes it (forward only)
        _, one = _row(spec, one_image=True)
        ref1 = packed_forward(model, one, spec=spec, return_logits=True, loss_method="plain")
        out1 = packed_forward(model, one, spec=spec, return_logits=True, loss_method="plain",
                              context=group)
        mine1 = torch.as_tensor(
            ContextSplit(group, one.padded_bounds, one.image_positions, "cpu").token_index)
        res["one_image_logits"] = float((out1.logits - ref1.logits[mine1]).abs().max().detach())
        res["one_image_path"] = out1.paths["vision.context"]
        if spec.is_moe:
            res["aux"] = abs(float(totals[2]) - float(ref.aux_loss)) / float(ref.aux_loss)
            res["counts"] = bool(torch.equal(out.router_stats.tokens_per_expert,
                                             ref.router_stats.tokens_per_expert))
            res["num_tokens"] = [int(out.router_stats.num_tokens),
                                 int(ref.router_stats.num_tokens)]
        results[name] = res
    if rank == 0:
        Path(path).write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp") / "results.json"
    codes = run_ranks(_worker, str(out), list(FAMILIES), world=CP, timeout=900)
    assert codes == [0] * CP, codes
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_cp2_equals_cp1(cp_results, name):
    r = cp_results[name]
    assert r["tokens"] * CP == r["row_tokens"]
    assert r["logits"] <= 1e-5, r
    assert r["loss"] <= 1e-6, r
    assert r["labels"][0] == r["labels"][1], r
    assert r["image_tokens"][0] == r["image_tokens"][1] > 0, r
    assert r["grad_names"] == [True] and r["vision_grads"] > 0, r
    assert r["worst"][-1][0] <= 1.0, (r["worst"], r["grad"], r["floor"])
    assert "gathered keys" in r["paths"]["attention.text"], r["paths"]
    assert r["paths"]["vision.context"] == "each image encoded on one rank, features gathered"
    assert r["one_image_logits"] <= 1e-5, r
    assert r["one_image_path"] == "every rank encodes the row's images"
    if "aux" in r:
        assert r["aux"] <= 1e-6 and r["counts"] and r["num_tokens"][0] == r["num_tokens"][1], r


def _torchrun(*args: str, nproc: int = CP,
              done: tuple[str, ...] = ("vlpack: done", "vlpack: stopped early"),
              ) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc-per-node={nproc}", "-m", "vlpack", *args],
                         capture_output=True, text=True, env=env, timeout=600)
    return finished(run, done)


def test_check_cp2_under_torchrun_passes_on_the_hybrid_moe_family():
    """`vlpack check --cp 2` under torchrun: the row split over two ranks against the unpacked
    stock model, every item of the check (contract, second bin, isolation)."""
    run = _torchrun("check", "--model", "tiny-qwen3_5_moe", "--cp", "2", "--json",
                    done=('"passed": true',))
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout)
    assert r["passed"] and r["cp"] == 2 and r["max_logit_diff"] <= 1e-5, r["failures"]
    assert "gathered keys" in r["paths"]["attention.text"]
    assert {"vision", "merger", "llm", "experts", "router"} <= set(r["grad_rel_diff"])


def test_check_cp_without_torchrun_says_how_to_run_it():
    run = subprocess.run([sys.executable, "-m", "vlpack", "check", "--cp", "2"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "torchrun --standalone --nproc-per-node 2" in run.stderr


SMALL_RUN = ["data.seq_len=512", "data.min_pixels=16384", "data.max_pixels=50176",
             "data.video.min_pixels=4096", "data.video.max_pixels=50176",
             "data.buffer_size=8", "data.eval_samples=4", "data.shuffle=false",
             "train.progress=false", "train.eval_every=2", "train.save_every=0",
             "train.max_steps=4", "model.name=tiny-qwen3_5_moe", "train.aux_loss_coef=0.1"]


CP_RUN = ["parallel.cp=2", "model.activation_checkpointing=true"]


def _losses(run: Path, key: str = "loss") -> list[float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


def test_dp2_cp2_trains_as_dp2_cp1_and_resumes_exactly(tmp_path):
    """4 processes, data parallel 2 × context parallel 2, train the losses, MoE aux losses and
    eval losses of 2 processes without context parallelism, on the hybrid MoE family
    (Gated-DeltaNet, experts, aux loss in the objective), the context-parallel run with every
    layer recomputed in backward (its all-gathers run again); stopped after 2 steps and
    resumed, the same losses."""
    def train(nproc: int, out: str, *extra: str) -> list[float]:
        run = _torchrun("train", "tiny", *SMALL_RUN, f"train.output_dir={tmp_path / out}",
                        *extra, nproc=nproc)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        return run

    def summary(run) -> list[str]:  # the samples, epochs and tokens lines of the run's summary
        return [x for x in run.stdout.splitlines()
                if x.lstrip().startswith(("samples ", "epochs ", "tokens "))]

    from tests.helpers import _dirty_data

    data = [f"data.path={_dirty_data(tmp_path)}", "data.source=jsonl", "data.max_bad_fraction=0.3",
            "model.init=random"]
    two = train(2, "dp2", *data)
    four = train(4, "dp2cp2", *CP_RUN, *data)
    base, cp = _losses(tmp_path / "dp2"), _losses(tmp_path / "dp2cp2")
    assert len(base) == len(cp) == 4
    assert max(abs(a - b) for a, b in zip(base, cp, strict=True)) < 1e-5, (base, cp)
    aux_base, aux_cp = _losses(tmp_path / "dp2", "aux_loss"), _losses(tmp_path / "dp2cp2", "aux_loss")
    assert max(abs(a - b) for a, b in zip(aux_base, aux_cp, strict=True)) < 1e-6, (aux_base, aux_cp)
    ev_base, ev_cp = _losses(tmp_path / "dp2", "eval_loss"), _losses(tmp_path / "dp2cp2", "eval_loss")
    assert len(ev_base) == len(ev_cp) >= 2
    assert max(abs(a - b) for a, b in zip(ev_base, ev_cp, strict=True)) < 1e-5, (ev_base, ev_cp)
    assert len(summary(four)) == 3 and summary(four) == summary(two), (four.stdout, two.stdout)
    assert "3 skipped" in summary(four)[0], four.stdout
    printed = [x for x in four.stderr.splitlines() if "skipping a sample" in x]
    assert len(printed) == 3, printed  # once each, by the first rank of the group
    train(4, "resumed", *CP_RUN, *data, "train.stop_after=2")
    resumed = train(4, "resumed", *CP_RUN, *data)
    assert "resumed from" in resumed.stdout
    assert _losses(tmp_path / "resumed") == cp


def test_cp_refuses_what_it_cannot_split():
    from vlpack.config import load_config

    for extra, match in ((["model.backend=sdpa"], "model.backend=auto"),
                         (["data.packing=none"], "data.packing"),
                         (["parallel.cp=4", "data.pad_to_multiple_of=4"], "multiple of 8")):
        args = ["parallel.cp=2", *extra] if extra[0] != "parallel.cp=4" else extra
        with pytest.raises(ValueError, match=match):
            load_config("tiny", args)
