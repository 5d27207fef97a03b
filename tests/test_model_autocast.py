"""Under bf16 autocast with fp32 master weights (the trainer's GPU setting) the attention
kernels must receive one half-precision dtype, or they fall back to the slow per-segment loop."""

import numpy as np
import torch

from tests.helpers import make_sample
from vlpack.data.batch import build_thd_batch
from vlpack.model import attention
from vlpack.model.build import build_model
from vlpack.model.forward import packed_forward


def test_kernels_see_one_autocast_dtype(monkeypatch) -> None:
    model, spec = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu", seed=0)
    seen = []
    original = attention.attend

    def spy(name, q, k, v, segs, **kw):
        seen.append((kw["stream"], q.dtype, k.dtype, v.dtype))
        return original(name, q, k, v, segs, **kw)

    monkeypatch.setattr(attention, "attend", spy)
    rng = np.random.default_rng(0)
    samples = [make_sample(f"s{i}", rng, patch_dim=spec.patch_dim) for i in range(2)]
    batch = build_thd_batch(samples, pad_token_id=spec.pad_token_id)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        packed_forward(model, batch, spec=spec)
    assert {s for s, *_ in seen} == {"text", "vision"}
    assert all(q == k == v == torch.bfloat16 for _, q, k, v in seen), seen
