"""The whole job with and without task workers warmed during the extraction, alternately.

``python -m jobs.analyze`` on the demo corpus (MiniLM, ``--max-length 128``, one extractor of
``--cpus-per-worker`` CPUs, a private local Ray), each run a fresh process, ``--repeats`` pairs
run alternately: (a) ``--no-warm-workers`` (every task of the sampled stage and the report
starts in a fresh worker process and imports its libraries there) and (b) the default, which
warms one worker per CPU while the extractor loads its model, their imports at idle priority
(:mod:`embgeom_ray.distributed.warm_workers`). Printed: the median wall time of each and its
stages from the manifests (extraction, tables and sampled metrics, report), and the ratio
(b) / (a); the two runs' tables are checked to be the same.

``--address`` has the jobs join that Ray cluster instead: the job warms task workers on its
private local Ray only, so there both runs are alike, and nothing is measured. It is for a
check of the bench itself that needs no stage (``--extra-args "--sample-size 0 --no-report"``,
where no worker is warmed anyway): tests/bench/test_bench_smoke.py, on the tests' Ray.

    python -m bench.warm_workers [--repeats 2] [--cpus-per-worker 1] [--docs N]
        [--extra-args "..."] [--address ADDRESS]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from bench.common import english_jsonl, median, minilm_dir, save, work_dir

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("extract_wall", "metrics", "sampled", "write", "report")


def run_job(corpus: str, out: Path, warm: bool, args) -> dict:
    """One ``python -m jobs.analyze`` in a fresh process: wall seconds and manifest timings."""
    cmd = [
        sys.executable, "-m", "jobs.analyze", "--model", minilm_dir(), "--corpus", corpus,
        "--out", str(out), "--max-length", "128", "--num-workers", "1", "--overwrite",
        "--cpus-per-worker", str(args.cpus_per_worker), *shlex.split(args.extra_args),
        *([] if warm else ["--no-warm-workers"]),
    ]  # fmt: skip
    env = dict(os.environ, RAY_ADDRESS=args.address)  # "": each its own private local Ray
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    timings = json.loads((out / "manifest.json").read_text())["timings_s"]
    row = {"wall": wall, **{s: timings.get(s, 0.0) for s in STAGES}}
    print(f"{'warm' if warm else 'cold'}: " + ", ".join(f"{k} {v:.1f} s" for k, v in row.items()))
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2, help="pairs of runs")
    p.add_argument("--cpus-per-worker", type=int, default=1, help="the extractor's CPUs")
    p.add_argument("--docs", type=int, default=0, help="only the first N documents (0: all)")
    p.add_argument("--extra-args", default="", help="more jobs.analyze flags, quoted")
    p.add_argument("--address", default="", help="a Ray cluster for the jobs to join "
                   "(default: each its own private local Ray; no warm workers elsewhere)")
    p.add_argument("--name", default="warm_workers")
    args = p.parse_args(argv)
    with work_dir("warm-workers") as work:
        corpus = english_jsonl(work / "corpus.jsonl")
        if args.docs:
            lines = Path(corpus).read_text().splitlines(keepends=True)[: args.docs]
            Path(corpus).write_text("".join(lines))
        runs: dict[str, list[dict]] = {"cold": [], "warm": []}
        for _ in range(args.repeats):
            for name in ("cold", "warm"):
                runs[name].append(run_job(corpus, work / name, name == "warm", args))
        layers = {n: pd.read_parquet(work / n / "layers.parquet") for n in runs}
        pd.testing.assert_frame_equal(layers["cold"], layers["warm"])  # the same results
    med = {n: {k: median([r[k] for r in rs]) for k in rs[0]} for n, rs in runs.items()}
    ratio = {k: med["warm"][k] / med["cold"][k] for k in med["cold"] if med["cold"][k]}
    print(
        f"median of {args.repeats}: wall {med['cold']['wall']:.1f} s cold -> "
        f"{med['warm']['wall']:.1f} s warm (x{ratio['wall']:.3f}); "
        + "; ".join(f"{s} {med['cold'][s]:.1f} -> {med['warm'][s]:.1f} s" for s in STAGES)
    )
    save(
        args.name,
        {"command": "python -m bench.warm_workers", "args": vars(args), "runs": runs,
         "median_s": med, "ratio_warm_to_cold": ratio},
    )  # fmt: skip


if __name__ == "__main__":
    main()
