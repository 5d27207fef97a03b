"""The memory plan (train/setup/memory.py) against hand-worked numbers, `vlpack train --dry-run`, the
one-paragraph out-of-memory message, and a model too large refused before it is built."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import CPU, small_cfg, tiny_routed_experts
from vlpack.config import LoraConfig
from vlpack.model.build import meta_model
from vlpack.train.command import train
from vlpack.train.setup import memory
from vlpack.train.setup.prepare import preparation
from vlpack.train.setup.stack import plan_memory
from vlpack.train.trainer import Trainer


def _plan(cfg, topo, **kw):
    """`plan_memory` under the run's own preparation."""
    return plan_memory(cfg, topo, preparation(cfg, topo), **kw)


def test_layer_bytes_by_hand() -> None:
    """Bytes per token a layer keeps for its backward, b = 2 (bf16 activations):

    tiny-qwen3_vl attention layer (h 64, 4 heads, 2 kv heads, head dim 16, MLP 128):
      norms 2·(4·64 + 2·64) = 768; attention 2·(64 + 2·2·16) + 2·(64 + 32) + 3·2·64 + 4·4 = 848;
      MLP 6·2·128 = 1536; 3152 in all.
    tiny-qwen3_5_moe (4 experts, top 2, expert and shared MLP 32):
      Gated-DeltaNet (2 key heads × 16, 4 value heads × 16: qkv 128, v 64): 768 +
      2·(128 + 64 + 8) + 3·2·128 + 4·64 + 2·2·64 = 2448; gated attention (head dim 32: q 256):
      768 + 2·(256 + 128) + 2·(128 + 64) + 3·2·128 + 16 = 2704; MoE: router 8·4, shared expert
      2·(6·32 + 64) = 512, and 2 routed copies of (eager, frozen) 24 + 2 + 2·2·32 + 2·2·32 = 282:
      1108; compiled, 16 + 2 + 2·2·32 = 146 a copy: 836; trained eager, 282 + 2·(64 + 32) = 474
      a copy: 1492.
    """
    text = meta_model("tiny-qwen3_vl").config.text_config
    assert memory.layer_bytes(text, "full_attention", 2) == 3152
    text = meta_model("tiny-qwen3_5_moe").config.text_config
    assert memory.layer_bytes(text, "linear_attention", 2) == 2448 + 1108
    assert memory.layer_bytes(text, "full_attention", 2) == 2704 + 1108
    assert memory.layer_bytes(text, "full_attention", 2, compiled=True) == 2704 + 836
    assert memory.layer_bytes(text, "full_attention", 2, experts_train=True) == 2704 + 1492


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("train", [False, True])
def test_routed_bytes_are_what_autograd_keeps(train: bool, compiled: bool) -> None:
    """`routed_bytes` against the storages autograd keeps for one experts module's backward
    (counted with saved-tensor hooks, the weights left out) under bf16 autocast, eager and
    compiled, frozen and trained: per routed copy, to within the per-expert offsets."""
    impl = "vlpack_grouped_mm_compiled" if compiled else "vlpack_grouped_mm"
    ex = tiny_routed_experts(impl, train=train, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    T, K = 53, 2
    x = torch.randn(T, ex.hidden_dim, generator=g, requires_grad=True)
    idx = torch.randint(0, ex.num_experts, (T, K), generator=g)
    w = torch.rand(T, K, generator=g, requires_grad=True)
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        ex(x, idx, w).float().sum().backward()
    weights = {p.untyped_storage().data_ptr() for p in ex.parameters()}
    per_copy = sum(n for ptr, n in kept.items() if ptr not in weights) / (T * K)
    want = memory.routed_bytes(ex.hidden_dim, 16, 2, train=train, compiled=compiled)
    assert want <= per_copy <= want + 4 * ex.num_experts / (T * K), (per_copy, want)


def test_activation_plan_by_hand() -> None:
    """tiny-qwen3_vl with LoRA (vision frozen: no vision activations; the tied lm_head frozen),
    100 tokens, half of the 2 layers recomputed, loss chunks of 10 rows:
      text layers  100 · (3152 + 4·64)       =   340,800
      working set  2 · 100 · 3152            =   630,400
      loss         10 · 151,936 · 6 + 100·64·2 = 9,128,960
    each times ACTIVATION_SCALE."""
    from vlpack.model import lora

    model = meta_model("tiny-qwen3_vl")
    lora.apply_lora(model, LoraConfig(rank=4))
    run = memory.RunShape(seq_len=100, patches=64, recompute_share=0.5, act_bytes=2,
                          loss_chunk=10)
    got = memory.activation_bytes(model, run)
    s = memory.ACTIVATION_SCALE
    assert got == {"text layers": int(340_800 * s), "backward working set": int(630_400 * s),
                   "loss": int(9_128_960 * s)}


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(10, 4, bias=False).to(torch.bfloat16).requires_grad_(False)
        self.head = nn.Linear(4, 2, bias=False)


def test_weights_gradients_and_optimizer_by_hand() -> None:
    """40 frozen bf16 parameters (80 bytes) and 8 trainable float32 ones (32 bytes): sharded over
    2 ranks, 40 + 16 bytes of weights, 4·8/2 = 16 of gradients and 8·8/2 = 32 of AdamW moments
    per rank, rank 0's host copy 112; one process building in bf16 peaks at the held 112, in
    float32 at 48·4 = 192."""
    p = memory.plan(_Toy(), None, world_size=2, sharded=True)
    assert p.weights == {"bfloat16": 40, "float32": 16}
    assert (p.grads, p.optimizer, p.host_bytes, p.shard_bytes, p.build_bytes) == (16, 32, 112, 56, 0)
    assert p.train_bytes == 40 + 16 + 16 + 32
    one = memory.plan(_Toy(), None, world_size=1, build_dtype=torch.bfloat16)
    assert (one.build_bytes, one.train_bytes) == (112, 112 + 32 + 64)
    assert memory.plan(_Toy(), None, world_size=1).build_bytes == 192
    with pytest.raises(ValueError, match=r"(?s)training it would take about .*Ways out: more GPUs"):
        memory.check_fits(one, torch.device("cpu"), 200, model="toy", ways=["more GPUs"])
    memory.check_fits(one, torch.device("cpu"), 220, model="toy")


def test_dry_run_prints_the_plan_and_refuses_what_does_not_fit(tmp_path: Path) -> None:
    ok = subprocess.run([sys.executable, "-m", "vlpack", "train", "--dry-run",
                         f"train.output_dir={tmp_path}"], capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "memory plan of tiny-qwen3_vl" in ok.stdout and "fits:" in ok.stdout, ok.stdout
    assert "activations: loss" in ok.stdout and not (tmp_path / "metrics.jsonl").exists()
    # full fine-tuning of the 35B on this machine: refused, LoRA among the ways out
    # (with auto: every layer recomputes, and that does not fit either)
    big = subprocess.run([sys.executable, "-m", "vlpack", "train", "qwen3.5-35b-a3b",
                          "--dry-run", "model.checkpoint_share=auto"], capture_output=True,
                         text=True, timeout=300)
    assert big.returncode == 1, big.stdout + big.stderr[-2000:]
    assert "does not fit" in big.stdout and "model.lora.rank=16" in big.stdout, big.stdout
    assert "40 of 40 text layers recompute (share 1.0)" in big.stderr, big.stderr[-2000:]
    assert "which no share fits" in big.stderr


def test_dry_run_refuses_data_that_does_not_exist(tmp_path: Path) -> None:
    """A dry run reads no data, but a data.path (or a data.mix source) that is not there is
    refused as the run would refuse it, not planned as if it fit."""
    from vlpack.train.command import print_plan

    gone = tmp_path / "gone.jsonl"
    with pytest.raises(ValueError, match=r"data\.source=jsonl: .*gone\.jsonl does not exist"):
        print_plan(small_cfg(tmp_path, "data.source=jsonl", f"data.path={gone}",
                             "model.init=random"))
    with pytest.raises(ValueError, match=r"gone\.jsonl does not exist"):
        print_plan(small_cfg(tmp_path, "model.init=random",
                             f"data.mix=[{{source: jsonl, path: {gone}, weight: 1}}]"))


def test_out_of_memory_in_a_step_ends_with_one_paragraph(tmp_path: Path, monkeypatch,
                                                         capsys) -> None:
    def oom(self, mbs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(Trainer, "train_step", oom)
    assert train(small_cfg(tmp_path, "train.max_steps=2")) == 1
    out = capsys.readouterr().out
    assert "vlpack: error: out of cpu memory in step 1" in out, out
    assert "the memory plan counted" in out and "Ways out: " in out and "--dry-run" in out
    assert "Traceback" not in out and "Tried to allocate" not in out and "auto" not in out
    # the share auto chose from the plan (this machine's room: nothing recomputes)
    assert train(small_cfg(tmp_path / "auto", "train.max_steps=2",
                           "model.activation_checkpointing=true",
                           "model.checkpoint_share=auto")) == 1
    assert "model.checkpoint_share=auto having chosen 0.0 from it" in capsys.readouterr().out


def test_memory_check_warn_and_skip_start_a_refused_run(tmp_path: Path, monkeypatch, caplog) -> None:
    """The plan is an estimate: train.memory_check=warn starts a run it refuses (saying so),
    skip does not look."""
    import logging

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1024)
    with pytest.raises(ValueError, match=r"train.memory_check=warn to start it anyway"):
        Trainer(small_cfg(tmp_path / "a"), CPU)
    caplog.set_level(logging.WARNING, logger="vlpack.train")
    Trainer(small_cfg(tmp_path / "b", "train.memory_check=warn"), CPU)
    assert "train.memory_check=warn: starting although" in caplog.text
    Trainer(small_cfg(tmp_path / "c", "train.memory_check=skip"), CPU)


# --- a model too large for the machine ---------------------------------------------------------------
def test_a_model_too_large_fails_before_it_is_built(tmp_path: Path, monkeypatch) -> None:
    """The 35B-A3B preset on a machine with a few GiB: refused in about a second, with the
    numbers, instead of running out of host memory while building random weights."""
    monkeypatch.setattr(memory, "available_bytes", lambda device: 8 * memory.GIB)
    with pytest.raises(ValueError, match=r"model.name=qwen3.5-35b-a3b has 35.1\d B parameters .*"
                                         r"would take about 5\d\d.\d GiB on each cpu device, but 8.0 GiB"):
        Trainer(small_cfg(tmp_path, "model.name=qwen3.5-35b-a3b"), CPU)


# --- model.checkpoint_share=auto ---------------------------------------------------------------------
def _cut_lora(*extra: str):
    from vlpack.config import load_config

    return load_config("qwen3.5-35b-a3b-lora", ["model.name=qwen3.5-35b-a3b-8L",
                                                "data.seq_len=32768", "train.memory_check=refuse",
                                                *extra])


def test_auto_share_recomputes_the_fewest_layers_that_fit(caplog, monkeypatch) -> None:
    """The 35B-A3B cut to 8 text layers, LoRA at 32k tokens: with the free memory just above what
    the plan with k recomputed layers needs, auto recomputes k (the reference: each fixed share
    k / 8, planned one by one); just below, k + 1; where nothing fits or the free memory is
    unknown, all 8; where everything fits, none (activation checkpointing off)."""
    import logging


    fixed = [_plan(_cut_lora("model.activation_checkpointing=false"), CPU)[0]]
    fixed += [_plan(_cut_lora("model.activation_checkpointing=true",
                                    f"model.checkpoint_share={k / 8}"), CPU)[0]
              for k in range(1, 9)]
    needs = [p.train_bytes for p in fixed]
    assert all(a > b for a, b in itertools.pairwise(needs)) and fixed[8].build_bytes < needs[8]
    auto = _cut_lora("model.activation_checkpointing=true", "model.checkpoint_share=auto")

    def share(free: int | None) -> float:
        return _plan(auto, CPU, free=free)[0].recompute_share

    for k in (0, 3, 8):
        just_enough = -(-needs[k] // (1 - memory.HEADROOM)) + 8
        assert share(just_enough) == k / 8
        if k < 8:
            assert share(just_enough - 2 * memory.GIB * (needs[k] > needs[k + 1])) == (k + 1) / 8
    assert share(1) == 1.0
    monkeypatch.setattr(memory, "available_bytes", lambda device: None)  # cannot be read
    assert share(None) == 1.0
    caplog.set_level(logging.INFO, logger="vlpack.train")
    _plan(_cut_lora("model.activation_checkpointing=false", "model.checkpoint_share=auto"),
                CPU)
    assert "auto has no effect without model.activation_checkpointing=true" in caplog.text
    share(needs[8] // 2)
    assert "8 of 8 text layers recompute (share 1.0)" in caplog.text and "which no share fits" \
        in caplog.text


def _auto_rank(rank: int, port: int, out: str) -> None:
    """One of 2 gloo ranks planning the 8-layer cut with auto: rank 0 with just enough room for 1
    recomputed layer, rank 1 for 3 (the reference: each rank's own plan at the fixed share).
    Writes the share it planned to `out`.RANK."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    from vlpack.train.distributed.parallel import init_distributed, shutdown

    topo = init_distributed(1)
    cfg = _cut_lora("model.activation_checkpointing=true", "model.checkpoint_share=auto")
    k = 1 if rank == 0 else 3
    fixed = _cut_lora("model.activation_checkpointing=true", f"model.checkpoint_share={k / 8}")
    need = _plan(fixed, topo)[0]
    free = int(max(need.train_bytes, need.build_bytes) / (1 - memory.HEADROOM)) + 8
    plan = _plan(cfg, topo, free=free)[0]
    Path(f"{out}.{rank}").write_text(str(plan.recompute_share))
    shutdown()


def test_auto_share_is_the_same_on_every_rank(tmp_path: Path) -> None:
    """Ranks that recompute different layers would run different collectives in backward under
    FSDP2: auto takes the share the rank with the least room needs, on both ranks."""
    from tests.helpers import run_ranks

    out = tmp_path / "share"
    assert run_ranks(_auto_rank, str(out), world=2, timeout=300) == [0, 0]
    assert [float(Path(f"{out}.{r}").read_text()) for r in range(2)] == [3 / 8, 3 / 8]


def test_auto_share_sets_the_layers_that_recompute(tmp_path: Path, monkeypatch) -> None:
    """tiny's 2 text layers and 2 vision blocks: with room for one kept layer but not two, the
    first of each stack recomputes and the second keeps its activations; with room for both,
    activation checkpointing is off."""

    ac = ("model.activation_checkpointing=true",)
    keep_one = _plan(small_cfg(tmp_path, *ac, "model.checkpoint_share=0.5"), CPU)[0]
    keep_all = _plan(small_cfg(tmp_path, "model.activation_checkpointing=false"), CPU)[0]
    assert keep_all.train_bytes > keep_one.train_bytes
    for room, expected in ((keep_one, [True, False]), (keep_all, [False, False])):
        free = int(room.train_bytes / (1 - memory.HEADROOM)) + 64
        monkeypatch.setattr(memory, "available_bytes", lambda device, free=free: free)
        out = tmp_path / str(expected)
        trainer = Trainer(small_cfg(out, *ac, "model.checkpoint_share=auto"), CPU)
        for stack in (trainer.model.model.language_model.layers, trainer.model.model.visual.blocks):
            assert [bool(getattr(x, "gradient_checkpointing", False)) for x in stack] == expected
        assert trainer.plan.recompute_share == expected.count(True) / 2


def test_the_plan_recomputes_the_layers_that_recompute() -> None:
    """share 0.28 (7 / 25) of the 25-layer cut: the model recomputes 7 text layers (0.28 · 25
    rounds to 7.000000000000001) and 8 of its 27 vision blocks (0.28 · 27 = 7.56), and the plan
    counts the same: its text layers as at share 0.27 (7 layers, not 8 as at 0.29), its vision
    blocks as at 0.29 (8 blocks, not 7 as at 0.25)."""
    from vlpack.model.recompute import enable_activation_checkpointing

    model = meta_model("qwen3.5-35b-a3b-25L")

    def acts(share: float) -> dict[str, int]:
        run = memory.RunShape(seq_len=64, patches=64, recompute_share=share, act_bytes=2)
        return memory.activation_bytes(model, run)

    assert acts(0.28)["text layers"] == acts(0.27)["text layers"] != acts(0.29)["text layers"]
    assert acts(0.28)["vision blocks"] == acts(0.29)["vision blocks"] != acts(0.25)["vision blocks"]
    assert enable_activation_checkpointing(model, 0.28) == {"model.visual.blocks": 8,
                                                            "model.language_model.layers": 7}


def test_ways_out_offer_more_recomputation_only_where_some_layers_keep() -> None:
    model = meta_model("tiny-qwen3_vl")

    def ways(share: float) -> str:
        run = memory.RunShape(seq_len=64, patches=64, recompute_share=share, act_bytes=2)
        return " ".join(memory.ways_out(memory.plan(model, run, world_size=1), lora=True, cp=1))

    assert "recompute more of each layer stack" in ways(0.0) and "checkpoint_share=1.0" in ways(0.5)
    assert "recompute more" not in ways(1.0) and "parallel.cp=2" in ways(1.0)


def test_ways_out_offer_8bit_moments_where_the_training_state_outweighs_activations() -> None:
    """_Toy without activations planned: 32 bytes of gradients and 64 of float32 moments offer
    optim.name=adamw8bit; a plan with 8-bit moments does not offer it again."""
    def ways(optimizer: str) -> str:
        p = memory.plan(_Toy(), None, world_size=1, optimizer=optimizer)
        return " ".join(memory.ways_out(p, lora=False, cp=1))

    assert "optim.name=adamw8bit" in ways("adamw") and "adamw8bit" not in ways("adamw8bit")


# --- train.memory_check=shorten -----------------------------------------------------------------
def test_bin_lengths_and_micro_batches_by_hand() -> None:
    """The lengths `shorten` tries below 32,768 (sixteenths, then halvings, at least MIN_BIN,
    multiples of the alignment) and the micro-batches nearest to a step's tokens, written out."""
    from vlpack.train.setup.stack import bin_lengths

    assert bin_lengths(32768, 8) == [30720, 28672, 26624, 24576, 22528, 20480, 18432, 16384,
                                     14336, 12288, 10240, 8192, 6144, 4096, 2048, 1024]
    assert bin_lengths(2048, 8) == [1920, 1792, 1664, 1536, 1408, 1280, 1152, 1024]
    assert bin_lengths(2000, 48) == [1872, 1728, 1584, 1488, 1344, 1248, 1104]
    assert bin_lengths(1024, 8) == []
    assert [memory.micro_batches_for(1, 32768, n) for n in (16384, 10240, 6144, 24576, 30720)] \
        == [2, 3, 5, 1, 1]
    assert memory.micro_batches_for(4, 8192, 10240) == 3
    assert memory.tokens_kept(32768, 32768) == "keeps the tokens per step"
    assert memory.tokens_kept(32768, 30720) == "gives 30,720 tokens per step where 32,768 were asked"


def test_shorten_trains_the_longest_bins_that_fit() -> None:
    """The 35B-A3B cut to 8 layers, LoRA, every layer recomputed, 32k bins: with just enough
    room for the plan at 8,192 tokens (the reference: the plan at each fixed data.seq_len),
    `shorten` plans 8,192-token bins and 4 micro-batches per step, and `refuse` names that
    length in its ways out; just below, 6,144 and 5 micro-batches (30,720 tokens a step); where
    even MIN_BIN-token bins do not fit, none is named and the run is refused."""
    from vlpack.train.setup.stack import MIN_BIN, check_plan, shorten_to_plan

    ac = ("model.activation_checkpointing=true", "model.checkpoint_share=1.0",
          "train.memory_check=refuse")
    at = {n: _plan(_cut_lora(*ac, f"data.seq_len={n}"), CPU,
                         free=2**50)[0].train_bytes for n in (32768, 10240, 8192, 6144)}
    assert at[32768] > at[10240] > at[8192] > at[6144]
    for room, fitting, micro in ((at[8192], 8192, 4), (at[8192] - 2**20, 6144, 5)):
        free = -(-room // (1 - memory.HEADROOM)) + 8
        cfg = _cut_lora(*ac, "train.memory_check=shorten")
        plan, _ = _plan(cfg, CPU, free=free)
        assert (plan.seq_len, plan.train_bytes) == (fitting, at[fitting])
        check_plan(plan, cfg, CPU, preparation(cfg, CPU), [], setting="shorten", free=free)
        shorten_to_plan(cfg, plan, CPU, free)
        assert (cfg.data.seq_len, cfg.train.micro_batches) == (fitting, micro)
        refused, ways = _plan(_cut_lora(*ac), CPU, free=free)
        assert (refused.seq_len, refused.fitting_seq_len) == (32768, fitting)
        assert f"data.seq_len={fitting} train.micro_batches={micro} fits" in " ".join(ways)
        with pytest.raises(ValueError, match=f"data.seq_len={fitting} train.micro_batches"):
            check_plan(refused, _cut_lora(*ac), CPU, preparation(_cut_lora(*ac), CPU), ways, free=free)
    budget = _cut_lora(*ac, "train.memory_check=shorten", "train.tokens_per_step=20000")
    plan, _ = _plan(budget, CPU, free=free)
    shorten_to_plan(budget, plan, CPU, free)
    assert (budget.data.seq_len, budget.train.micro_batches) == (6144, 1)  # the budget sets them
    cfg = _cut_lora(*ac, "train.memory_check=shorten")
    plan, ways = _plan(cfg, CPU, free=1)
    assert MIN_BIN == 1024 and plan.seq_len == 32768 and plan.fitting_seq_len == 0
    assert not any("shorter bins" in w for w in ways)  # no shorter bins fit: not offered
    with pytest.raises(ValueError, match="training it would take about"):
        check_plan(plan, cfg, CPU, preparation(cfg, CPU), ways, setting="shorten", free=1)


def test_shorten_through_the_trainer(tmp_path: Path, monkeypatch, caplog) -> None:
    """tiny in bins of 2,048 tokens that do not fit and 1,024 that do: the trainer
    says what it chose, trains 1,024-token bins, 2 of them a step, and its saved config says so."""
    import logging

    import yaml


    fits = _plan(small_cfg(tmp_path / "p", "data.seq_len=1024"), CPU)[0]
    free = int(fits.train_bytes / (1 - memory.HEADROOM)) + 64
    assert _plan(small_cfg(tmp_path / "p", "data.seq_len=2048"), CPU,
                       free=free)[0].fitting_seq_len == 1024
    monkeypatch.setattr(memory, "available_bytes", lambda device: free)
    caplog.set_level(logging.INFO, logger="vlpack.train")
    out = tmp_path / "run"
    trainer = Trainer(small_cfg(out, "data.seq_len=2048", "train.memory_check=shorten",
                                "train.max_steps=1"), CPU)
    assert "training with 1,024-token bins (2,048 did not fit: train.memory_check=shorten), " \
           "2 per step" in caplog.text
    trainer.fit()
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert (saved["data"]["seq_len"], saved["train"]["micro_batches"]) == (1024, 2)
    import json

    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert row["real_tokens"] + row["padded_tokens"] <= 2 * 1024
    # resumed where 2,048-token bins fit: the run keeps its 1,024 × 2 (the stream's position
    # counts bins); under refuse it would be the user's own change, warned about on resume
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2**50)
    caplog.clear()
    again = Trainer(small_cfg(out, "data.seq_len=2048", "train.memory_check=shorten",
                              "train.max_steps=2"), CPU)
    assert (again.cfg.data.seq_len, again.cfg.train.micro_batches) == (1024, 2)
    assert "the resumed run trained 1024-token bins, 2 per step; it keeps them" in caplog.text
    fresh = Trainer(small_cfg(tmp_path / "fresh", "data.seq_len=2048",
                              "train.memory_check=shorten"), CPU)
    assert (fresh.cfg.data.seq_len, fresh.cfg.train.micro_batches) == (2048, 1)


def test_shorten_refuses_padded_batches_and_keeps_resumed_bins_only_under_shorten(
        tmp_path: Path) -> None:
    """Padded batches have no bins to shorten; a resumed run's bins are kept only where
    `shorten` could have chosen them (one of `bin_lengths(data.seq_len)`)."""
    from vlpack.train.setup.stack import keep_resumed_bins

    with pytest.raises(ValueError, match=r"data\.packing=none trains padded batches"):
        small_cfg(tmp_path, "data.packing=none", "train.memory_check=shorten")
    cases = [("shorten", (1024, 2), True), ("refuse", (1024, 2), False),
             ("shorten", (2048, 1), False), ("shorten", (4096, 1), False),
             ("shorten", (768, 1), False), ("shorten", (1000, 2), False),
             ("shorten", (1536, 1), True), ("shorten", None, False)]
    for check, resumed, kept in cases:
        cfg = small_cfg(tmp_path, "data.seq_len=2048", f"train.memory_check={check}")
        assert keep_resumed_bins(cfg, resumed, CPU) == kept
        assert cfg.data.seq_len == (resumed[0] if kept else 2048)


def test_the_first_step_autotunes_only_where_no_configurations_serve() -> None:
    """vlpack's kept configurations serve the H100 and H200 (train.tuned_kernels); a user's
    FLA_CONFIG_DIR serves any card; otherwise fla autotunes in step 1."""
    from vlpack.config import load_config
    from vlpack.train.setup.stack import fla_autotunes

    cfg, off = load_config("tiny"), load_config("tiny", ["train.tuned_kernels=false"])
    assert not fla_autotunes(cfg, "NVIDIA H100 80GB HBM3", {})
    assert not fla_autotunes(cfg, "NVIDIA H200", {})
    assert fla_autotunes(cfg, "NVIDIA A100-SXM4-80GB", {})
    assert fla_autotunes(off, "NVIDIA H200", {})
    assert not fla_autotunes(off, "NVIDIA A100-SXM4-80GB", {"FLA_CONFIG_DIR": "/mine"})


def test_dry_run_for_a_card_this_machine_does_not_have(capsys) -> None:
    """`--dry-run --device-memory SIZE` plans one GPU of that size from a CPU machine: the
    35B-A3B LoRA recipe as shipped chooses 10k bins × 3 on an 80 GB H100 (79.18 GiB as torch
    reports it) and its 32k bins × 1 on an H200 (139.7 GiB); --device-memory alone, or a size
    that is not one, is refused."""
    from vlpack.cli import main, parse_size

    assert main(["train", "qwen3.5-35b-a3b-lora", "--dry-run", "--device-memory", "79.18GiB"]) == 0
    out = capsys.readouterr().out
    assert "on one GPU of 79.2 GiB (78.7 GiB free)" in out
    assert "chooses: 10,240-token bins (32,768 did not fit: train.memory_check=shorten), 3 per " \
           "step;" in out and "(model.checkpoint_share=auto); compiled (layers)" in out
    assert main(["train", "qwen3.5-35b-a3b-lora", "--device-memory=139.7GiB", "--dry-run"]) == 0
    assert "chooses: 32,768-token bins, 1 per step;" in capsys.readouterr().out
    assert main(["train", "qwen3.5-35b-a3b-lora", "--device-memory", "80GiB"]) == 2
    assert "add --dry-run" in capsys.readouterr().err
    for bad in ("eighty", "80"):
        assert main(["train", "tiny", "--dry-run", "--device-memory", bad]) == 2
        assert "give a size with its unit, such as 80GiB" in capsys.readouterr().err
    assert main(["train", "tiny", "--dry-run", "--device-memory", "100MiB"]) == 2
    assert "less than a GPU's CUDA context" in capsys.readouterr().err
    assert (parse_size("80GiB", "x"), parse_size("80 GB", "x"), parse_size("1.5gib", "x")) == (
        80 * 2**30, 80 * 10**9, 3 * 2**29)
    assert memory.usable_bytes(100 * memory.GIB, torch.device("cuda")) == int(
        95 * memory.GIB) - memory.GPU_RESERVE
    assert memory.usable_bytes(100 * memory.GIB, CPU.device) == int(95 * memory.GIB)


def test_a_first_step_that_autotunes_fla_is_planned(tmp_path: Path) -> None:
    """On a GPU vlpack keeps no fla kernel configurations for, Triton autotunes the
    Gated-DeltaNet kernels in step 1: a model with such layers plans AUTOTUNE_RESERVE more (a
    line of its own), one without them nothing."""

    for model, gdn in (("tiny-qwen3_5", True), ("tiny-qwen3_vl", False)):
        cfg = small_cfg(tmp_path, f"model.name={model}")
        plain = _plan(cfg, CPU, free=2**50)[0]
        tuning = _plan(cfg, CPU, free=2**50, autotunes=True)[0]
        assert tuning.train_bytes - plain.train_bytes == memory.AUTOTUNE_RESERVE * gdn
        assert any("first step: fla autotuning" in line for line in tuning.lines()) == gdn


def test_cpu_offload_moves_the_training_state_to_the_host(capsys) -> None:
    """train.cpu_offload on _Toy sharded over 2 ranks: 0 bytes of weights, gradients and
    moments on the device; 40 + 16 (weight shards) + 16 (gradients) + 32 (moments) = 104 on
    the host, which the host check adds to rank 0's 112-byte copy for each local rank. A
    dry-run of the 8B LoRA recipe on an 80 GB GPU under train.fsdp=always prints the host
    line and no device bytes of moments."""
    from vlpack.cli import main

    p = memory.plan(_Toy(), None, world_size=2, sharded=True, offload=True)
    assert (p.weights, p.grads, p.optimizer, p.offloaded, p.train_bytes) == ({}, 0, 0, 104, 0)
    assert any("offloaded to host memory" in line for line in p.lines())
    memory.check_host_copy(p, 216, model="toy")
    with pytest.raises(ValueError, match=r"its ranks offload 0\.0 GiB \(train\.cpu_offload\)"):
        memory.check_host_copy(p, 215, model="toy")
    args = ["train", "qwen3-vl-8b-lora", "--dry-run", "--device-memory", "79.18GiB",
            "train.fsdp=always"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "train.cpu_offload=true"]) == 0
    offloaded = capsys.readouterr().out
    assert "offloaded to host memory" in offloaded and "offloaded" not in plain
    moments = [line for line in offloaded.splitlines() if "AdamW moments" in line]
    assert moments and moments[0].split()[-2] == "0.00", moments


@pytest.mark.parametrize("freezes", ["model.freeze_vision=true", "model.freeze_merger=true"])
def test_the_plan_counts_the_parameters_the_build_trains(tmp_path: Path, freezes: str) -> None:
    """LoRA on the vision tower with a frozen vision part: the build applies LoRA, then freezes
    the group with its adapters, and the plan counts the gradients and optimizer state of the
    parameters that train in the model built."""
    from vlpack.train.setup.stack import build_stack

    cfg = small_cfg(tmp_path, "model.lora.rank=4", "model.lora.vision=true", freezes)
    plan = _plan(cfg, CPU)[0]
    model = build_stack(cfg, CPU).model
    assert plan.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert plan.params == sum(p.numel() for p in model.parameters())
