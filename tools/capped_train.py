"""`vlpack train` as on a smaller GPU: this process's CUDA memory capped at BYTES from the moment the
int8 experts are quantized (`model.frozen_dtype=int8`).

    python tools/capped_train.py 48e9 train qwen3.5-35b-a3b-lora model.frozen_dtype=int8 data.seq_len=4096 ...

A preset's random bf16 weights are drawn on the GPU and then quantized in place, so the build needs
the bf16 model's memory once; a checkpoint folder is read into host memory instead and never needs
it. The cap (`torch.cuda.set_per_process_memory_fraction`) therefore starts after quantizing, and
the training runs under it: the memory plan, the allocator and every step see a card of BYTES.
How docs/training.md measured the 35B's int8 run for a 48 GB card.
"""

from __future__ import annotations

import sys

import torch

from vlpack.model import quant

_quantize = quant.quantize_experts


def _quantize_then_cap(model: torch.nn.Module, device: torch.device, **kwargs) -> int:
    done = _quantize(model, device, **kwargs)
    if device.type != "cuda":  # the memory plan's meta shapes
        return done
    cap = float(sys.argv[1])
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()  # the bf16 experts' blocks, cached by the allocator
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    torch.cuda.reset_peak_memory_stats(device)
    print(f"capped at {cap / 2**30:.1f} GiB of {total / 2**30:.1f} GiB after quantizing; "
          f"allocated {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB", flush=True)
    return done


if __name__ == "__main__":  # the synthetic data's worker processes import this file again
    from vlpack.cli import main

    quant.quantize_experts = _quantize_then_cap  # train/setup/prepare.py's int8 step imports it
    sys.exit(main(sys.argv[2:]))
