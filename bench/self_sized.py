"""Peak memory of every process of a job run with the default options, for two vocabularies.

For each V in ``--vocab``: a random Llama-shaped model with a WordLevel tokenizer of V entries
(bench.vocabulary: ``--dim``, ``--blocks``) and a generated corpus of ``--tokens`` words; then
``python -m jobs.analyze --model M --corpus C --out OUT`` with nothing else, in a fresh process
with its own private Ray, as a user runs it. Printed per V: the types seen, the per-type state
8·L·V_seen·(2d+2), what the job decided (extractors × the memory each asked Ray for and their
statistics budget; reducers × their budget, or the job's own process), and each process's peak
private memory against its budget: the job's own process above its memory at start (≤ 1 GiB),
the extractor against what it asked Ray for, every reducer against its budget; and the
checkpoint interval the job chose, with the bytes its checkpoints wrote and their share of
the extraction's time (``sizing.checkpoints``: in all, and before the queue drained, the
extractors' last flushes apart).

``--out-url s3://bucket/runs`` writes the runs to an object store; to measure against moto's
S3 server on loopback (no real store): start ``moto_server -H 127.0.0.1 -p PORT``, create the
bucket (``aws --endpoint-url http://127.0.0.1:PORT s3 mb s3://bench``, or s3fs's ``mkdir``),
and run this with ``AWS_ENDPOINT_URL_S3=http://127.0.0.1:PORT``, ``AWS_ACCESS_KEY_ID=testing``,
``AWS_SECRET_ACCESS_KEY=testing`` and ``AWS_DEFAULT_REGION=us-east-1`` in its environment.

    python -m bench.self_sized [--vocab 32000,128256] [--dim 256] [--blocks 4] [--tokens 300000]
        [--out-url s3://bucket/runs]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, save, work_dir
from bench.vocabulary import generated_corpus, wordlevel_llama_dir

MIB = 2**20
#: what a run's ``sizing.checkpoints`` says of its checkpoints' writes
CHECKPOINT_KEYS = ("writers", "writers_reason", "interval_s", "flushes", "bytes_written",
                   "write_s", "bandwidth_bytes_per_s", "write_share", "last_flushes",
                   "last_write_s", "write_share_before_drain")  # fmt: skip


def run_default(model: str, corpus: str, out: Path | str) -> dict:
    """The job with the default options in a fresh process; its manifest (``out`` a folder,
    or a URL such as ``s3://bucket/run``, read with fsspec)."""
    import fsspec

    env = os.environ | {"PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "jobs.analyze", "--model", model, "--corpus", corpus,
            "--out", str(out)]  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the job failed:\n{done.stderr[-3000:]}")
    with fsspec.open(f"{str(out).rstrip('/')}/manifest.json", "r") as f:
        return json.load(f)


def row(vocab: int, m: dict, seconds: float) -> dict:
    """One line of the table: decisions and peaks (MiB)."""
    memory, sizing = m["memory"], m["sizing"]
    reduce, layers, d = sizing["reduce"], len(m["layers"]), m["model"]["hidden_size"]
    return {
        "vocab": vocab,
        "types_seen": reduce["types"],
        "per_type_state_mib": round(8 * layers * reduce["types"] * (2 * d + 2) / MIB),
        "extractors": m["workers"]["num_workers"],
        "extractor_asked_mib": round(m["workers"]["memory_bytes"] / MIB),
        "extractor_statistics_mib": None
        if m["workers"]["statistics_bytes"] is None
        else round(m["workers"]["statistics_bytes"] / MIB),
        "extractor_peak_private_mib": round(memory["extractor_peak_private_bytes"] / MIB),
        "reducers": reduce["count"],
        "reducer_budget_mib": None if not reduce["count"] else round(reduce["memory"] / MIB),
        "reducer_peak_private_mib": [round(p / MIB) for p in memory.get("reducer_peak_private_bytes", [])],
        "driver_start_private_mib": round(memory["driver_start_private_bytes"] / MIB),
        "driver_peak_private_mib": round(memory["driver_peak_private_bytes"] / MIB),
        "driver_above_start_mib": round(
            (memory["driver_peak_private_bytes"] - memory["driver_start_private_bytes"]) / MIB
        ),
        "seconds": round(seconds, 1),
        # the checkpoint interval as the job sized it, and what its writes took
        "checkpoints": {k: sizing.get("checkpoints", {}).get(k) for k in CHECKPOINT_KEYS}
        | {"extract_wall_s": m["timings_s"].get("extract_wall")},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--vocab", default="32000,128256")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=300_000)
    p.add_argument(
        "--out-url", default=None,
        help="write the runs under this URL (e.g. s3://bucket/runs: each extractor then writes "
        "its own checkpoint groups) instead of a temporary folder",
    )  # fmt: skip
    p.add_argument("--name", default="self_sized")
    args = p.parse_args(argv)
    with work_dir("self-sized") as work:
        rows = []
        for vocab in (int(v) for v in args.vocab.split(",")):
            model = wordlevel_llama_dir(work / f"model-{vocab}", vocab, args.dim, args.blocks)
            corpus = generated_corpus(work / f"corpus-{vocab}.jsonl", vocab, args.tokens)
            t0 = time.perf_counter()
            out = work / f"run-{vocab}" if args.out_url is None else f"{args.out_url}/run-{vocab}"
            m = run_default(model, corpus, out)
            rows.append(row(vocab, m, time.perf_counter() - t0))
            print(json.dumps(rows[-1]), flush=True)
        save(args.name, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
