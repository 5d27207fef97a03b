"""The planted-bug gate: each bug below, planted in a copy of the source tree, must be caught.

Every mutation is a literal text edit of one file of `src/vlpack` (each edit must match exactly
once, so the gate fails loudly when the code it plants into changes). The copy is put first on
PYTHONPATH and the mutation's catchers run against it in a fresh process:
  - `vlpack check` on a tiny preset, once: it must exit 1 (failed), not 0 (passed) or 2 (could
    not run). `--dtype bfloat16` runs every float32 item and then the bf16 ones, so one run
    serves both precisions: a plant whose `dtypes` hold float32 must fail a float32 item of it
    (as `--dtype float32` alone would fail), a plant only autocast runs (`dtypes` bfloat16
    alone) a bf16 item; a plant in the encoding runs it with `--data` (`agent_data`), so its
    samples are compared with transformers' processor, in float32 (the encoding has no
    precision);
  - named tests of the fast suite: they must fail.
A plant in a path the check exercises (model/, data/batch.py, data/rope.py) must have the check
among its catchers, or say in `why_not` why the check cannot see it.
docs/pitfalls.md lists each bug with what catches it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from vlpack.check.run import TOLERANCES

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to src/vlpack
    old: str
    new: str
    check: str | None = None  # the tiny preset `vlpack check` must fail on (fp32 and bf16)
    tests: tuple[str, ...] = ()  # test node ids that must fail
    margin: float | None = None  # the fp32 contract's logit error must exceed margin x tol
    dtypes: tuple[str, ...] = ("float32", "bfloat16")  # the check's items that must fail
    extra: tuple[tuple[str, str], ...] = ()  # more (old, new) edits of the same file
    why_not: str = ""  # why the check cannot see a plant in a path it exercises
    data: bool = False  # the check runs on `agent_data` (--data), so the encoding is compared


CP = "the check's context parallelism runs under torchrun (--cp); the gate runs one process"
FLA_PROBE = """    except Exception:
        return None
    return conv, gdr"""
"""gdn._fla's probe: planted to return a pair, fla is "importable" on the CPU (the packed path
still runs per segment there: fla needs CUDA tensors)."""

GDN_PER_SEGMENT = """    outs = [
        torch_fn(query[:, s:e], key[:, s:e], value[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                 use_qk_l2norm_in_kernel=True)[0]
        for s, e in itertools.pairwise(segs.host)
    ]"""
GDN_CARRIES_STATE = """    outs, state = [], None
    for s, e in itertools.pairwise(segs.host):
        o, state = torch_fn(query[:, s:e], key[:, s:e], value[:, s:e], g=g[:, s:e],
                            beta=beta[:, s:e], initial_state=state, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
        outs.append(o)"""

def agent_data(folder: Path) -> Path:
    """`--data` for the encoding plants: a Qwen3.5 tool call after text (refused by Qwen2.5-VL,
    whose template writes no tools), a `loss: false` turn, a video of 8 small frames at 1 fps
    (4 temporal patches of 2 s: Qwen2.5-VL's temporal extent, 13, exceeds its 2x2 merged grid,
    so the two `mrope_after_video` rules differ) and a text row."""
    from tests.helpers import _chat, _frames

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    rows = [
        {"tools": [tool], "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather",
                                                  "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "18 C"},
            {"role": "assistant", "content": "Paris 18 C."}]},
        {"messages": [{"role": "user", "content": "Total?"},
                      {"role": "assistant", "content": "12.50", "loss": False},
                      {"role": "user", "content": "Date?"},
                      {"role": "assistant", "content": "2026-01-02"}]},
        _chat([{"type": "video", "video": _frames(folder, 8, size=(56, 56)), "fps": 1},
               {"type": "text", "text": "What changes?"}]),
        _chat("Hi", "Hello."),
    ]
    path = folder / "agent.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


MUTATIONS = [
    Mutation("labels shifted by two instead of one", "data/batch.py",
             "out[:-1] = labels_L[1:]", "out[:-2] = labels_L[2:]", check="tiny-qwen2_vl",
             tests=("tests/gates/test_thd_literal.py",)),
    Mutation("last label of a sample not masked", "data/batch.py",
             "out = np.full_like(labels_L, IGNORE_INDEX)", "out = labels_L.copy()",
             check="tiny-qwen3_vl", tests=("tests/gates/test_thd_literal.py",)),
    Mutation("positions not restarted per sample (MRoPE continues across the row)",
             "data/batch.py", "position_ids[1:, seg] = mrope",
             "position_ids[1:, seg] = mrope + start",
             why_not="a constant offset per sample cancels in RoPE's q.k: no output moves",
             tests=("tests/gates/test_thd_literal.py",
                    "tests/data/test_batch.py::test_batch_fields_match_per_sample_reference")),
    Mutation("image h and w positions swapped", "data/rope.py",
             "out[1, s:e] = hh.reshape(-1) + pos\n        out[2, s:e] = ww.reshape(-1) + pos",
             "out[1, s:e] = ww.reshape(-1) + pos\n        out[2, s:e] = hh.reshape(-1) + pos",
             check="tiny-qwen2_vl", tests=("tests/gates/test_thd_literal.py",), margin=10.0),
    Mutation("text attention boundaries off by one", "model/attention.py",
             "        segs = bounds.text\n",
             "        h = bounds.text.host\n"
             "        h = (h[0], *[b + 1 for b in h[1:-1]], h[-1])\n"
             "        segs = Segments(torch.tensor(h, dtype=torch.int32), h, "
             "max(b - a for a, b in itertools.pairwise(h)))\n",
             check="tiny-qwen3_vl"),
    Mutation("images of a bin attend to each other", "model/vision.py",
             "segs = bounds.vision.segments(cu_seqlens)",
             "segs = Segments.from_host((0, q_PHD.shape[0]), q_PHD.device)",
             check="tiny-qwen2_5_vl"),
    Mutation("vision tower frozen on the packed path only", "model/forward.py",
             "out = model.model(**inputs)",
             "model.model.visual.requires_grad_(False)\n"
             "        out = model.model(**inputs)\n"
             "        model.model.visual.requires_grad_(True)",
             check="tiny-qwen3_vl"),
    Mutation("deepstack index reused from the first forward", "model/deepstack.py",
             "visual_pos_masks = _Index(bounds.image_index)",
             'visual_pos_masks = _Index(self.__dict__.setdefault("_first", bounds.image_index))',
             check="tiny-qwen3_vl"),
    Mutation("vision tables (positions, interpolation taps) reused from the first forward",
             "model/vision.py", "kwargs.update(bounds.vision.tables)",
             'kwargs.update({**self.__dict__.setdefault("_first", bounds.vision.tables), '
             '"cu_seqlens": bounds.vision.full.cu})',
             check="tiny-qwen3_vl"),
    Mutation("vision tables (positions, window index and windows) reused from the first forward",
             "model/vision.py", "kwargs.update(bounds.vision.tables)",
             'kwargs.update({**self.__dict__.setdefault("_first", bounds.vision.tables), '
             '"cu_seqlens": bounds.vision.full.cu})',
             check="tiny-qwen2_5_vl"),
    Mutation("vision rotary positions reused from the first forward", "model/vision.py",
             "kwargs.update(bounds.vision.tables)",
             'kwargs.update({**bounds.vision.tables, "position_ids": self.__dict__.setdefault('
             '"_first", bounds.vision.tables["position_ids"])})',
             check="tiny-qwen2_vl"),
    Mutation("vision rotary positions all zero on the packed path", "model/vision.py",
             "kwargs.update(bounds.vision.tables)",
             'kwargs.update({**bounds.vision.tables, '
             '"position_ids": 0 * bounds.vision.tables["position_ids"]})',
             check="tiny-qwen3_5"),
    Mutation("Gated-DeltaNet recurrent state not reset at boundaries", "model/gdn.py",
             GDN_PER_SEGMENT, GDN_CARRIES_STATE, check="tiny-qwen3_5"),
    Mutation("context-parallel gather's backward keeps only this rank's gradient",
             "model/context.py", "            dist.all_reduce(total, group=ctx.group)\n", "",
             tests=("tests/gates/test_context_parallel.py::test_cp2_equals_cp1",), why_not=CP),
    Mutation("context-parallel attention's causal diagonal aligned to the first key",
             "model/attention.py", "[:, None] + (lk - lq))", "[:, None])",
             tests=("tests/gates/test_context_parallel.py::test_cp2_equals_cp1",), why_not=CP),
    Mutation("MoE aux loss counts padding", "model/forward.py",
             "labels_T, real_T = batch.labels, ~batch.padding_mask",
             "labels_T, real_T = batch.labels, torch.ones_like(batch.padding_mask)",
             check="tiny-qwen3_vl_moe"),
    Mutation("MoE aux term not averaged over micro-batches", "train/step.py",
             "obj = obj + aux_coef * (ws // topo.dp) * out.aux_loss / len(mbs)",
             "obj = obj + aux_coef * (ws // topo.dp) * out.aux_loss",
             tests=("tests/gates/test_step_gradient.py::"
                    "test_one_process_step_gradient_is_the_global_token_mean",)),
    Mutation("each micro-batch normalised by its own label count", "train/step.py",
             "obj = out.loss_sum * (ws / denom)",
             "obj = out.loss_sum * (ws / max(b.num_label_tokens, 1) / len(mbs))",
             tests=("tests/gates/test_step_gradient.py::"
                    "test_one_process_step_gradient_is_the_global_token_mean",
                    "tests/train/test_step.py::test_micro_batches_normalise_by_global_token_count")),
    Mutation("gradients halved on 2 ranks", "train/step.py",
             "obj = out.loss_sum * (ws / denom)", "obj = out.loss_sum * (1 / denom)",
             tests=("tests/gates/test_step_gradient.py::"
                    "test_two_rank_step_gradient_is_the_global_token_mean",)),
    Mutation("context-parallel Gated-DeltaNet: the chunk states' gather cut from the graph",
             "model/gdn.py", "gathered = split.gather_rows(summary)",
             "gathered = split.gather_rows(summary.detach())",
             tests=("tests/gates/test_context_parallel.py::test_cp2_equals_cp1",), why_not=CP),
    Mutation("context-parallel Gated-DeltaNet conv without its left halo", "model/gdn.py",
             "have = min(h, index * c.length)", "have = 0",
             tests=("tests/gates/test_context_parallel.py::test_cp2_equals_cp1",), why_not=CP),
    Mutation("Qwen2.5-VL video positions not spaced by time", "data/rope.py",
             "step = 1.0 if temporal_step_I is None else float(temporal_step_I[item])",
             "step = 1.0", check="tiny-qwen2_5_vl",
             tests=("tests/data/test_video.py::test_video_positions_match_transformers",)),
    Mutation("a qwen3-family video's temporal patches read as one span", "data/rope.py",
             "if kind == TOKEN_TYPE_VIDEO and t > 1 and e - s == gh * gw // spatial_merge_size**2:",
             "if False:",
             tests=("tests/data/test_video.py::test_video_positions_match_transformers",),
             why_not="the positions then refuse the sample: the check cannot run (exit 2)"),
    Mutation("qwen2-family frames sampled end to end (the qwen3 rule)", "data/video.py",
             'if r.style == "qwen3":\n        n = int(', 'if True:\n        n = int(',
             tests=("tests/data/test_video.py::test_frame_sampling_hand_worked",)),
    Mutation("Qwen3.5 dt_bias gets no gradient on the packed path", "model/gdn.py",
             "F.softplus(a.float() + dt_bias)", "F.softplus(a.float() + dt_bias.detach())",
             check="tiny-qwen3_5"),
    Mutation("Qwen3.5 dt_bias gets a zero gradient on the packed path", "model/gdn.py",
             "F.softplus(a.float() + dt_bias)",
             "F.softplus(a.float() + dt_bias.detach() + 0 * dt_bias)",
             check="tiny-qwen3_5"),
    Mutation("Qwen3.5 dt_bias dropped from the gate, with fla importable", "model/gdn.py",
             "F.softplus(a.float() + dt_bias)", "F.softplus(a.float())",
             extra=((FLA_PROBE, FLA_PROBE.replace("return None", "return (None, None)")),),
             check="tiny-qwen3_5"),
    Mutation("experts' dispatch applies the routing weights in the wrong order",
             "model/experts.py", "w_TK.reshape(-1)[order_P]",
             "w_TK.reshape(-1)", check="tiny-qwen3_vl_moe"),
    Mutation("chunked loss returns log-sum-exp instead of cross-entropy", "model/loss.py",
             "loss += ce_C.sum() if r_C is None else (ce_C * r_C).sum()",
             "loss += lse_C.sum() if r_C is None else (lse_C * r_C).sum()",
             check="tiny-qwen2_vl"),
    Mutation("the loader's filler row counted as a real token in the MoE statistics",
             "data/batch.py", "padding_mask[seg] = s.key == FILLER_KEY",
             "padding_mask[seg] = False",
             tests=("tests/gates/test_model_packed.py::test_filler_row_leaves_moe_statistics_untouched",),
             why_not="the check packs no filler row: its samples all encode"),
    Mutation("Qwen3.5: one newline instead of two before the first tool call after text",
             "data/tools.py", 'sep = "\\n" if j else "\\n\\n" if answer.strip() else ""',
             'sep = "\\n" if j else "\\n" if answer.strip() else ""', check="tiny-qwen3_5",
             dtypes=("float32",), data=True),
    Mutation("a `loss: false` turn's <|im_end|> still labelled", "data/encode.py",
             'r.token(ids["<|im_end|>"], supervised=sup)',
             'r.token(ids["<|im_end|>"], supervised=answer)', check="tiny-qwen3_5",
             dtypes=("float32",), data=True),
    Mutation("mrope_after_video=qwen: text after a video one position late", "data/rope.py",
             "else max(int(t_index[-1]) + 1, h, w)", "else max(int(t_index[-1]) + 2, h, w)",
             check="tiny-qwen2_5_vl", dtypes=("float32",), data=True),
    Mutation("qwen3-family video timestamps one frame late", "data/video.py",
             "times = [i / meta.fps for i in padded]",
             "times = [(i + 1) / meta.fps for i in padded]", check="tiny-qwen3_5",
             dtypes=("float32",), data=True),
    Mutation("LoRA on experts: B's factors read expert-major", "model/lora.py",
             "b_EOR = b.reshape(b.shape[0], -1, e).permute(2, 0, 1)",
             "b_EOR = b.reshape(b.shape[0], e, -1).permute(1, 0, 2)",
             tests=("tests/model/test_lora.py::test_lora_on_routed_experts",),
             why_not="the check runs the base model, without LoRA"),
]


def _plant(tmp: Path, m: Mutation) -> dict:
    """A copy of src/ with `m` applied; the environment that imports vlpack from it."""
    shutil.copytree(ROOT / "src", tmp / "src", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp / "src" / "vlpack" / m.file
    text = path.read_text()
    for old, new in ((m.old, m.new), *m.extra):
        assert text.count(old) == 1, f"{m.file}: the mutation's text must occur once: {old!r}"
        text = text.replace(old, new)
    path.write_text(text)
    env = {**os.environ, "PYTHONPATH": f"{tmp / 'src'}{os.pathsep}{ROOT}",
           "OMP_NUM_THREADS": "2", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("VLPACK_TRACEBACK", None)
    where = subprocess.run([sys.executable, "-c", "import vlpack; print(vlpack.__file__)"],
                           env=env, capture_output=True, text=True, cwd=ROOT, check=True)
    assert where.stdout.strip().startswith(str(tmp)), where.stdout  # the mutant is imported
    return env


def _check(env: dict, preset: str, dtype: str, data: Path | None = None
           ) -> tuple[int, dict, str]:
    run = subprocess.run(
        [sys.executable, "-m", "vlpack", "check", "--model", preset, "--samples", "3",
         "--dtype", dtype, "--json", *(("--data", str(data)) if data else ())],
        env=env, capture_output=True, text=True, cwd=ROOT, timeout=900)
    lines = run.stdout.strip().splitlines()
    report = json.loads(lines[-1]) if run.returncode == 1 and lines else {}
    return run.returncode, report, run.stderr[-2000:]


@pytest.mark.parametrize("m", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_planted_bug_is_caught(m: Mutation, tmp_path: Path) -> None:
    assert m.check or m.tests, "a mutation needs a catcher"
    env = _plant(tmp_path, m)
    if m.check:
        dtype = "bfloat16" if "bfloat16" in m.dtypes else "float32"
        rc, report, err = _check(env, m.check, dtype,
                                 agent_data(tmp_path / "data") if m.data else None)
        assert rc == 1, f"vlpack check --dtype {dtype} exited {rc} on {m.name!r}: {err}"
        bf16 = report["bf16_failures"]  # the rest are float32 items
        caught = bf16 if m.dtypes == ("bfloat16",) else [
            f for f in report["failures"] if f not in bf16]
        assert caught, (f"no {m.dtypes[0]} item of the check failed on {m.name!r}: "
                        f"{report['failures']}")
        if m.margin is not None:
            got, tol = report["contract_float32"]["max_logit_diff"], TOLERANCES["float32"]["logits"]
            assert got >= m.margin * tol, f"{m.name}: {got:.1e} is not {m.margin}x {tol:.0e}"
    if m.tests:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider",
                              *m.tests], env=env, capture_output=True, text=True, cwd=ROOT,
                             timeout=900)
        failed = [line.split()[1] for line in run.stdout.splitlines() if line.startswith("FAILED ")]
        survived = [t for t in m.tests if not any(f.startswith(t) for f in failed)]
        assert run.returncode == 1 and not survived, (
            f"{survived or m.tests} did not fail on {m.name!r}:\n{run.stdout[-3000:]}")


CHECKED_PATHS = ("model/", "data/batch.py", "data/rope.py")


def test_plants_in_the_checks_path_are_caught_by_the_check() -> None:
    """The gate asserts that `vlpack check` itself fails on every plant in a path it exercises
    (not only the suite), or says why it cannot see it."""
    unchecked = [m.name for m in MUTATIONS
                 if m.file.startswith(CHECKED_PATHS) and not m.check and not m.why_not]
    assert not unchecked, unchecked
