"""`vlpack check` end to end on CPU."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from tests.helpers import HF_TEST_CONFIGS, _report, hf_test_folder
from vlpack.cli import main


@pytest.mark.parametrize("name", ["tiny-qwen3_vl_moe", "tiny-qwen3_5"])
def test_check_json_passes(name, capsys):
    assert main(["check", "--model", name, "--samples", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("max_logit_diff", "max_loss_diff", "max_grad_rel_diff", "passed"):
        assert key in r
    assert r["passed"] and r["dtype"] == "float32" and r["attn_implementation"] == "vlpack_varlen"
    assert r["paths"]["attention.text"]
    if name.endswith("moe"):
        assert r["moe_aux_diff"] is not None and r["moe_aux_diff"] <= 1e-5


def test_check_text_report_names_backend(capsys):
    assert main(["check", "--model", "tiny-qwen2_vl", "--samples", "2", "--backend", "sdpa"]) == 0
    out = capsys.readouterr().out
    assert "backend sdpa -> sdpa" in out and "PASSED" in out


def test_check_bf16_rule_on_cpu(capsys):
    assert main(["check", "--model", "tiny-qwen3_vl", "--samples", "2", "--dtype", "bfloat16",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "rule" in r and r["passed"]
    assert r["precision"] == "bfloat16 autocast on cpu over float32 weights"


def test_check_unknown_model_is_a_user_error(capsys):
    assert main(["check", "--model", "nope"]) == 2


def test_check_report_names_every_item(capsys):
    assert main(["check", "--model", "tiny-qwen3_vl", "--samples", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["failures"] == [] and r["isolation_float32"]["max_diff"] == 0.0
    assert r["isolation_float32"]["repeat_diff"] == 0.0
    assert r["paths_no_grad"] == r["paths"]  # the same kernels with and without gradients
    assert len(r["hf_label_loss"]) == 2 and all(x > 0 for x in r["hf_label_loss"])
    assert set(r["grad_rel_diff"]) == {"vision", "merger", "llm"}


def test_check_flex_on_cpu_says_unsupported(capsys):
    assert main(["check", "--model", "tiny-qwen3_vl", "--backend", "flex"]) == 2
    err = capsys.readouterr().err
    assert "--backend flex is not supported on cpu" in err and "Traceback" not in err


def test_check_needs_two_samples(capsys):
    assert main(["check", "--model", "tiny-qwen3_vl", "--samples", "1"]) == 2
    assert "--samples must be >= 2" in capsys.readouterr().err


def test_check_crash_is_could_not_run_not_failed(monkeypatch, capsys):
    from vlpack.check import run as check_mod

    def boom(*a, **k):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(check_mod, "run_unpacked", boom)
    assert main(["check", "--model", "tiny-qwen3_vl", "--samples", "2"]) == 2
    assert "could not run: kernel exploded (RuntimeError" in capsys.readouterr().err


def test_check_fails_on_one_parameter_by_name(monkeypatch, capsys):
    """Gradients are compared per parameter: Qwen3.5's `dt_bias` (a few 1e-5 of the whole
    gradient's norm) with its packed gradient zeroed, and an `A_log` whose gradient is None,
    each fail the check by name (exit 1, not 2), and the group summaries are reported."""
    from vlpack.check import run as check_mod

    orig_packed = check_mod.run_packed
    zeroed = "model.language_model.layers.0.linear_attn.dt_bias"
    dropped = "model.language_model.layers.2.linear_attn.A_log"

    def packed_with_broken_gradients(*a, **k):
        run = orig_packed(*a, **k)
        if run.grads:
            run.grads[zeroed] = torch.zeros_like(run.grads[zeroed])
            del run.grads[dropped]
        return run

    monkeypatch.setattr(check_mod, "run_packed", packed_with_broken_gradients)
    assert main(["check", "--model", "tiny-qwen3_5", "--samples", "2", "--json"]) == 1
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["failures"] == [
        f"float32 packed vs unpacked: parameter {n} gets a gradient on the reference side only "
        "(the other's is None, absent or zero)" for n in sorted((zeroed, dropped))]
    assert set(r["grad_rel_diff"]) == {"vision", "merger", "llm"}
    assert r["grad_worst"]["llm"]["rel_diff"] <= 1e-4


def test_check_compares_the_packed_paths_loss_value(monkeypatch, capsys):
    """The loss VALUE of the packed path (its chunked loss, per sample and the row's total) is
    compared with transformers' own `labels=` loss: a chunked loss that returns log-sum-exp
    instead of cross-entropy, with correct gradients, fails the check."""
    from vlpack.model import loss as loss_mod

    orig = loss_mod._chunked_rows

    def lse_not_ce(hidden_TH, weight_VH, h_NH, y_N, r_N, chunk_size):
        out = orig(hidden_TH, weight_VH, h_NH, y_N, r_N, chunk_size)
        target = (h_NH @ weight_VH.T).float().gather(1, y_N[:, None]).sum()
        return out + target.detach()  # the sum of log-sum-exps; the gradient unchanged

    assert main(["check", "--model", "tiny-qwen2_vl", "--samples", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["loss_total_diff"] <= 1e-5 and r["loss_value"]["packed"] > 0
    monkeypatch.setattr(loss_mod, "_chunked_rows", lse_not_ce)
    assert main(["check", "--model", "tiny-qwen2_vl", "--samples", "2", "--json"]) == 1
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert any("float32 packed vs unpacked: sample 0 loss" in f for f in r["failures"])
    assert any("the row's loss" in f for f in r["failures"])
    assert not any("gradient" in f for f in r["failures"]), r["failures"]


def test_check_reference_is_stock_code_with_fla_importable(monkeypatch, capsys):
    """fla "importable" (simulated on CPU: vlpack's probe finds it, and transformers' kernel
    wrappers would call it): the reference still runs transformers' own Gated-DeltaNet (its
    torch kernels), so vlpack's layer dropping `dt_bias` from the gate fails the check; the
    reference never enters vlpack's layer."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as stock_mod

    from vlpack.model import gdn

    def fla_kernel(*a, **k):
        raise AssertionError("an fla kernel ran on the CPU")

    for name in ("causal_conv1d_fn", "torch_chunk_gated_delta_rule"):
        # a kernel wrapper that calls "fla", over transformers' torch function
        wrapper = functools.wraps(getattr(stock_mod, name))(lambda *a, **k: fla_kernel())
        monkeypatch.setattr(stock_mod, name, wrapper)
    monkeypatch.setattr(gdn, "_fla", lambda: (fla_kernel, fla_kernel))
    entered = []
    orig = gdn.GatedDeltaNet._packed

    def without_dt_bias(self, *a, **k):
        entered.append(bool(k.get("torch_only")))
        saved = self.dt_bias.detach().clone()
        with torch.no_grad():
            self.dt_bias.zero_()  # softplus(a + 0): the gate without dt_bias
        try:
            return orig(self, *a, **k)
        finally:
            with torch.no_grad():
                self.dt_bias.copy_(saved)

    monkeypatch.setattr(gdn.GatedDeltaNet, "_packed", without_dt_bias)
    assert main(["check", "--model", "tiny-qwen3_5", "--samples", "2", "--json"]) == 1
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert any("max |dlogits|" in f for f in r["failures"]), r["failures"]
    assert entered and not any(entered)  # vlpack's layer ran on the packed side only


@pytest.mark.parametrize("theta", [1e6, 1e7])
def test_check_inputs_fail_a_position_bug_by_10x_on_published_thetas(theta, tmp_path, monkeypatch,
                                                                      capsys):
    """With a published rope theta (Qwen2.5-VL 1e6, Qwen3.5 1e7) on the tiny Qwen2-VL shape,
    whose h and w get the slowest rotary frequencies, the check's synthetic inputs (a wide
    image strip among them) fail an image h/w position swap by at least 10x the fp32 logit
    tolerance."""
    import numpy as np

    from vlpack.data import batch as batch_mod
    from vlpack.data.types import TOKEN_TYPE_IMAGE
    from vlpack.model.build import build_model

    model, _ = build_model("tiny-qwen2_vl", device="cpu", dtype="float32")
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["text_config"]["rope_parameters"]["rope_theta"] = theta
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    orig = batch_mod.mrope_positions

    def h_w_swapped(types, *a, **k):  # the packed side's image positions, h and w swapped
        out = orig(types, *a, **k).copy()
        img = np.asarray(types) == TOKEN_TYPE_IMAGE
        out[1, img], out[2, img] = out[2, img].copy(), out[1, img].copy()
        return out

    monkeypatch.setattr(batch_mod, "mrope_positions", h_w_swapped)
    assert main(["check", "--model", str(tmp_path), "--samples", "2", "--json"]) == 1
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    margin = r["contract_float32"]["max_logit_diff"] / r["tolerances"]["logits"]
    assert margin >= 10, margin


def test_check_bf16_moe_counts_routing_flips(capsys):
    """bf16 near-ties flip a few tokens' expert choice; they are counted, not compared."""
    assert main(["check", "--model", "tiny-qwen3_5_moe", "--samples", "4", "--dtype", "bfloat16",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["passed"] and r["moe_routing_flips"] is not None
    assert r["moe_routing_flips"] < 0.05 * sum(s["tokens"] for s in r["per_sample"])


def test_check_refuses_up_front_when_memory_is_short(monkeypatch, capsys):
    from vlpack.train.setup import memory

    monkeypatch.setattr(memory, "available_bytes", lambda dev: 2**30)
    assert main(["check", "--model", "qwen3-vl-2b"]) == 2
    err = capsys.readouterr().err
    assert "needs about 32 GiB" in err and "smaller preset" in err


def test_check_on_the_users_folder_and_data(tmp_path, capsys):
    """`vlpack check --model FOLDER --data FILE.jsonl`: the user's own samples (text-only and an
    image), encoded with the folder's tokenizer and chat template as training would, pack and
    pass; the report names the file; the folder's template rendered them (a template that
    refuses every sample fails the check's data loading, naming the template)."""
    import numpy as np
    from PIL import Image

    from vlpack.data.tokenizer import load_tokenizer
    from vlpack.model.build import build_model

    folder = tmp_path / "ckpt"
    model, _ = build_model("tiny-qwen3_vl", device="cpu", dtype="float32")
    model.save_pretrained(folder)
    load_tokenizer("qwen3_vl").save_pretrained(folder)
    good = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}"
            "{{ m.content }}{% else %}{% for c in m.content %}{% if c.type == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c.text }}{% endif %}"
            "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}")
    (folder / "chat_template.jinja").write_text(good)
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(
        tmp_path / "a.png")
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in (("Total?", "12.50"), ("Date?", "2026-12-01"))]
    rows.append({"messages": [
        {"role": "user", "content": [{"type": "image", "image": "a.png"},
                                     {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A receipt."}]})
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["check", "--model", str(folder), "--data", str(data), "--samples", "3", "--json"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["passed"] and r["samples"] == 3 and r["data"] == str(data)
    (folder / "chat_template.jinja").write_text(good.replace("<|im_start|>{{ m.role }}\n",
                                                             "{{ m.role }}: "))
    assert main(args) != 0
    assert "chat_template.jinja: the template writes 0 assistant turns" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tiny-qwen3_vl", "tiny-qwen2_5_vl"])
def test_check_on_user_data_with_videos(tmp_path, capsys, name):
    """`vlpack check --data FILE.jsonl` on frame-list and mp4 videos mixed with an image and
    text: packed equals unpacked (the stock model given pixel_values_videos / video_grid_thw /
    second_per_grid_ts) and the report names the samples it used."""
    from tests.helpers import _frames, _mp4

    a = _frames(tmp_path, 5, size=(60, 90))
    _frames(tmp_path, 1, size=(64, 64), name="im")
    _mp4(tmp_path / "clip.mp4", 17, fps=8)  # skips without PyAV
    rows = [
        {"id": "frames", "messages": [
            {"role": "user", "content": [{"type": "video", "video": a, "fps": 2},
                                         {"type": "text", "text": "What happens?"}]},
            {"role": "assistant", "content": "A receipt appears."}]},
        {"id": "mixed", "conversations": [
            {"from": "human", "value": "<image> and <video>: same shop?"},
            {"from": "gpt", "value": "Yes."}], "images": ["im0.png"], "videos": ["clip.mp4"]},
        {"id": "text", "messages": [{"role": "user", "content": "Total?"},
                                    {"role": "assistant", "content": "12.50"}]},
    ]
    data = tmp_path / "videos.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["check", "--model", name, "--data", str(data), "--samples", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["passed"], r["failures"]
    assert r["sample_keys"] == ["frames", "mixed", "text"] and r["videos"] == 2


def test_a_non_finite_reference_loss_fails_by_name():
    """transformers' labels= loss NaN on a sample with labels: a named failure, not a sample
    the label comparison quietly skips."""
    from vlpack.check.run import Run, _label_failures

    ref = Run([], [], {}, None, hf_losses=[2.0, None], label_counts=[3, 4], own_shift=[6.0, 8.0])
    assert _label_failures(ref) == [
        "label shift: sample 1 has 4 label tokens but transformers' labels= loss is not finite"]


def test_the_report_names_the_worst_parameters_first():
    from vlpack.check.run import MAX_NAMED, _named, _worst_first

    errors = {f"p{i:02d}": float(i) for i in range(MAX_NAMED + 3)}
    lines = _named("err", {n: f"{v:g}" for n, v in _worst_first(errors)})
    assert lines[0] == f"err of p{MAX_NAMED + 2:02d}: {MAX_NAMED + 2}"
    assert lines[-1] == "err: 3 more parameters" and "err of p00: 0" not in lines


@pytest.mark.parametrize("family", list(HF_TEST_CONFIGS))
def test_check_passes_on_transformers_test_configs(tmp_path, capsys, family):
    """A vocabulary of 99 with special ids 0-6: the check's text ids stay inside it and away
    from the special ids, and packed equals unpacked."""
    folder = hf_test_folder(tmp_path / family, family)
    assert main(["check", "--model", str(folder), "--samples", "2", "--json"]) == 0
    r = _report(capsys)
    assert r["passed"] and r["family"] == family, r["failures"]


def test_check_config_only_folder_names_init_random(tmp_path, capsys):
    """A folder with config.json alone: refused with a message that names the check's own
    `--init random` (not a training key); with it, random weights of its shape pass."""
    folder = hf_test_folder(tmp_path / "cfg", "qwen3_vl", weights=False)
    assert main(["check", "--model", str(folder), "--samples", "2"]) == 2
    err = capsys.readouterr().err
    assert "no weights" in err and "--init random" in err and "model.init" not in err
    assert main(["check", "--model", str(folder), "--samples", "2", "--init", "random",
                 "--json"]) == 0
    r = _report(capsys)
    assert r["passed"] and r["init"] == "random"
