#!/usr/bin/env bash
# One H200 session: throughput side by side on qwen3-vl-2b, then a packed qwen3-vl-2b recipe
# run (random init). Run from the repo root on the device with the wheels carried in .whl/:
#   bash bench/h200_session.sh "$OUT"
set -u
OUT=${1:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 VLPACK_CACHE=/tmp/vlcache TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
# Synthetic data once (shared by the bench and the run).
python3 -c "from vlpack.data.synth import default_dataset; print(default_dataset(n=${SAMPLES:-1600}))"
timeout ${BENCH_S:-200} python3 bench/train_throughput.py --model qwen3-vl-2b --samples 96 --steps 4 --warmup 2 \
  --out "$OUT/throughput.json" 2>&1 | tee "$OUT/bench.log"
timeout ${TRAIN_S:-300} python3 -m vlpack train qwen3-vl-2b data.synthetic_samples=${SAMPLES:-1600} \
  data.num_workers=12 data.eval_samples=64 train.max_steps=${STEPS:-200} train.eval_every=100 \
  train.save_every=0 train.save_final=false train.output_dir="$OUT/qwen3-vl-2b" train.progress=false \
  2>&1 | tail -40 | tee "$OUT/train.log"
