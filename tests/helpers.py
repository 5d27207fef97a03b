"""Helpers shared by test files: hand-built samples for tests that must not depend on the
tokenizer or images, process helpers, the small `tiny` run the trainer tests start, media files."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vlpack.config import DataConfig, load_config
from vlpack.data.types import IGNORE_INDEX, TOKEN_TYPE_IMAGE, EncodedSample
from vlpack.train.distributed.parallel import Topology

VISION_START, VISION_END, IMAGE_PAD = 151652, 151653, 151655
PAD = 151643


def make_sample(
    key: str,
    rng: np.random.Generator,
    *,
    text: tuple[int, ...] = (5, 7),
    grids: tuple[tuple[int, int, int], ...] = ((1, 4, 6),),
    patch_dim: int = 24,
    merge: int = 2,
    spec=None,
) -> EncodedSample:
    """Text runs interleaved with images: text[0] img0 text[1] img1 ... text[-1].

    The second half of the last text run is supervised (as an assistant answer would be).
    Vision token ids are Qwen2/3-VL's unless `spec` (a ModelSpec) gives its family's.
    """
    start, end, pad = ((spec.vision_start_token_id, spec.vision_end_token_id,
                        spec.image_token_id) if spec is not None
                       else (VISION_START, VISION_END, IMAGE_PAD))
    assert len(text) == len(grids) + 1
    ids, types = [], []
    for i, n in enumerate(text):
        ids += rng.integers(0, 150000, n).tolist()
        types += [0] * n
        if i < len(grids):
            t, h, w = grids[i]
            k = t * h * w // merge**2
            ids += [start, *([pad] * k), end]
            types += [0, *([TOKEN_TYPE_IMAGE] * k), 0]
    input_ids = np.array(ids, dtype=np.int64)
    labels = np.full_like(input_ids, IGNORE_INDEX)
    half = len(ids) - text[-1] // 2
    labels[half:] = input_ids[half:]
    grid_arr = np.array(grids, dtype=np.int64).reshape(-1, 3)
    patches = int(grid_arr.prod(axis=1).sum()) if len(grid_arr) else 0
    return EncodedSample(
        key=key,
        input_ids=input_ids,
        labels=labels,
        mm_token_type_ids=np.array(types, dtype=np.int8),
        image_grid_thw=grid_arr,
        pixel_values=rng.standard_normal((patches, patch_dim)).astype(np.float32) if patches else None,
    )


TEARDOWN_ABORT = "terminate called without an active exception"
"""A CPU gloo process that finished its work sometimes aborts while the interpreter exits (seen
on 2- and 4-process torchrun runs on the 2-core CI machine; its cause is not found)."""


def finished(run, done: tuple[str, ...] = ("vlpack: done", "vlpack: stopped early")):
    """`run` (a CompletedProcess of a torchrun job) with returncode 0 when its work ended (one of
    `done` on stdout) and it then died of exactly the teardown abort: what the tests compare
    (metrics, checkpoints, the printed report) was written before it."""
    if run.returncode and TEARDOWN_ABORT in run.stderr and any(d in run.stdout for d in done):
        run.returncode = 0
    return run


class GradRecorder(torch.optim.SGD):
    """SGD with lr 0 that keeps a copy of every gradient it is asked to apply: the gradient a
    training step produced, read where the optimizer sees it (DTensor shards gathered)."""

    def __init__(self, named):
        self.names = {id(p): n for n, p in named}
        super().__init__([p for _, p in named], lr=0.0)
        self.grads: dict[str, torch.Tensor] = {}

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    self.grads[self.names[id(p)]] = g.detach().clone()
        return super().step(closure)


def free_port() -> int:
    """A free TCP port on the loopback interface, for a test's process group."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(target, done: str, rank: int, port: int, *args) -> None:
    """One rank of `run_ranks`: `target(rank, port, *args)` with its stderr in the file
    `done`.err, and its exit code (a return is 0, a `sys.exit` the status the process would end
    with) written to the file `done` before the interpreter's teardown, which on gloo sometimes
    aborts after the work is done (`TEARDOWN_ABORT`). An exception writes no code."""
    err = os.open(f"{done}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    os.close(err)
    try:
        target(rank, port, *args)
    except SystemExit as e:
        code = 0 if e.code is None else (int(e.code) & 0xFF if isinstance(e.code, int) else 1)
        _write_code(done, code)
        raise
    _write_code(done, 0)


def _write_code(done: str, code: int) -> None:
    Path(f"{done}.tmp").write_text(str(code))
    os.replace(f"{done}.tmp", done)


def _rank_code(exitcode: int | None, done: str) -> int | None:
    """A rank's exit code, or the code its work ended with where it then died of the teardown
    abort: SIGABRT, a code written, and `TEARDOWN_ABORT` in its stderr."""
    if exitcode != -signal.SIGABRT or not Path(done).is_file():
        return exitcode
    err = Path(f"{done}.err")
    if not (err.is_file() and TEARDOWN_ABORT in err.read_text(errors="replace")):
        return exitcode
    try:
        return int(Path(done).read_text())
    except ValueError:
        return exitcode


def run_ranks(target, *args, world: int = 2, timeout: float = 300,
              grace: float = 60) -> list[int | None]:
    """`target(rank, port, *args)` in `world` spawned processes; their exit codes. The ranks
    still running `timeout` seconds after the start are killed (exit code -9), and so are those
    still running `grace` seconds after a rank failed: they wait in a collective for it. A rank
    that finished its work and then died of the teardown abort (`_rank_code`) counts with the
    exit code its work ended with. Each rank's stderr is copied to this process's at the end."""
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        done = [str(Path(tmp) / f"rank{r}") for r in range(world)]
        procs = [ctx.Process(target=_rank_main, args=(target, done[r], r, port, *args))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline, failed_at = time.monotonic() + timeout, None
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            codes = [_rank_code(p.exitcode, d) for p, d in zip(procs, done, strict=True)]
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() > failed_at + grace:
                break
            time.sleep(0.2)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        for r, d in enumerate(done):
            if Path(f"{d}.err").is_file():
                text = Path(f"{d}.err").read_text(errors="replace")
                if text:
                    sys.stderr.write(f"--- rank {r} stderr ---\n{text}")
        return [_rank_code(p.exitcode, d) for p, d in zip(procs, done, strict=True)]


def split_data(kw: dict) -> tuple[DataConfig, dict]:
    """The `DataConfig` of the keywords in `kw` that name a `data.*` field (the rest at the
    config's defaults), and the other keywords: a data component's runtime arguments."""
    names = {f.name for f in dataclasses.fields(DataConfig)}
    return (DataConfig(**{k: v for k, v in kw.items() if k in names}),
            {k: v for k, v in kw.items() if k not in names})


CPU = Topology(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


SMALL = ["data.synthetic_samples=24", "data.seq_len=512", "data.min_pixels=16384", "data.max_pixels=50176",
         "data.video.min_pixels=4096", "data.video.max_pixels=50176",
         "data.buffer_size=8", "data.eval_samples=0", "train.progress=false",
         "train.eval_every=0", "train.save_every=0"]


def small_cfg(out: Path, *extra: str):
    return load_config("tiny", [*SMALL, f"train.output_dir={out}", *extra])


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _frames(folder: Path, n: int, size=(90, 120), seed: int = 0, name: str = "f") -> list[str]:
    """`n` random RGB frames of `size` (h, w) as PNGs; their names."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(
            folder / f"{name}{i}.png")
        names.append(f"{name}{i}.png")
    return names


def _mp4(path: Path, n: int, fps: int = 10, size=(64, 96), seed: int = 0) -> np.ndarray:
    """Write an `n`-frame mp4 of smooth random frames; the frames written."""
    av = pytest.importorskip("av")
    rng = np.random.default_rng(seed)
    frames = np.repeat(np.repeat(rng.integers(0, 256, (n, size[0] // 8, size[1] // 8, 3),
                                              dtype=np.uint8), 8, 1), 8, 2)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[1], size[0], "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return frames


def _dirty_data(tmp_path: Path) -> Path:
    """The 24 synthetic samples and three bad ones: a broken JSON line, a missing image (both
    skipped while planning) and an image whose header reads but whose body does not (skipped
    at encode time, by the rank whose bin holds it)."""
    import shutil

    from PIL import Image

    from vlpack.data.synth import default_dataset

    out = tmp_path / "data"
    shutil.copytree(default_dataset(n=24).parent, out)
    Image.new("RGB", (64, 64), (200, 30, 30)).save(out / "cut.png")
    (out / "cut.png").write_bytes((out / "cut.png").read_bytes()[:60])
    lines = (out / "data.jsonl").read_text().splitlines()
    ask = [{"from": "human", "value": "<image>\nTotal?"}, {"from": "gpt", "value": "1"}]
    bad = ["{not json", json.dumps({"id": "gone", "conversations": ask, "image": "nope.png"}),
           json.dumps({"id": "cut", "conversations": ask, "image": "cut.png"})]
    (out / "data.jsonl").write_text("\n".join(bad[:1] + lines[:2] + bad[1:] + lines[2:]) + "\n")
    return out / "data.jsonl"


# transformers' own model-test configs (tests/models/<family>/test_modeling_<family>.py): vocab
# 99, bos 0, eos 1, pad 2, image 3, video 4, vision start 5, vision end 6; hidden 32, 2 layers.
TEXT = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "hidden_act": "silu",
        "hidden_size": 32, "vocab_size": 99, "intermediate_size": 37,
        "max_position_embeddings": 512, "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000, "mrope_section": [2, 1, 1]}}


IDS = {"image_token_id": 3, "video_token_id": 4, "vision_start_token_id": 5,
       "vision_end_token_id": 6, "tie_word_embeddings": True}


ROPE3 = {"rope_type": "default", "rope_theta": 10000, "mrope_section": [2, 1, 1],
         "mrope_interleaved": True}


VISION3 = {"depth": 2, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 32,
           "intermediate_size": 32, "out_hidden_size": 32, "num_heads": 4, "patch_size": 16,
           "spatial_merge_size": 1, "temporal_patch_size": 2, "num_position_embeddings": 16}


MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}


GDN = {"head_dim": 32, "layer_types": ["full_attention", "linear_attention"],
       "linear_conv_kernel_dim": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
       "linear_num_key_heads": 4, "linear_num_value_heads": 8, "rope_parameters": ROPE3}


HF_TEST_CONFIGS = {
    "qwen2_vl": dict(text_config=TEXT, vision_config={
        "depth": 2, "embed_dim": 32, "hidden_act": "quick_gelu", "hidden_size": 32,
        "mlp_ratio": 4, "num_heads": 4, "patch_size": 14, "spatial_merge_size": 2,
        "temporal_patch_size": 2}),
    "qwen2_5_vl": dict(text_config=TEXT, vision_config={
        "depth": 2, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 32,
        "out_hidden_size": 32, "num_heads": 4, "patch_size": 14, "spatial_merge_size": 1,
        "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [0],
        "tokens_per_second": 2}),
    "qwen3_vl": dict(text_config={**TEXT, "head_dim": 8, "rope_parameters": ROPE3},
                     vision_config={**VISION3, "deepstack_visual_indexes": [0, 1]}),
    "qwen3_vl_moe": dict(text_config={**TEXT, **MOE, "head_dim": 8, "rope_parameters": ROPE3,
                                      "decoder_sparse_step": 1, "mlp_only_layers": []},
                         vision_config={**VISION3, "deepstack_visual_indexes": [0, 1]}),
    "qwen3_5": dict(text_config={**TEXT, **GDN}, vision_config=VISION3),
    "qwen3_5_moe": dict(text_config={**TEXT, **GDN, **MOE, "shared_expert_intermediate_size": 16},
                        vision_config=VISION3),
}


def hf_test_folder(path, family: str, weights: bool = True):
    """A checkpoint folder of transformers' test config of `family` (random weights saved with
    save_pretrained, or config.json alone)."""
    import torch
    import transformers
    from transformers import CONFIG_MAPPING

    from vlpack.families import family as family_of

    config = CONFIG_MAPPING[family](**HF_TEST_CONFIGS[family], **IDS)
    if not weights:
        config.save_pretrained(path)
        return path
    torch.manual_seed(0)
    getattr(transformers, family_of(family).hf_class)(config).save_pretrained(path)
    return path


def _report(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _rows(tmp_path: Path, rows: list) -> Path:
    """A JSONL file of `rows` (dicts; a string is written as it is: a bad record)."""
    data = tmp_path / "mine.jsonl"
    data.write_text("".join((json.dumps(r) if isinstance(r, dict) else r) + "\n" for r in rows))
    return data


def _chat(q, a: str = "A receipt.") -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def tiny_routed_experts(impl: str, *, inter: int = 16, train: bool = False,
                        dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A routed experts module of tiny-qwen3_5_moe (hidden 64) with expert width `inter` (16:
    2I != D, so no width is mistaken for another), run by `impl`, weights in `dtype` drawn from
    N(0, 0.1) with seed 0, trained or frozen."""
    import copy

    from vlpack.model import build_model

    model, _ = build_model("tiny-qwen3_5_moe", device="cpu")
    tiny = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    cfg = copy.deepcopy(tiny.config)
    cfg.moe_intermediate_size = inter
    cfg._experts_implementation = impl
    ex = type(tiny)(cfg)
    g = torch.Generator().manual_seed(0)
    for p in ex.parameters():
        p.data.normal_(0, 0.1, generator=g)
    return ex.to(dtype).requires_grad_(train)


def bench_module(name: str):
    """The script `bench/<name>.py` as a module (imported with bench/ on the path, as its own
    imports of other bench scripts need)."""
    folder = str(Path(__file__).resolve().parents[1] / "bench")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)
