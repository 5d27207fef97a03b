"""Gated-DeltaNet's delta rule at Qwen3.5-35B-A3B's head layout, one process per kernel.

    python3 bench/gdn_kernels.py --kernel fla --heads repeat --prep torch --out gdn.json
    python3 bench/gdn_kernels.py --kernel fla --heads grouped --prep kernel --out gdn.json
    python3 bench/gdn_kernels.py --kernel flash_qla --heads grouped --out gdn.json

`--kernel fla`: fla's Triton kernels (its FlashQLA backend switched off, `FLA_FLASH_QLA=0`);
`flash_qla`: the same fla call dispatched to FlashQLA (PyPI `flash-qla` on tilelang, fla's
`flash_qla` backend: Hopper and newer, head dims 128), an error where fla does not dispatch
there. What is timed starts from the layer's projections' outputs (q/k at the key heads, v, and
the raw gate and beta projections `a` and `b`, all bf16 as autocast makes them) and ends at the
delta rule's output, forward and backward:
- `--heads repeat` repeats q and k to the value heads first, as vlpack's layer does today
  (transformers' torch kernel needs that); `grouped` passes them at the key heads (fla and
  FlashQLA read value head h's q/k from key head h // (HV / H), repeat_interleave's order).
- `--prep torch` computes the decay g = -exp(A_log) · softplus(a + dt_bias) in float32 and
  beta = sigmoid(b) in torch, as the layer does today; `kernel` hands the raw `a` and `b` to
  fla (`use_gate_in_kernel`, `use_beta_sigmoid_in_kernel`: fla's Triton kernels only, FlashQLA
  takes neither). A_log and dt_bias are frozen, as in a LoRA run.

First the layer's decision, timed apart (`decide_s`): fla_hopper.decide self-tests a backend fla
hands the call to (FlashQLA), or fla's own backward where fla's Hopper guard applies (Triton
3.4-3.7.0); its kernels compile there. Then one packed row per `--tokens` size, cut into segments
of the synthetic data's spread (`segment_lengths`), with its boundary arguments as the layer
passes them (`gdn._fla_bounds`: host copies and chunk indices, built once). Prints and writes per
size: the first forward + backward's seconds (Triton's or tilelang's compilation, fla's
autotuning: give each process a fresh TRITON_CACHE_DIR for a cold figure; fla starts from the
configurations vlpack keeps for the GPU, as `vlpack train` does, unless `--autotune`), the
median forward and backward milliseconds of `--steps` steps after 3 warm-up steps (CUDA events),
the memory the forward keeps for the backward, and, for the first size, the relative error of
the output and of every input's gradient against the layer's torch path (the gates in torch,
q/k repeated, transformers' torch kernel per segment) in float32, beside the error of that path
fed bf16 (the bound of vlpack's backward self-test: at most 2× it + 1e-3).
Needs CUDA.

Legend: T = tokens, H = key heads, HV = value heads, K/V = head dims.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from cuda_timing import fwd_bwd_step  # bench/, the script's folder

from vlpack.model import gdn
from vlpack.train.setup.kernel_cache import use_tuned_kernels

H, HV, K, V = 16, 32, 128, 128  # Qwen3.5-35B-A3B's linear-attention heads
MEAN_SEGMENT = 955
"""Mean tokens per sample of the synthetic receipts at 32k bins (throughput_35b_lora_32k.json)."""


def segment_lengths(T: int, seed: int = 0) -> list[int]:
    """Segment lengths summing to `T`: log-normal around MEAN_SEGMENT, 64 to 4,096 tokens, the
    last one the remainder (a bin's tail)."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < T:
        n = int(torch.empty(1).log_normal_(mean=6.7, std=0.6, generator=g).clamp(64, 4096))
        out.append(min(n, T - sum(out)))
    return out


def inputs(T: int, device: torch.device, seed: int = 0) -> tuple[dict, dict]:
    """The layer's projections' outputs for one row (bf16 leaves that need gradients: q, k at
    the key heads, v, the raw gate `a` and beta `b`) and its frozen float32 gate parameters."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, as_type=torch.bfloat16):
        return torch.randn(*shape, device=device, generator=g).to(as_type)

    leaves = dict(q=rand(1, T, H, K), k=rand(1, T, H, K), v=rand(1, T, HV, V),
                  a=rand(1, T, HV) - 4.0, b=rand(1, T, HV))
    frozen = dict(A_log=torch.empty(HV, device=device).uniform_(1, 16, generator=g).log(),
                  dt_bias=rand(HV, as_type=torch.float32))
    return {n: t.detach().clone().requires_grad_() for n, t in leaves.items()}, frozen


def layer_call(gdr, heads: str, prep: str, frozen: dict, bounds_kw: dict):
    """The delta rule from the projections' outputs through fla's `gdr`, as `--heads` and
    `--prep` say."""
    def call(q, k, v, a, b):
        if heads == "repeat":
            q, k = gdn.repeat_heads(q, k, v.shape[2])
        if prep == "kernel":
            return gdr(q, k, v, g=a, beta=b, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                       use_beta_sigmoid_in_kernel=True, **frozen, **bounds_kw)[0]
        g, beta = gdn.gates(a, b, **frozen)
        return gdr(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, **bounds_kw)[0]
    return call


class Dispatched(logging.Handler):
    """The backends fla's dispatch logs having run (`[FLA Backend] op.fn -> backend`)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "chunk_gated_delta_rule" in msg and "->" in msg and "rejected" not in msg:
            self.seen.add(msg.split("->")[-1].strip())


def reference_errors(leaves: dict, frozen: dict, cu: list[int], kernel,
                     torch_fn) -> dict[str, list[float]]:
    """Per output and gradient: [kernel's relative error, the bf16 torch path's], both against
    the layer's torch path in float32 (gates in torch, q/k repeated, the torch kernel per
    segment)."""
    dev = leaves["q"].device
    do = torch.randn(*leaves["v"].shape, device=dev, generator=torch.Generator(dev).manual_seed(1))

    def torch_rows(q, k, v, a, b):
        g, beta = gdn.gates(a, b, **frozen)
        q, k = gdn.repeat_heads(q, k, v.shape[2])
        return torch.cat([torch_fn(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                                   use_qk_l2norm_in_kernel=True)[0]
                          for s, e in itertools.pairwise(cu)], dim=1)

    def run(fn, dtype):
        xs = {n: t.detach().to(dtype or t.dtype).requires_grad_() for n, t in leaves.items()}
        out = fn(**xs)
        out.float().backward(do)
        return {"out": out.detach().float(), **{f"d{n}": t.grad.float() for n, t in xs.items()}}

    ref, plain, fast = run(torch_rows, torch.float32), run(torch_rows, torch.bfloat16), run(kernel, None)

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))

    return {n: [rel(fast[n], ref[n]), rel(plain[n], ref[n])] for n in ref}


def time_size(T: int, heads: str, prep: str, dev: torch.device, gdr, steps: int,
              check=None) -> dict:
    """One row of T tokens through `layer_call`: the first call's seconds, median forward and
    backward milliseconds, the memory kept for the backward, and with `check` (the torch
    kernel) the errors of `reference_errors`."""
    from vlpack.model.bounds import Boundaries, Segments
    from vlpack.model.torch_kernels import quiet_fallback

    lengths = segment_lengths(T)
    cu = [0, *itertools.accumulate(lengths)]
    segs = Segments.from_host(tuple(cu), dev)
    # the boundary arguments as vlpack's layer passes them: the device and host copies and the
    # chunk indices, built once on the host, the same objects for every call (gdn._fla_bounds)
    bounds_kw = gdn._fla_bounds(gdr, segs, Boundaries(text=segs), dev, gdn._fla_chunk())

    leaves, frozen = inputs(T, dev)
    kernel = layer_call(gdr, heads, prep, frozen, bounds_kw)
    do = torch.randn_like(leaves["v"])

    def step(times: list | None) -> None:
        fwd_bwd_step(lambda: kernel(**leaves), do, leaves.values(), times)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(None)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(3):
        step(None)
    times: list = []
    for _ in range(steps):
        step(times)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    out = kernel(**leaves)
    kept = torch.cuda.memory_allocated(dev) - before - out.numel() * out.element_size()
    del out
    size = {"segments": len(lengths), "first_fwd_bwd_s": first_s,
            "fwd_ms": statistics.median(t[0] for t in times),
            "bwd_ms": statistics.median(t[1] for t in times),
            "kept_for_backward_mib": kept / 2**20}
    if check is not None:
        with quiet_fallback():
            size["rel_error_vs_fp32_torch"] = reference_errors(leaves, frozen, cu, kernel,
                                                                 check)
    return size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kernel", choices=("fla", "flash_qla"), required=True)
    p.add_argument("--heads", choices=("repeat", "grouped"), default="grouped")
    p.add_argument("--prep", choices=("torch", "kernel"), default="torch")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--no-check", action="store_true", help="skip the float32 reference")
    p.add_argument("--autotune", action="store_true",
                   help="let fla autotune every kernel instead of starting, as `vlpack train` does "
                        "(train.tuned_kernels), from the configurations vlpack keeps for this GPU")
    p.add_argument("--out", default=None, help="add this process's row to this JSON file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    if args.kernel == "flash_qla" and args.prep == "kernel":
        p.error("FlashQLA computes neither gate in its kernel: --prep torch")
    os.environ["FLA_FLASH_QLA"] = "1" if args.kernel == "flash_qla" else "0"
    tuned = None if args.autotune else use_tuned_kernels(torch.cuda.get_device_name())
    t_import = time.perf_counter()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    from vlpack.model import fla_hopper
    from vlpack.model.torch_kernels import torch_function

    import_s = time.perf_counter() - t_import
    dispatched = Dispatched()
    logging.getLogger("fla").addHandler(dispatched)
    logging.getLogger("fla").setLevel(logging.INFO)
    torch_fn = torch_function(modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet,
                              "torch_chunk_gated_delta_rule")
    dev = torch.device("cuda", torch.cuda.current_device())
    row: dict = {"kernel": args.kernel, "heads": args.heads, "prep": args.prep,
                 "device": torch.cuda.get_device_name(dev),
                 "torch": torch.__version__, "layout": {"H": H, "HV": HV, "K": K, "V": V},
                 "import_s": import_s, "fla_configs": str(tuned) if tuned else None,
                 "sizes": {}}
    # as the layer decides it: a backend fla hands the call to is self-tested; fla's own backward
    # on Hopper with Triton 3.4-3.7.0 runs through vlpack's approved backend (fla #640)
    probe, probe_frozen = inputs(64, dev)
    q, k = gdn.repeat_heads(probe["q"], probe["k"], HV) if args.heads == "repeat" else (
        probe["q"], probe["k"])
    backend = None if args.prep == "kernel" else fla_hopper.dispatched_backend(
        q, k, probe["v"], *gdn.gates(probe["a"], probe["b"], **probe_frozen))
    t = time.perf_counter()
    decision = fla_hopper.decide(K, V, dev, torch_fn, heads=HV, backend=backend)
    row["decision"], row["decide_s"] = decision.describe(), time.perf_counter() - t
    print(f"{args.kernel}: {decision.describe()} ({row['decide_s']:.1f} s)", flush=True)
    if not decision.ok:
        print("the kernel's backward is refused here: nothing to time", file=sys.stderr)
        return 1
    for v in ("fla-core", "flash-qla", "tilelang", "triton"):
        try:
            from importlib.metadata import version
            row[v] = version(v)
        except Exception:
            row[v] = None

    for i, T in enumerate(args.tokens):
        size = time_size(T, args.heads, args.prep, dev, chunk_gated_delta_rule, args.steps,
                         check=torch_fn if i == 0 and not args.no_check else None)
        row["sizes"][str(T)] = size
        print(f"{args.kernel:>9} {args.heads:>7} {args.prep:>6} T={T:>6} ({size['segments']} segments): "
              f"first {size['first_fwd_bwd_s']:6.1f} s, fwd {size['fwd_ms']:7.2f} ms, bwd "
              f"{size['bwd_ms']:7.2f} ms, kept {size['kept_for_backward_mib']:7.1f} MiB", flush=True)
        for n, (fast, plain) in size.get("rel_error_vs_fp32_torch", {}).items():
            ok = "ok" if fast <= 2 * plain + 1e-3 else "OUTSIDE the bf16 rule"
            print(f"    {n:>6}: {fast:.4f} (bf16 torch {plain:.4f}) {ok}", flush=True)
    row["dispatched_to"] = sorted(dispatched.seen) or ["fla's Triton kernels (no backend logged)"]
    if args.kernel == "flash_qla" and "flash_qla" not in dispatched.seen:
        print(f"fla did not dispatch to FlashQLA ({row['dispatched_to']}): is flash-qla importable "
              "on this GPU?", file=sys.stderr)
        return 1
    print(f"dispatched to: {', '.join(row['dispatched_to'])}")
    if args.out:
        path = Path(args.out)
        rows = json.loads(path.read_text()) if path.exists() else {}
        rows[f"{args.kernel}_{args.heads}_{args.prep}"] = row
        path.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
