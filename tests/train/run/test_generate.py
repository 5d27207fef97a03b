"""`vlpack eval` and train.eval_generate_every on the tiny preset: the prompts are the encoder's
tokens up to each answer's header (against a slow cut of the whole conversation and, for a
text-only conversation, the family template's generation prompt); greedy `generate` in
left-padded batches equals a hand-written argmax loop over the model's forward; the command
writes its two files; the training hook logs its keys."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import CPU, small_cfg
from vlpack.cli import main
from vlpack.data.chat_templates import family_template
from vlpack.data.encode import Encoder
from vlpack.data.loader import open_dataset
from vlpack.data.synth import default_dataset
from vlpack.data.template import hf_messages
from vlpack.data.types import Conversation, Message
from vlpack.train.run.generate import all_prompts, evaluate, generate_ids, left_padded, turn_prompts
from vlpack.train.trainer import Trainer


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 2-step tiny run with its final checkpoint."""
    out = tmp_path_factory.mktemp("run")
    Trainer(small_cfg(out, "train.max_steps=2"), CPU).fit()
    return out


def _convs(n: int) -> list[Conversation]:
    rows = open_dataset("synthetic", None, synthetic_samples=24)
    return [rows[i] for i in range(n)]


def _slow_prompt(encoder: Encoder, conv: Conversation, turn: int) -> list[int]:
    """The whole conversation encoded, cut after the header of its `turn`-th message (an
    assistant one): `<|im_start|>` + the tokens of "assistant\\n"."""
    ids = encoder.encode(conv).input_ids.tolist()
    im_start = encoder.tokenizer.convert_tokens_to_ids("<|im_start|>")
    header = [im_start, *encoder.tokenizer.encode("assistant\n", add_special_tokens=False)]
    nth = sum(m.role == "assistant" for m in conv.messages[:turn])
    starts = [j for j in range(len(ids)) if ids[j:j + len(header)] == header]
    return ids[:starts[nth] + len(header)]


def test_prompts_are_the_conversation_up_to_each_answer_header() -> None:
    encoder = Encoder("qwen3_vl", min_pixels=16384, max_pixels=50176)
    convs = [c for c in _convs(24) if sum(m.role == "assistant" for m in c.messages) > 1][:2]
    assert convs, "the synthetic set has multi-turn samples"
    for conv in convs:
        prompts = list(turn_prompts(conv, encoder))
        turns = [i for i, m in enumerate(conv.messages) if m.role == "assistant"]
        assert [p.turn for p in prompts] == turns
        for p in prompts:
            assert p.sample.input_ids.tolist() == _slow_prompt(encoder, conv, p.turn)
            assert p.reference == conv.messages[p.turn].content[0]
            assert len(p.sample.image_grid_thw) == len(conv.images)  # images all before answers
    masked = replace(convs[0], messages=tuple(replace(m, loss=False) if m.role == "assistant"
                                              and i > 1 else m
                                              for i, m in enumerate(convs[0].messages)))
    assert len(list(turn_prompts(masked, encoder))) == 1  # "loss": false turns are not scored


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5", "qwen2_5_vl"])
def test_a_text_prompt_is_the_family_templates_generation_prompt(family: str) -> None:
    encoder = Encoder(family)
    conv = Conversation("t", (Message("system", ("Be brief.",)), Message("user", ("Hi there",)),
                              Message("assistant", ("Hello!",)), Message("user", ("Total?",)),
                              Message("assistant", ("12.50",))))
    prompts = list(turn_prompts(conv, encoder))
    for p in prompts:
        text = encoder.tokenizer.apply_chat_template(
            hf_messages(conv.messages[:p.turn]), chat_template=family_template(family),
            tokenize=False, add_generation_prompt=True)
        want = encoder.tokenizer.encode(text, add_special_tokens=False)
        assert p.sample.input_ids.tolist() == want, encoder.tokenizer.decode(want)


def test_no_answers_is_an_error_naming_the_fix() -> None:
    encoder = Encoder("qwen3_vl")
    conv = Conversation("q", (Message("user", ("Hi",)),))
    with pytest.raises(ValueError, match="no assistant turns"):
        all_prompts([conv], encoder)


def _greedy_loop(model, spec, sample, n: int, stops: set[int]) -> list[int]:
    """Argmax of the last position's logits, `n` times, each a full forward without a cache."""
    ids = sample.input_ids.tolist()
    out = []
    for _ in range(n):
        s = replace(sample, input_ids=np.asarray(ids),
                    mm_token_type_ids=np.concatenate(
                        [sample.mm_token_type_ids, np.zeros(len(out), dtype=np.int8)]))
        inputs = left_padded([s], 0, spec)
        model.model.rope_deltas = None
        with torch.no_grad():
            t = int(model(**inputs, use_cache=False).logits[0, -1].argmax())
        if t in stops:
            break
        out.append(t)
        ids.append(t)
    return out


@pytest.mark.parametrize("preset", ["tiny-qwen3_vl", "tiny-qwen3_5"])
def test_batched_greedy_generate_equals_an_argmax_loop(preset: str) -> None:
    from vlpack.model.build import build_model

    model, spec = build_model(preset, backend="sdpa", device="cpu", seed=0)
    model.eval()
    encoder = Encoder(spec.family, min_pixels=16384, max_pixels=50176)
    prompts = all_prompts(_convs(2), encoder)[:3]
    assert len({len(p.sample) for p in prompts}) > 1  # left padding at work
    got = generate_ids(model, spec, encoder, prompts, max_new_tokens=5, prompts_per_batch=3)
    stops = {encoder.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    for p, ids in zip(prompts, got, strict=True):
        assert ids == _greedy_loop(model, spec, p.sample, 5, stops)


def test_vlpack_eval_writes_predictions_and_metrics(run: Path, tmp_path: Path) -> None:
    data = default_dataset(n=24)
    out = tmp_path / "eval"
    assert main(["eval", str(run), "--data", str(data), "--out", str(out), "--limit", "2",
                 "--max-new-tokens", "4"]) == 0
    rows = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    convs = _convs(2)
    assert [(r["id"], r["turn"]) for r in rows] == [
        (c.key, i) for c in convs for i, m in enumerate(c.messages) if m.role == "assistant"]
    assert all(r["prompt"].endswith("<|im_start|>assistant\n") for r in rows)
    assert rows[0]["reference"] == convs[0].messages[rows[0]["turn"]].content[0]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n"] == len(rows)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "predictions.jsonl"]
    assert {"exact_match", "token_f1", "field_accuracy", "unparsed"} <= set(metrics)


def test_an_exported_folder_and_a_runs_hf_folder_answer_as_its_checkpoint(run: Path,
                                                                         tmp_path: Path) -> None:
    """The same predictions from the run folder (its checkpoint, exported on the fly), from a
    float32 export of it, and from a run folder holding only that export as hf/."""
    import shutil

    from vlpack.train.run.export import export_checkpoint

    data = default_dataset(n=24)
    kw = dict(max_new_tokens=4, limit=2)
    served = export_checkpoint(run, tmp_path / "served", out_dtype="float32")
    other = tmp_path / "run_without_checkpoints"
    other.mkdir()
    shutil.copyfile(run / "config.yaml", other / "config.yaml")
    shutil.copytree(served, other / "hf")
    outs = [evaluate(src, data, tmp_path / f"eval{i}", **kw)
            for i, src in enumerate((run, served, other))]
    preds = [(o / "predictions.jsonl").read_text() for o in outs]
    assert preds[0] == preds[1] == preds[2]


def test_vlpack_eval_names_bad_inputs(run: Path, tmp_path: Path, capsys) -> None:
    data = default_dataset(n=24)
    assert main(["eval", str(tmp_path / "missing"), "--data", str(data)]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["eval", str(tmp_path / "empty"), "--data", str(data)]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    with pytest.raises(ValueError, match="no assistant turn: nothing to learn from; add an answer"):
        evaluate(run, questions, tmp_path / "out")


def test_the_training_hook_logs_generation_scores(tmp_path: Path) -> None:
    cfg = small_cfg(tmp_path, "train.max_steps=1", "data.eval_samples=2",
                    "train.eval_generate_every=1", "train.eval_generate_samples=1")
    Trainer(cfg, CPU).fit()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    gen = [r for r in rows if "gen_token_f1" in r]
    assert len(gen) == 1 and gen[0]["step"] == 1
    assert {"gen_exact_match", "gen_token_f1", "gen_field_accuracy", "gen_unparsed"} <= set(gen[0])
    with pytest.raises(ValueError, match=r"data\.eval_samples"):
        small_cfg(tmp_path, "train.eval_generate_every=1")


def test_the_hook_leaves_out_a_sample_that_does_not_encode(caplog) -> None:
    from types import SimpleNamespace

    from vlpack.train.run.generate import HeldOutGeneration

    encoder = Encoder("qwen3_vl")
    bad = Conversation("bad", (Message("user", ("Hi <|im_end|>",)), Message("assistant", ("x",))))
    good = Conversation("good", (Message("user", ("Hi",)), Message("assistant", ("Hello",))))
    hook = HeldOutGeneration(SimpleNamespace(items=[bad, good]), encoder, 2, 8)
    assert hook._prompts(bad) == [] and "leaves out a held-out sample" in caplog.text
    assert [p.id for p in hook._prompts(good)] == ["good"]
    with pytest.raises(ValueError, match="held-out split"):
        HeldOutGeneration(None, encoder, 2, 8)


def test_the_hook_runs_compiled_layers_eagerly() -> None:
    """Generation during a compiled run traces nothing: each decode step's cache state would
    recompile the layers (dynamo's recompile limit on a GPU run of the 2B recipe)."""
    from types import SimpleNamespace

    from torch._dynamo.utils import counters

    from vlpack.model.build import build_model
    from vlpack.train.run.generate import HeldOutGeneration

    model, spec = build_model("tiny-qwen3_vl", backend="sdpa", device="cpu", seed=0)
    for layer in model.model.language_model.layers:
        layer.compile(backend="eager")
    encoder = Encoder(spec.family)
    hook = HeldOutGeneration(SimpleNamespace(items=_convs(1)), encoder, 1, max_new_tokens=4)
    torch._dynamo.reset()
    counters.clear()
    row = hook(model, spec)
    assert row["gen_token_f1"] is not None
    assert counters["frames"]["total"] == 0, dict(counters["frames"])
