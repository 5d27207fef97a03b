"""Time the compiled routed-experts dispatch at Qwen3.5-35B-A3B's shapes, K static or symbolic.

    python3 bench/experts_dispatch.py --k static  [--tokens 8192 32768] [--out OUT.json]
    python3 bench/experts_dispatch.py --k dynamic [--tokens 8192 32768] [--out OUT.json]
    python3 bench/experts_dispatch.py --k static --row-sum torch [--out OUT.json]

One process per mode. `static` calls the dispatch as `vlpack_experts_forward_compiled` does
(experts per token marked static); `dynamic` leaves K a symbol of the graph, as before that mark.
`--row-sum kernel` (the default) is the dispatch as shipped, each token's sum over its experts
and the row gather's backward in vlpack's Triton kernel (model/rows.py); `torch` compiles the same
dispatch with the torch expression there instead.
The experts are frozen bf16 weights (E=256, D=2048, I=512, K=8, the LoRA recipe's), the hidden
states float32 and trained, the routing softmax top-k of random logits. Prints and writes the
median forward and backward time over 20 steps after 5 warm-up steps (CUDA events), and the
kernels of one profiled step that take the most time. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from cuda_timing import fwd_bwd_step  # bench/, the script's folder

from vlpack.model import experts

E, D, I, K = 256, 2048, 512, 8  # noqa: E741 (the legend of model/experts.py)


def dispatch_fn(row_sum: str):
    """The compiled dispatch as shipped (`kernel`) or compiled with the torch row sum."""
    if row_sum == "kernel":
        return experts._compiled_silu_dispatch()
    return torch.compile(lambda *a: experts._dispatch(*a[:5], experts._silu_gate, *a[5:],
                                                      kernel=False), dynamic=True)


def time_tokens(T: int, static: bool, steps: int = 20, warmup: int = 5,
                row_sum: str = "kernel") -> dict:
    """Median forward and backward milliseconds of the compiled dispatch at `T` tokens."""
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(E, 2 * I, D, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    down = torch.randn(E, D, I, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(T, D, device="cuda", generator=g, requires_grad=True)
    w, idx = torch.randn(T, E, device="cuda", generator=g).softmax(-1).topk(K)
    if static:
        for t in (idx, w):
            torch._dynamo.mark_static(t, 1)
    fn = dispatch_fn(row_sum)
    grad = torch.randn(T, D, device="cuda", generator=g)

    def step(times: list | None) -> None:
        fwd_bwd_step(lambda: fn(x, idx, w, gate_up, down, torch.bfloat16, None, None, None, None),
                     grad, [x], times)

    for _ in range(warmup):
        step(None)
    times: list = []
    for _ in range(steps):
        step(times)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(None)
        torch.cuda.synchronize()
    top = sorted(((e.key, e.device_time_total / 1e3) for e in prof.key_averages()),
                 key=lambda kv: -kv[1])[:8]
    return {"tokens": T,
            "forward_ms": round(statistics.median(t[0] for t in times), 3),
            "backward_ms": round(statistics.median(t[1] for t in times), 3),
            "top_kernels_ms": [[name[:90], round(ms, 3)] for name, ms in top]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", choices=("static", "dynamic"), required=True)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--row-sum", choices=("kernel", "torch"), default="kernel")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/experts_dispatch.py needs CUDA")
    result = {"device": torch.cuda.get_device_name(), "k": args.k, "row_sum": args.row_sum,
              "runs": []}
    for T in args.tokens:
        r = time_tokens(T, args.k == "static", row_sum=args.row_sum)
        result["runs"].append(r)
        print(f"K {args.k:7s} row sum {args.row_sum:6s} T {T:6d}: forward {r['forward_ms']:.3f} ms, backward "
              f"{r['backward_ms']:.3f} ms", flush=True)
        for name, ms in r["top_kernels_ms"]:
            print(f"    {ms:9.3f} ms  {name}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
