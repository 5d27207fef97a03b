"""Loss paths at a training shape: forward + backward time and peak memory of vlpack's chunked
linear cross-entropy (several chunk sizes), liger's fused one and the plain logits path.

    python bench/loss_speed.py --rows 2048 --hidden 2048 --vocab 151936      # qwen3-vl-2b
    python bench/loss_speed.py --rows 2048 --hidden 2048 --vocab 248320      # qwen3.5-35b-a3b

`--rows` is the label tokens of one step (about a quarter of an 8k receipt bin: images carry no
labels). The weight is an fp32 master copy and the loss runs under bf16 autocast on GPU, as in
training. Every path's loss and gradients are checked against the plain path before timing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

from vlpack.model import loss as L


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=2048, help="label tokens")
    p.add_argument("--tokens", type=int, default=8192, help="row length (labels among them)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunks", default="1024,4096,16384")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device="cpu").manual_seed(0)
    lm_head = torch.nn.Linear(args.hidden, args.vocab, bias=False).to(dev)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(args.vocab, args.hidden, generator=g) * 0.02)
    h0 = torch.randn(args.tokens, args.hidden, generator=g).to(dev)
    y = torch.full((args.tokens,), -100, dtype=torch.long)
    pick = torch.randperm(args.tokens, generator=g)[: args.rows]
    y[pick] = torch.randint(0, args.vocab, (args.rows,), generator=g)
    y = y.to(dev)
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda"
           else contextlib.nullcontext())
    paths = [("plain", None)] + [(f"chunked-{c}", int(c)) for c in args.chunks.split(",")]
    if dev.type == "cuda" and L._liger() is not None:
        paths.append(("liger", None))

    def once(name, chunk):
        h = h0.clone().requires_grad_(True)
        lm_head.weight.grad = None
        with amp:
            out = L.linear_ce_sum(h, lm_head, y, method=name.split("-")[0],
                                  chunk_size=chunk or 1024)[0]
        out.backward()
        return out.detach().float(), h.grad, lm_head.weight.grad

    tol = 5e-2 if dev.type == "cuda" else 1e-4  # bf16 autocast on GPU, fp32 on CPU
    ref = once("plain", None)
    results = {}
    for name, chunk in paths:
        got = once(name, chunk)
        err = [float((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-12))
               for a, b in zip(got, ref, strict=True)]
        if max(err) > tol:
            raise SystemExit(f"{name}: relative error {max(err):.1e} against plain exceeds {tol:g}")
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t = time.perf_counter()
        for _ in range(args.repeats):
            once(name, chunk)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t) / args.repeats * 1e3
        peak = ((torch.cuda.max_memory_allocated() - base) / 2**30) if dev.type == "cuda" else None
        results[name] = {"ms": ms, "extra_peak_gib": peak, "rel_err_loss_dh_dw": err}
        print(f"{name:>14}: {ms:8.2f} ms  extra peak {peak or 0:6.2f} GiB  "
              f"rel err vs plain {max(err):.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "device": str(dev), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
