"""Data parallelism on CPU (gloo): 2 processes == 1 process with the same global batch, and a
rank whose bin holds no image does not hang the others."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers import CPU, SMALL, _dirty_data, finished, losses, small_cfg
from vlpack.config import load_config
from vlpack.train.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]


def _accounting_lines(stdout: str) -> list[str]:
    return [x for x in stdout.splitlines() if x.lstrip().startswith(("samples ", "epochs "))]


def _two_and_one(tmp_path: Path, args: list[str]):
    """`vlpack train ARGS` on 2 processes (torchrun, into tmp_path/two) and on 1 with 2
    micro-batches (the same global batch, into tmp_path/one); both must succeed."""
    two = finished(subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), "-m", "vlpack", "train",
         f"train.output_dir={tmp_path / 'two'}", *args],
        env=_env(), capture_output=True, text=True, timeout=600,
    ))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    one = subprocess.run(
        [sys.executable, "-m", "vlpack", "train", f"train.output_dir={tmp_path / 'one'}",
         "train.micro_batches=2", *args],
        env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    return two, one


def _hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an exported folder's safetensors shards."""
    from safetensors.torch import load_file

    return {k: v for p in sorted(folder.glob("*.safetensors")) for k, v in load_file(p).items()}


def test_two_processes_equal_one_process(tmp_path: Path) -> None:
    """Full fine-tuning on 2 processes (FSDP2) equals 1 process with 2 micro-batches: the
    losses, the bad-sample accounting, the merged export gathered shard by shard (and `vlpack
    export` of the 2-process checkpoint), and an interrupted and resumed run."""
    data = _dirty_data(tmp_path)
    args = [*SMALL, "train.max_steps=3", "data.source=jsonl", f"data.path={data}", "model.init=random",
            "data.max_bad_fraction=0.2", "data.shuffle=false"]
    export = ["train.export_hf=true", "train.export_dtype=float32"]
    two, one = _two_and_one(tmp_path, [*args, *export])
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(a) == len(b) == 3
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)
    from vlpack.train.run.export import export_checkpoint

    offline = export_checkpoint(tmp_path / "two", tmp_path / "offline", out_dtype="float32")
    h1, h2, h3 = (_hf_weights(d) for d in (tmp_path / "one" / "hf", tmp_path / "two" / "hf", offline))
    assert h1 and set(h1) == set(h2) == set(h3)
    assert all(h1[k].shape == h2[k].shape for k in h1)
    assert max((h1[k] - h2[k]).abs().max().item() for k in h1) < 1e-5
    assert all(torch.equal(h2[k], h3[k]) for k in h2)
    # Both runs consumed the same bins: the same samples trained and skipped, the two ranks'
    # counts added up; each skipped sample printed once.
    assert _accounting_lines(two.stdout) == _accounting_lines(one.stdout), (two.stdout, one.stdout)
    assert "3 skipped" in _accounting_lines(one.stdout)[0], one.stdout
    printed = [x for x in two.stderr.splitlines() if "skipping a sample" in x]
    for reason, name in (("bad_json", "data.jsonl:1:"), ("missing_image", "gone:"),
                         ("corrupt_image", "cut:")):
        hits = [x for x in printed if f"({reason})" in x]
        assert len(hits) == 1 and name in hits[0], (reason, printed)

    # FSDP2 sharded checkpoint: stop after 2 steps (as a time-limited job would), resume, finish.
    for extra in (["train.stop_after=2"], []):
        part = finished(subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(_free_port()), "-m", "vlpack", "train",
             f"train.output_dir={tmp_path / 'resumed'}", *args, *extra],
            env=_env(), capture_output=True, text=True, timeout=600,
        ))
        assert part.returncode == 0, part.stdout[-3000:] + part.stderr[-3000:]
    assert "resumed from" in part.stdout
    assert _losses(tmp_path / "resumed") == b


def _untied() -> str:
    """tiny-qwen3_vl with its own lm_head (the 8B, 30B and 35B shapes do not tie it to the
    embedding): the chunked loss reads lm_head.weight outside any module forward."""
    from dataclasses import replace

    from vlpack.model.presets import PRESETS

    base = PRESETS["tiny-qwen3_vl"]
    return PRESETS.setdefault("tiny-qwen3_vl-untied", replace(
        base, name="tiny-qwen3_vl-untied", tie_word_embeddings=False)).name


def _worker(rank: int, port: int, out: str, name: str = "tiny-qwen3_vl",
            loss: str = "plain", padded: bool = False) -> None:
    """Rank 0 trains on a text-only bin, rank 1 on a bin with images (FSDP2 over gloo); padded:
    rank 0 on a padded batch with images, rank 1 on one with an image and a video."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from vlpack.train.distributed.parallel import apply_fsdp, init_distributed, shutdown

    topo = init_distributed()
    model, module, batches = _setup(name, loss, padded)
    apply_fsdp(module, model, topo, param_dtype=None)
    module.touch_vision = True
    opt, sched = _optimizer(module)  # after sharding: FSDP2 swaps in DTensor parameters
    from vlpack.train.step import optimizer_step

    losses = [optimizer_step(module, opt, sched, [batches[rank]], topo=topo,
            grad_clip=0.0, aux_coef=0.0).loss for _ in range(2)]
    if rank == 0:
        Path(out).write_text(json.dumps(losses))
    shutdown()


def _setup(name: str = "tiny-qwen3_vl", loss: str = "plain", padded: bool = False):
    import numpy as np

    from tests.helpers import make_sample
    from vlpack.data.batch import build_thd_batch
    from vlpack.data.padded import build_padded_batch
    from vlpack.model.build import build_model
    from vlpack.model.synthetic import default_mix
    from vlpack.train.setup.module import TrainModule
    if name.endswith("-untied"):
        name = _untied()
    model, spec = build_model(name, dtype=torch.float32, device="cpu", seed=0)
    module = TrainModule(model, spec, loss_method=loss)
    if padded:  # default_mix: sample 0 has two images, sample 2 an image and a video
        mix = default_mix(spec, 4)
        return model, module, [build_padded_batch([mix[i]], pad_token_id=spec.pad_token_id)
                               for i in (0, 2)]
    rng = np.random.default_rng(0)
    text_only = [make_sample("t0", rng, text=(30,), grids=(), patch_dim=spec.patch_dim, spec=spec)]
    with_images = [make_sample("i0", rng, text=(6, 12), grids=((1, 4, 4),),
                               patch_dim=spec.patch_dim, spec=spec)]
    batches = [build_thd_batch(s, pad_token_id=spec.pad_token_id,
            pad_to_multiple_of=1, mrope_after_video="transformers") for s in (text_only, with_images)]
    return model, module, batches


def _optimizer(module):
    from vlpack.train.optim import build_optimizer, build_scheduler

    cfg = load_config("tiny")
    opt = build_optimizer(module.parameters(), cfg.optim, device_type="cpu")
    return opt, build_scheduler(opt, cfg.optim, 10)


@pytest.mark.parametrize("name,loss,padded", [("tiny-qwen3_vl", "plain", False),
                                              ("tiny-qwen3_vl-untied", "chunked", False),
                                              ("tiny-qwen3_5", "chunked", True)])
def test_text_only_rank_does_not_hang_and_matches_one_process(
        tmp_path: Path, name: str, loss: str, padded: bool) -> None:
    """Packed: one rank's bin has no image. Padded: one rank's batch has a video, the other's
    not (the stock forward encodes images and videos in separate tower calls)."""
    out = tmp_path / "losses.json"
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(out), name, loss, padded))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, "a rank hung: the vision tower must run on every rank"
    assert all(p.exitcode == 0 for p in procs)
    # One process, both bins as micro-batches of one step: the same global token mean.
    from vlpack.train.distributed.parallel import Topology
    from vlpack.train.step import optimizer_step

    model, module, batches = _setup(name, loss, padded)
    assert (model.lm_head.weight is model.model.language_model.embed_tokens.weight) == (
        not name.endswith("-untied"))
    opt, sched = _optimizer(module)
    topo = Topology(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    single = [optimizer_step(module, opt, sched, batches, topo=topo,
            grad_clip=0.0, aux_coef=0.0).loss for _ in range(2)]
    assert max(abs(a - b) for a, b in zip(json.loads(out.read_text()), single, strict=True)) < 1e-5


FAMILIES = ["tiny-qwen2_vl", "tiny-qwen2_5_vl", "tiny-qwen3_vl", "tiny-qwen3_vl_moe",
            "tiny-qwen3_5", "tiny-qwen3_5_moe"]


@pytest.mark.parametrize("name", FAMILIES)
def test_fsdp_blocks_see_the_same_inputs_in_forward_and_recomputation(name: str) -> None:
    """FSDP2 with bf16 parameters and activation checkpointing: a checkpointed vision block must
    receive the same tensors (dtype included) in its forward and in its recomputation, and the
    vision rotary its fp32 cos/sin in both. FSDP2 cast block inputs to bf16 on the forward only,
    and activation checkpointing refused the compiled rotary's recomputation (the 8B recipe).
    Uncast inputs must also meet no fp32/bf16 mismatch in any family's blocks (checkpointing,
    then sharding, as the Trainer orders them)."""
    from vlpack.model.recompute import enable_activation_checkpointing
    from vlpack.train.distributed.parallel import Topology, apply_fsdp, ensure_process_group, shutdown

    model, module, batches = _setup(name)
    topo = Topology(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    ensure_process_group(topo)
    try:
        enable_activation_checkpointing(model, 1.0)
        apply_fsdp(module, model, topo, param_dtype=torch.bfloat16)
        seen = []
        model.model.visual.blocks[0].attn.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(
                tuple(t.dtype for t in (*args[:1], *kwargs["position_embeddings"]))),
            with_kwargs=True)
        module(batches[1]).loss_sum.backward()
    finally:
        shutdown()
    assert len(seen) == 2, seen  # the forward and the recomputation
    assert seen[0] == seen[1] == (torch.bfloat16, torch.float32, torch.float32), seen


def test_fsdp_root_keeps_fp32_loss_weights() -> None:
    """`train.loss_norm=sample` hands the root fp32 per-token weights (1 / the sample's label
    count). FSDP2's mixed precision cast a module's floating inputs to bf16, which rounded them
    (by up to 0.4%) on several GPUs and not on one. The loss must see them as given."""
    from vlpack.train.distributed.parallel import Topology, apply_fsdp, ensure_process_group, shutdown
    from vlpack.train.step import sample_mean_weights

    model, module, batches = _setup()
    topo = Topology(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    ensure_process_group(topo)
    seen = []
    try:
        apply_fsdp(module, model, topo, param_dtype=torch.bfloat16)
        module.register_forward_pre_hook(  # runs after FSDP2's own pre-forward hook
            lambda m, args, kwargs: seen.append(kwargs["token_weights"].dtype), with_kwargs=True)
        weights, _ = sample_mean_weights(batches[1])
        module(batches[1], token_weights=weights).loss_sum.backward()
    finally:
        shutdown()
    assert seen == [torch.float32]


@pytest.mark.parametrize("extra", [(), ("model.name=tiny-qwen3_vl_moe", "model.lora.experts=true")],
                         ids=["dense", "moe-experts"])
def test_two_process_lora_equals_one_process(tmp_path: Path, extra: tuple[str, ...]) -> None:
    """LoRA under FSDP2 (frozen base weights and trainable adapters in one FSDP unit) on 2
    processes gives the 1-process losses, and rank 0 writes the adapter from the gathered
    shards; also with the routed experts' weights adapted (peft's parametrization inside the
    sharded layer). The merged export gathered shard by shard from the FSDP2 shards equals the
    1-process one, and `vlpack export` of the 2-process checkpoint (its frozen base drawn again
    as rank 0 drew it) equals both."""
    from safetensors.torch import load_file

    pytest.importorskip("peft")
    args = [*SMALL, "train.max_steps=3", "data.shuffle=false", "model.lora.rank=4",
            "model.lora.alpha=8", "optim.lr=1e-2", "optim.warmup_steps=0", "train.export_hf=true",
            "train.export_dtype=float32", *extra]
    _two_and_one(tmp_path, args)
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(a) == len(b) == 3
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)
    w1, w2 = (load_file(str(tmp_path / r / "adapter" / "adapter_model.safetensors"))
              for r in ("one", "two"))
    assert set(w1) == set(w2) and all(k.startswith("base_model.model.") for k in w1)
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-5
    if extra:
        assert any(".experts.lora_A" in k for k in w1)
    from vlpack.train.run.export import export_checkpoint

    offline = export_checkpoint(tmp_path / "two", tmp_path / "offline", out_dtype="float32")
    h1, h2, h3 = (_hf_weights(d) for d in (tmp_path / "one" / "hf", tmp_path / "two" / "hf", offline))
    assert set(h1) == set(h2) == set(h3) and not any("lora" in k for k in h1)
    assert max((h1[k] - h2[k]).abs().max().item() for k in h1) < 1e-5
    assert all(torch.equal(h2[k], h3[k]) for k in h2)


# --- trainer switches --------------------------------------------------------------------------------
# Trainer switches: freezing, anomaly mode, token-budget accumulation, rows padded to seq_len.
def test_fsdp_root_keeps_its_parameters_for_backward(tmp_path: Path, monkeypatch) -> None:
    """FSDP2 re-gathers a module for backward from hooks on the tensors its forward returns. Up
    to torch 2.11 it finds them with pytree, which does not enter the root's `ForwardOut`
    dataclass: no hook. A root resharded after forward then read freed parameters in backward
    (a segfault on CPU, an illegal memory access on an H200: the 8B recipe on 2 GPUs). With that
    registration patched in, the root's parameters must still be gathered after forward, and
    the run must equal the plain one."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_flatten

    from vlpack.train.distributed.parallel import shutdown

    def pytree_hooks(self, output):  # torch <= 2.11's registration
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        return output

    monkeypatch.setattr(FSDPState, "_register_pre_backward_hook", pytree_hooks)
    try:
        plain = Trainer(small_cfg(tmp_path / "plain", "train.max_steps=2"), CPU)
        plain.fit()
        t = Trainer(small_cfg(tmp_path / "fsdp", "train.max_steps=2", "train.fsdp=always",
                              "train.reshard_after_forward=true"), CPU)
        root_params = [t.model.lm_head.weight, t.model.model.language_model.norm.weight]
        seen = []

        def after_forward(module, args, out):  # runs after FSDP2's own post-forward hook
            for name in ("lm_head", "model.language_model.norm"):
                w = t.model.get_submodule(name).weight
                # fails here, before a backward that would read freed memory and crash
                assert not isinstance(w, DTensor) and w.untyped_storage().nbytes() > 0, \
                    f"the root resharded {name} after forward: its backward reads freed memory"
            seen.append(True)

        t.module.register_forward_hook(after_forward)
        assert all(isinstance(p, DTensor) for p in root_params)  # sharded before any forward
        t.fit()
        assert len(seen) == 2
        assert max(abs(a - b) for a, b in zip(losses(tmp_path / "plain"),
                                               losses(tmp_path / "fsdp"), strict=True)) < 1e-5
    finally:
        shutdown()


def test_sharded_run_builds_shapes_then_receives_rank0s_weights(tmp_path: Path,
                                                                monkeypatch) -> None:
    """An FSDP2 run builds the model on the meta device, shards it, and only then receives
    rank 0's whole CPU copy (no rank holds the whole model on its accelerator): every
    parameter and buffer (rotary tables included) equals a plain build with the run's seed."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import vlpack.model.build as build
    from vlpack.train.distributed.parallel import shutdown

    devices, original = [], build.build_model

    def record(*args, **kwargs):
        devices.append(torch.device(kwargs["device"]).type)
        return original(*args, **kwargs)

    monkeypatch.setattr(build, "build_model", record)
    try:
        t = Trainer(small_cfg(tmp_path, "train.max_steps=1", "train.fsdp=always"), CPU)
        assert devices == ["meta", "cpu"]
        got = get_model_state_dict(t.model, options=StateDictOptions(full_state_dict=True))
        want, _ = original(t.cfg.model.name, dtype=torch.float32, device="cpu",
                           seed=t.cfg.train.seed)
        assert set(got) == set(want.state_dict())
        for name, value in want.state_dict().items():
            assert torch.equal(got[name], value), name
        buffers = dict(t.model.named_buffers())
        for name, value in want.named_buffers():
            assert torch.equal(buffers[name], value), name
    finally:
        shutdown()


def test_fsdp_on_one_process_equals_plain_and_resumes(tmp_path: Path) -> None:
    """`train.fsdp=always` on one process (a one-rank group): the same losses as the plain run;
    its sharded checkpoint resumes to the straight run's losses."""
    from vlpack.train.distributed.parallel import shutdown
    from vlpack.train.run import checkpoint as ckpt

    try:
        plain = Trainer(small_cfg(tmp_path / "plain", "train.max_steps=4"), CPU)
        plain.fit()
        fsdp = Trainer(small_cfg(tmp_path / "fsdp", "train.max_steps=4", "train.fsdp=always"), CPU)
        assert torch.distributed.is_initialized()
        assert type(fsdp.model.model.language_model.layers[0]).__name__.startswith("FSDP")
        fsdp.fit()
        a, b = losses(tmp_path / "plain"), losses(tmp_path / "fsdp")
        assert len(a) == 4 and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)

        kept = Trainer(small_cfg(tmp_path / "kept", "train.max_steps=4", "train.fsdp=always",
                                 "train.reshard_after_forward=false"), CPU)
        kept.fit()  # parameters kept gathered from forward to backward: the same arithmetic
        assert losses(tmp_path / "kept") == b
        bf16 = Trainer(small_cfg(tmp_path / "bf16", "train.max_steps=1", "train.fsdp=always",
                                 "train.reduce_dtype=bfloat16"), CPU)
        block = bf16.model.model.language_model.layers[0]
        assert block._get_fsdp_state()._mp_policy.reduce_dtype == torch.bfloat16

        part = Trainer(small_cfg(tmp_path / "part", "train.max_steps=4", "train.fsdp=always",
                                 "train.stop_after=2"), CPU)
        part.fit()
        assert ckpt.latest_checkpoint(tmp_path / "part").name == "step_00000002"
        Trainer(small_cfg(tmp_path / "part", "train.max_steps=4", "train.fsdp=always"), CPU).fit()
        assert losses(tmp_path / "part") == b
    finally:
        shutdown()


def test_cpu_offload_on_one_process(tmp_path: Path) -> None:
    """`train.cpu_offload=true` under `train.fsdp=always` on one CPU process: every FSDP2 unit
    holds a CPUOffloadPolicy, the run trains to the losses of the same run without offload,
    and its optimizer state lives on the CPU. Without FSDP2 it is refused with the fix. (On CPU
    the host is the device: the copies to and from an accelerator are not exercised here.)"""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from vlpack.train.distributed.parallel import shutdown

    with pytest.raises(ValueError, match=r"not sharded: set train\.fsdp=always"):
        Trainer(small_cfg(tmp_path / "plain", "train.cpu_offload=true"), CPU)
    try:
        ref = Trainer(small_cfg(tmp_path / "ref", "train.max_steps=3", "train.fsdp=always"), CPU)
        ref.fit()
        t = Trainer(small_cfg(tmp_path / "off", "train.max_steps=3", "train.fsdp=always",
                              "train.cpu_offload=true"), CPU)
        units = [t.model.model.language_model.layers[0], t.module]
        assert all(isinstance(u._get_fsdp_state()._fsdp_param_group.offload_policy,
                              CPUOffloadPolicy) for u in units)
        t.fit()
        a, b = losses(tmp_path / "ref"), losses(tmp_path / "off")
        assert len(a) == 3 and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-6, (a, b)
        state = [v for s in t.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.ndim]
        assert state and all(v.device.type == "cpu" for v in state)
    finally:
        shutdown()
