"""Bidirectional varlen attention kernels at a vision tower's shape, forward + backward.

The segments are the images of the bench's packed rows (`--model`'s encoder on the synthetic
data, bins of `--seq-len` tokens, as bench/train_throughput.py builds them); q, k, v are random
with the tower's heads and head dim. Each kernel runs fwd+bwd on every bin; its error against
an fp32 per-segment SDPA reference on the first bin is reported next to bf16 FlashAttention's
(the "2x bf16" rule: a kernel is acceptable within twice the error of the kernel in use).

    python bench/vision_attention.py --model qwen3.5-35b-a3b [--kernels flash,cudnn,...]

Legend: T = patches of a row, H = heads, D = head dim.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch
import torch.nn.functional as F

from vlpack.config import DataConfig
from vlpack.data.encode import Encoder
from vlpack.data.loader import open_dataset
from vlpack.data.plan import plan_bins
from vlpack.model.presets import get_preset


def bins_of_segments(model: str, seq_len: int, samples: int) -> list[list[int]]:
    """Patches per image of each packed bin of the bench's synthetic data."""
    enc = Encoder.from_config(DataConfig(), get_preset(model).family, None)
    items = [c for c in open_dataset("synthetic", None, synthetic_samples=samples)
             if not isinstance(c, Exception)]
    encoded = [s for s in (enc.encode(c) for c in items) if len(s) <= seq_len]
    out = []
    for b in plan_bins([len(s) for s in encoded], seq_len, "bfd"):
        segs = [int(t * h * w) for i in b if encoded[i].image_grid_thw is not None
                for t, h, w in encoded[i].image_grid_thw.tolist()]
        if segs:
            out.append(segs)
    return out


def reference(q_THD, k_THD, v_THD, segs: list[int], scale: float):
    """fp32 per-segment SDPA (math)."""
    outs, s = [], 0
    for n in segs:
        q, k, v = (x[s:s + n].float().transpose(0, 1)[None] for x in (q_THD, k_THD, v_THD))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            outs.append(F.scaled_dot_product_attention(q, k, v, scale=scale)[0].transpose(0, 1))
        s += n
    return torch.cat(outs)


class CudnnVarlen(torch.autograd.Function):
    """cuDNN's ragged fused attention (the aten ops torch's NJT SDPA calls), bidirectional."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, scale):
        r = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, max_len, max_len, True, 0.0, False, False, scale=scale)
        out, lse, seed, offset = r[0], r[1], r[6], r[7]
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        no_bias = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            g.contiguous(), q, k, v, out, lse, seed, offset, no_bias, cu, cu, ctx.max_len,
            ctx.max_len, 0.0, False, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def per_segment(backend):
    def run(q, k, v, cu, segs, max_len, scale):
        outs, s = [], 0
        for n in segs:
            a, b, c = (x[s:s + n].transpose(0, 1)[None] for x in (q, k, v))
            with torch.nn.attention.sdpa_kernel(backend):
                outs.append(F.scaled_dot_product_attention(a, b, c, scale=scale)[0].transpose(0, 1))
            s += n
        return torch.cat(outs)
    return run


def flash(q, k, v, cu, segs, max_len, scale):
    from vlpack.model.attention import _torch_varlen_call
    return _torch_varlen_call(q, k, v, cu, max_len, False, scale)


def njt(backend):
    """SDPA on nested (jagged) tensors under one backend: torch's public ragged route."""
    def run(q, k, v, cu, segs, max_len, scale):
        nt = [torch.nested.nested_tensor_from_jagged(x, cu.long(), max_seqlen=max_len)
              .transpose(1, 2) for x in (q, k, v)]
        with torch.nn.attention.sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(*nt, scale=scale)
        return out.transpose(1, 2).values()
    return run


def cudnn(q, k, v, cu, segs, max_len, scale):
    return CudnnVarlen.apply(q, k, v, cu, max_len, scale)


_FLEX = None


def flex(q, k, v, cu, segs, max_len, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    global _FLEX
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    doc = torch.repeat_interleave(torch.arange(len(segs), device=q.device),
                                  torch.tensor(segs, device=q.device))
    mask = create_block_mask(lambda b, h, i, j: doc[i] == doc[j], None, None, len(doc), len(doc),
                             device=q.device)
    return _FLEX(*(x.transpose(0, 1)[None] for x in (q, k, v)), block_mask=mask,
                 scale=scale)[0].transpose(0, 1)


KERNELS = {
    "flash": flash,
    "cudnn": cudnn,
    "sdpa_cudnn_per_image": per_segment(torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
    "sdpa_flash_per_image": per_segment(torch.nn.attention.SDPBackend.FLASH_ATTENTION),
    "njt_cudnn": njt(torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
    "sdpa_efficient_per_image": per_segment(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION),
    "flex": flex,
}


DEFAULT_KERNELS = ("flash", "sdpa_cudnn_per_image", "sdpa_flash_per_image",
                   "sdpa_efficient_per_image")


def flops(segs: list[int], heads: int, dim: int) -> float:
    """fwd + bwd matmul FLOPs (fwd 4·S²·H·D, bwd 2.5× fwd)."""
    return 3.5 * sum(4 * n * n * heads * dim for n in segs)


def time_rows(fn, data: list, scale: float, iters: int) -> float:
    """Milliseconds of fwd+bwd per row, averaged over `iters` passes over the rows."""
    def step():
        for q, k, v, go, cu, segs, mx in data:
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            fn(qq, kk, vv, cu, segs, mx, scale).backward(go)
    step()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(iters):
        step()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / iters / len(data)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="qwen3.5-35b-a3b")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--kernels", default=",".join(DEFAULT_KERNELS),
                   help=f"comma list of {', '.join(KERNELS)}. Not in the default: cudnn (torch "
                        "2.11's aten op fails on these inputs) and njt_cudnn (an illegal memory "
                        "access on the H200 that ends the process), both seen with torch 2.11")
    p.add_argument("--head-dims", default=None,
                   help="comma list (default: the tower's); e.g. 64,72,96 shows the padding cost")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    assert torch.cuda.is_available(), "a GPU benchmark"
    dev = torch.device("cuda")
    vision = get_preset(args.model).vision
    heads = vision["num_heads"]
    dims = ([int(d) for d in args.head_dims.split(",")] if args.head_dims
            else [vision["hidden_size"] // heads])
    bins = bins_of_segments(args.model, args.seq_len, args.samples)
    print(f"{len(bins)} bins, patches per bin {[sum(b) for b in bins]}, heads {heads}, "
          f"cudnn {torch.backends.cudnn.version()}, torch {torch.__version__}", flush=True)
    result = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "bins": bins, "heads": heads, "kernels": {}}
    g = torch.Generator(device=dev).manual_seed(0)
    for dim in dims:
        scale = dim ** -0.5
        data = []
        for segs in bins:
            T = sum(segs)
            q, k, v, go = (torch.randn(T, heads, dim, device=dev, generator=g, dtype=torch.bfloat16)
                           for _ in range(4))
            cu = torch.tensor([0, *torch.tensor(segs).cumsum(0).tolist()], device=dev,
                              dtype=torch.int32)
            data.append((q, k, v, go, cu, segs, max(segs)))
        q, k, v, go, cu, segs, mx = data[0]
        qf, kf, vf = (x.float().requires_grad_() for x in (q, k, v))
        ref = reference(qf, kf, vf, segs, scale)
        ref.backward(go.float())
        ref_grads = [ref.detach(), qf.grad, kf.grad, vf.grad]
        total_flops = sum(flops(b, heads, dim) for b in bins)
        for name in args.kernels.split(","):
            fn = KERNELS[name]
            try:
                qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
                out = fn(qq, kk, vv, cu, segs, mx, scale)
                out.backward(go)
                errs = [float((a.float() - b).norm() / b.norm()) for a, b in
                        zip([out.detach(), qq.grad, kk.grad, vv.grad], ref_grads, strict=True)]
                ms = time_rows(fn, data, scale, args.iters)
                r = {"ms_per_row": ms, "tflops": total_flops / len(bins) / ms / 1e9,
                     "rel_err_out_dq_dk_dv": errs}
            except Exception as e:  # recorded: the kernel does not run here
                tb = traceback.extract_tb(e.__traceback__)[-1]
                r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]} "
                              f"({tb.filename}:{tb.lineno})"}
            result["kernels"][f"{name}@d{dim}"] = r
            print(f"{name:>26} d={dim}: {json.dumps(r)}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
