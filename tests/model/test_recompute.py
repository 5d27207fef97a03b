"""Partial activation checkpointing: exactly the chosen layers recompute, and the gradients are
those of the model that keeps every activation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers import CPU, small_cfg
from vlpack.config import load_config
from vlpack.data.batch import build_thd_batch
from vlpack.model.build import build_model
from vlpack.model.recompute import enable_activation_checkpointing, layer_stacks
from vlpack.model.synthetic import default_mix
from vlpack.train.setup.module import TrainModule
from vlpack.train.trainer import Trainer


def _grads(name: str, share: float | None) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Parameter gradients of one packed forward + backward, and how often each layer's MLP ran."""
    model, spec = build_model(name, dtype=torch.float32, device="cpu", seed=0)
    model.train()
    if share is not None:
        enable_activation_checkpointing(model, share)
    calls: dict[str, int] = {}
    for stack_name, stack in layer_stacks(model).items():
        for i, layer in enumerate(stack):
            key = f"{stack_name}.{i}"
            calls[key] = 0
            # The MLP runs inside the layer's forward, so a recompute enters it again (HF
            # checkpoints `forward`, not `__call__`: the layer's own hooks run once). A pre-hook:
            # torch stops a recompute once it has every saved tensor, before forward hooks run.
            layer.mlp.register_forward_pre_hook(lambda *_, k=key: calls.__setitem__(k, calls[k] + 1))
    samples = default_mix(spec, 4)
    out = TrainModule(model, spec)(build_thd_batch(samples, pad_token_id=spec.pad_token_id,
            pad_to_multiple_of=1, mrope_after_video="transformers"))
    (out.loss_sum / out.num_label_tokens).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, calls


@pytest.mark.parametrize("name", ["tiny-qwen3_vl", "tiny-qwen3_5_moe"])
def test_half_of_each_stack_recomputes_and_gradients_match(name: str) -> None:
    reference, once = _grads(name, None)
    grads, calls = _grads(name, 0.5)
    assert set(once.values()) == {1}
    for key, n in calls.items():
        stack, i = key.rsplit(".", 1)
        size = sum(k.startswith(stack + ".") for k in calls)
        assert n == (2 if int(i) < math.ceil(size * 0.5) else 1), (key, n)
    assert grads.keys() == reference.keys()
    for k, g in grads.items():
        torch.testing.assert_close(g, reference[k], rtol=1e-5, atol=1e-6, msg=k)


def test_full_share_recomputes_every_layer() -> None:
    _, calls = _grads("tiny-qwen3_vl", 1.0)
    assert set(calls.values()) == {2}


def test_share_is_validated() -> None:
    model, _ = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu", seed=0)
    with pytest.raises(ValueError, match="checkpoint_share"):
        enable_activation_checkpointing(model, 0.0)
    with pytest.raises(ValueError, match="checkpoint_share"):
        load_config(None, ["model.activation_checkpointing=true", "model.checkpoint_share=1.5"])
    # a recipe's share does not stop a user from switching checkpointing off
    assert not load_config("qwen3-vl-8b", ["model.activation_checkpointing=false"]
                           ).model.activation_checkpointing
    assert load_config(None, ["model.activation_checkpointing=true",
                              "model.checkpoint_share=0.5"]).model.checkpoint_share == 0.5
    assert load_config(None, ["model.checkpoint_share=auto"]).model.checkpoint_share == "auto"
    with pytest.raises(ValueError, match=r"model.checkpoint_share needs a number or auto, "
                                         r"got 'most'"):
        load_config(None, ["model.checkpoint_share=most"])
    with pytest.raises(ValueError, match=r"data.packing=none pads batches .* set a share"):
        load_config("tiny-nopack", ["model.checkpoint_share=auto"])


# --- model.activation_checkpointing through the trainer ----------------------------------------------
def test_activation_checkpointing_gives_the_same_losses(tmp_path: Path) -> None:
    plain = Trainer(small_cfg(tmp_path / "a", "train.max_steps=2"), CPU).fit()
    ckpt = Trainer(small_cfg(tmp_path / "b", "train.max_steps=2",
                             "model.activation_checkpointing=true"), CPU).fit()
    assert abs(plain["last_loss"] - ckpt["last_loss"]) < 1e-5
