"""Start-up cost of fla's gated delta rule on a GPU: vlpack's backward self-test, then varlen
forward + backward calls at a layer's shape, each timed. The first calls of a process autotune
fla's Triton kernels, most of them keyed on head counts and dims, not tokens: a self-test at the
layer's head count (`--self-test-heads`, default `--heads`) tunes those for the layer's calls.
fla keeps Triton's autotuning results on disk (`FLA_CACHE_RESULTS`, default on): give each
process of a comparison a fresh `TRITON_CACHE_DIR`. Figures: docs/benchmarks/profiles.md.

    TRITON_CACHE_DIR=$(mktemp -d) python bench/fla_startup.py --heads 32 --self-test-heads 32
    TRITON_CACHE_DIR=$(mktemp -d) python bench/fla_startup.py --heads 32 --self-test-heads 2

Legend: T = tokens, H = heads, K/V = key/value head dims.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--heads", type=int, default=32, help="the layer's value heads (Qwen3.5: 32)")
    p.add_argument("--self-test-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--out", default=None, help="write the timings as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from vlpack.model import fla_hopper

    dev = torch.device("cuda", torch.cuda.current_device())
    K = V = args.head_dim
    H, st_heads = args.heads, args.self_test_heads or args.heads
    res: dict = {"heads": H, "self_test_heads": st_heads, "head_dim": K, "tokens": args.tokens}
    t = time.perf_counter()
    d = fla_hopper.decide(K, V, dev, modeling_qwen3_5.torch_chunk_gated_delta_rule.__wrapped__,
                          heads=st_heads)
    torch.cuda.synchronize()
    res["decide_s"], res["decision"] = time.perf_counter() - t, d.describe()
    print(f"decide ({st_heads} heads): {res['decide_s']:.1f} s  {d.describe()}", flush=True)
    if not fla_hopper.guard_applies():
        print("fla's Hopper guard does not apply on this machine: no self-test ran", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    T = args.tokens
    cu = torch.tensor([0, 700, 1900, 2600, 4100, 5000, 6400, 7000, T], device=dev)
    leaves = dict(q=torch.randn(1, T, H, K, device=dev, generator=g, dtype=torch.bfloat16),
                  k=torch.randn(1, T, H, K, device=dev, generator=g, dtype=torch.bfloat16),
                  v=torch.randn(1, T, H, V, device=dev, generator=g, dtype=torch.bfloat16),
                  g=-torch.rand(1, T, H, device=dev, generator=g) * 0.5,
                  beta=torch.rand(1, T, H, device=dev, generator=g, dtype=torch.bfloat16))
    for t_ in leaves.values():
        t_.requires_grad_()
    res["calls_s"] = []
    for i in range(args.calls):
        t = time.perf_counter()
        out = chunk_gated_delta_rule(**leaves, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]
        out.float().square().mean().backward()
        torch.cuda.synchronize()
        res["calls_s"].append(time.perf_counter() - t)
        print(f"call {i + 1} ({H} heads, {T} tokens, fwd + bwd): {res['calls_s'][-1]:.2f} s",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
