"""The bytes checkpoints write with and without a host tier, on a frontier-shaped vocabulary.

A random Llama-shaped model with a WordLevel tokenizer of ``--vocab`` entries (bench.vocabulary:
``--dim``, ``--blocks``), a corpus of ``--tokens`` words drawn from a Zipf law over the
vocabulary (p(rank r) ∝ r^-``--zipf``: every stretch of text repeats the frequent types, as
text does), cut into shards of ``--shard-bytes``. Two jobs over it (``python -m jobs.analyze``
in fresh processes, each with its own private Ray), both with a statistics budget
``--statistics-memory`` that holds a few thousand types, as a GPU's memory holds a few
thousand types of an 8B model's 128k (docs/sizing.md):

- **spills**: past σ the running statistics are spilled to Ray's object store as pieces, and
  every shard whose statistics passed σ ends in a flush of all its pieces;
- **tier**: the same, with ``--host-statistics-memory`` (H): each spill is merged on the host
  into statistics of at most H bytes, and a flush comes when those fill (or at the interval,
  and when the queue drains).

Printed for each: the checkpoint groups, the bytes they wrote (``sizing.checkpoints``), the
spills and the host tier's merges, the extraction's seconds, and the ratio of the bytes;
and how far the two runs' exact tables are apart (they fold the same batches; only the order
of Chan's merges differs).

    python -m bench.host_tier [--vocab 128256] [--dim 128] [--blocks 2] [--tokens 400000]
        [--zipf 1.1] [--statistics-types 4000] [--host-gib 1] [--shard-bytes 262144]

``--fold-only --device cuda`` runs no job: in this process, random hidden states with
Zipf-distributed ids are folded on the device (``--batches`` batches of ``--batch-rows``
tokens, ``--dim``, ``--blocks`` + 1 layers) under the same σ, once spilling every piece and
once into a host tier, whose merges then move each GPU accumulator's rows to the host. The
two runs' pieces, merged on the CPU, must hold the same statistics (their largest relative
difference is printed: float64 rounding), and the tier's pieces fewer bytes. This is the
check of the tier's GPU path that ``bench/gpu.sh`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from bench.common import REPO, save, work_dir
from bench.vocabulary import wordlevel_llama_dir

GIB = 2**30
#: the exact tables compared between the two runs, and their keys
TABLES = {"type_stats": ["layer", "token_id"], "layers": ["layer"], "dims": ["layer", "dim"]}


def zipf_corpus(path: Path, vocab: int, tokens: int, a: float, seed: int = 0) -> str:
    """Documents of 100 words, each word the rank-r entry of the vocabulary with probability
    ∝ r^-a (a finite Zipf law over the tokenizer's words)."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, vocab - 4 + 1, dtype=np.float64)
    p = ranks**-a
    ids = 4 + rng.choice(vocab - 4, size=tokens, p=p / p.sum())
    with path.open("w") as f:
        for start in range(0, tokens, 100):
            f.write(json.dumps({"text": " ".join(f"w{i}" for i in ids[start : start + 100])}) + "\n")
    return str(path)


def run(model: str, corpus: str, out: Path, extra: list[str]) -> tuple[dict, float]:
    """The job with ``extra`` options in a fresh process: its manifest and wall seconds."""
    env = os.environ | {"PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "jobs.analyze", "--model", model, "--corpus", corpus,
            "--out", str(out), "--no-report", "--sample-size", "0", *extra]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the job failed:\n{done.stderr[-3000:]}")
    return json.loads((out / "manifest.json").read_text()), time.perf_counter() - t0


def summary(m: dict, seconds: float) -> dict:
    """What a run's manifest says of its checkpoints' writes."""
    checkpoints, workers = m["sizing"]["checkpoints"], m["workers"]
    return {
        "types_seen": m["sizing"]["reduce"]["types"],
        "checkpoint_groups": m["shards"]["checkpoint_groups"],
        "bytes_written": checkpoints["bytes_written"],
        "write_s": checkpoints["write_s"],
        "spills": workers["spills"],
        "host_merges": workers.get("host_merges", 0),
        "budget_flushes": workers["budget_flushes"],
        "extract_wall_s": m["timings_s"]["extract_wall"],
        "extractor_peak_private_mib": round(m["memory"]["extractor_peak_private_bytes"] / 2**20),
        "extractor_asked_mib": round(workers["memory_bytes"] / 2**20),
        "seconds": round(seconds, 1),
    }


def max_rel_diff(a: Path, b: Path) -> float:
    """The largest relative difference of the two runs' exact tables' float columns."""
    worst = 0.0
    for name, keys in TABLES.items():
        x = pd.read_parquet(a / f"{name}.parquet").sort_values(keys).reset_index(drop=True)
        y = pd.read_parquet(b / f"{name}.parquet").sort_values(keys).reset_index(drop=True)
        for col in x.columns:
            if x[col].dtype.kind == "f":
                u, v = x[col].to_numpy(), y[col].to_numpy()
                ok = np.isfinite(u) & np.isfinite(v)
                scale = np.maximum(np.abs(u[ok]), np.abs(v[ok])).max(initial=0.0)
                if scale > 0:
                    worst = max(worst, float(np.abs(u[ok] - v[ok]).max() / scale))
    return worst


def fold_check(args: argparse.Namespace) -> dict:
    """``--fold-only`` (module docstring): the tier's merges of device accumulators against
    the same accumulators spilled piece by piece."""
    import torch

    from embgeom_ray.core.spilling import HostTier, SpillingStatistics
    from embgeom_ray.core.statistics import EmbeddingStatistics, state_bytes

    layers, rows = list(range(args.blocks + 1)), args.batch_rows
    positions = 128

    def new() -> EmbeddingStatistics:
        return EmbeddingStatistics(layers, args.dim, max_positions=positions, device=args.device)

    sigma = state_bytes(len(layers), args.dim, args.statistics_types, positions)
    host = int(args.host_gib * GIB)
    plain = SpillingStatistics(new(), sigma)
    tiered = SpillingStatistics(new(), sigma, host=HostTier(host))
    rng = np.random.default_rng(0)
    ranks = np.arange(1, args.vocab + 1, dtype=np.float64) ** -args.zipf
    p = ranks / ranks.sum()
    t0 = time.perf_counter()
    for _ in range(args.batches):
        ids = torch.as_tensor(rng.choice(args.vocab, size=(rows // positions, positions), p=p))
        ids = ids.to(args.device)
        shape = (len(layers), *ids.shape, args.dim)
        hidden = torch.randn(shape, dtype=torch.float32, device=args.device).add_(3.0)
        plain.update(hidden, ids)
        tiered.update(hidden, ids)
    fold_s = time.perf_counter() - t0
    pieces = {"spills": plain.take(), "tier": tiered.take()}

    def merged(name: str) -> EmbeddingStatistics:
        out = EmbeddingStatistics.from_bytes(pieces[name][0])
        for data in pieces[name][1:]:
            out.merge(EmbeddingStatistics.from_bytes(data))
        return out

    a, b = (merged(name).state_dict() for name in ("spills", "tier"))
    worst = 0.0
    for key, x in a.items():
        y = b[key]
        if x.dtype.kind == "f":
            scale = np.abs(x).max(initial=0.0)
            if scale > 0:
                worst = max(worst, float(np.abs(x - y).max() / scale))
        elif not np.array_equal(x, y):
            raise SystemExit(f"the tier's {key} differ from the spills'")
    return {
        "device": args.device,
        "statistics_budget_bytes": sigma,
        "host_tier_bytes": host,
        "spills": plain.spills,
        "host_merges": tiered.merges,
        "tier_spills": tiered.spills,
        "bytes": {name: sum(len(x) for x in got) for name, got in pieces.items()},
        "fold_s": round(fold_s, 3),
        "max_rel_diff": worst,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=400_000)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--statistics-types", type=int, default=4000,
                   help="σ: the statistics budget, in types' rows beside the per-layer state")
    p.add_argument("--host-gib", type=float, default=1.0, help="H, the host tier (GiB)")
    p.add_argument("--shard-bytes", type=int, default=256 * 1024)
    p.add_argument("--fold-only", action="store_true",
                   help="no job: the fold on --device under σ, spilled and into a tier")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--batch-rows", type=int, default=8192)
    p.add_argument("--name", default="host_tier")
    args = p.parse_args(argv)
    command = "python -m bench.host_tier " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.fold_only:
        result = fold_check(args)
        result["bytes_ratio_tier_to_spills"] = round(
            result["bytes"]["tier"] / result["bytes"]["spills"], 4
        )
        print(json.dumps(result), flush=True)
        save(args.name, {"command": command, "args": vars(args), **result})
        return

    from embgeom_ray.core.statistics import state_bytes

    with work_dir("host-tier") as work:
        model = wordlevel_llama_dir(work / "model", args.vocab, args.dim, args.blocks)
        corpus = zipf_corpus(work / "corpus.jsonl", args.vocab, args.tokens, args.zipf)
        layers = args.blocks + 1
        sigma = state_bytes(layers, args.dim, args.statistics_types, 128)
        host = int(args.host_gib * GIB)
        common = ["--statistics-memory", str(sigma), "--shard-bytes", str(args.shard_bytes),
                  "--num-workers", "1"]  # fmt: skip
        runs = {}
        for name, extra in (("spills", []), ("tier", ["--host-statistics-memory", str(host)])):
            m, seconds = run(model, corpus, work / name, common + extra)
            runs[name] = summary(m, seconds)
            print(name, json.dumps(runs[name]), flush=True)
        result = {
            "command": command,
            "args": vars(args),
            "statistics_budget_bytes": sigma,
            "host_tier_bytes": host,
            "runs": runs,
            "bytes_ratio_tier_to_spills": round(
                runs["tier"]["bytes_written"] / runs["spills"]["bytes_written"], 4
            ),
            "extract_ratio_tier_to_spills": round(
                runs["tier"]["extract_wall_s"] / runs["spills"]["extract_wall_s"], 3
            ),
            "tables_max_rel_diff": max_rel_diff(work / "spills", work / "tier"),
        }
        print(json.dumps({k: result[k] for k in list(result)[-3:]}), flush=True)
        save(args.name, result)


if __name__ == "__main__":
    main()
