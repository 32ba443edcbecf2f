"""End to end: the whole job's wall time against a bare forward pass over the same tokens.

The corpus is the demo corpus (Python Language Reference prose) ``--repeat`` times over
(6x: ~0.5M tokens). First the bare forward — tokenise, the job's batches, ``model(...,
output_hidden_states=True)`` with the job's thread count, outputs discarded — then
``python -m jobs.analyze`` as a user runs it (a fresh process: Ray start, model load in the
actor, extraction, checkpoints, reduce, tables, sampled metrics with K-means on Ray, report).
The bare forward runs again after the job, and the ratios use the mean of the two runs
(this machine's speed drifts by ±10-20% over minutes). Printed: job throughput as a fraction
of the bare forward's, for the whole job and for its extraction stage; the share of the
job's wall time spent in the model's forward inside the actor (measured within the one run,
so free of that drift); and the manifest's breakdown of where the rest went.

    python -m bench.end_to_end [--model minilm] [--repeat 6] [--extra-args "..."]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import english_jsonl, minilm_dir, random_bert_dir, save, timed
from bench.extraction import bare_forward

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="minilm", choices=["minilm", "bert-base"])
    p.add_argument("--repeat", type=int, default=6, help="copies of the demo corpus")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--extra-args", default="", help="more jobs.analyze flags, quoted")
    p.add_argument("--name", default="end_to_end")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="embgeom-e2e-"))
    corpus = english_jsonl(work / "corpus.jsonl", repeat=args.repeat)
    model = minilm_dir() if args.model == "minilm" else random_bert_dir(work / "bert-base")
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)

    from embgeom_ray.config import build_config
    from embgeom_ray.inputs.corpus import CorpusSpec, plan_shards
    from embgeom_ray.inputs.extractor import ShardProcessor
    from embgeom_ray.inputs.model_loading import resolve_identity, resolve_layers

    identity, _ = resolve_identity(model, None, False)
    layers = resolve_layers(None, identity.num_layers)
    cfg = build_config(
        None,
        {"model": model, "corpus": corpus, "out": str(work / "x"), "max_length": args.max_length},
    )
    proc = ShardProcessor(cfg, layers, {})
    shards = plan_shards(CorpusSpec(corpus)).shards

    def bare() -> tuple[float, int]:
        seconds, tokens = 0.0, 0
        for shard in shards:
            t, n = timed(lambda shard=shard: bare_forward(proc, shard))
            seconds += t
            tokens += n
        print(f"bare forward: {tokens:,} tokens in {seconds:.1f} s = {tokens / seconds:,.0f} tok/s")
        return seconds, tokens

    bare_before, tokens = bare()

    out = work / "run"
    cmd = [
        sys.executable, "-m", "jobs.analyze", "--model", model, "--corpus", corpus,
        "--out", str(out), "--max-length", str(args.max_length), "--num-workers", "1",
        "--cpus-per-worker", str(threads), *shlex.split(args.extra_args),
    ]  # fmt: skip
    env = dict(os.environ, RAY_ADDRESS="")
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    job_s = time.perf_counter() - t0
    # the machine's speed drifts over minutes (shared VMs): a second bare forward after the
    # job brackets it, and the ratios use the mean of the two
    bare_after, _ = bare()
    bare_s = (bare_before + bare_after) / 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["tokens"] == tokens, (manifest["counts"]["tokens"], tokens)
    timings = manifest["timings_s"]
    result = {
        "model": args.model,
        "tokens": tokens,
        "threads": threads,
        "extra_args": args.extra_args,
        "bare_forward_s": bare_s,
        "bare_forward_before_after_s": [bare_before, bare_after],
        "job_wall_s": job_s,
        "job_timings_s": timings,
        "ratio_job_to_bare": bare_s / job_s,
        "ratio_extract_stage_to_bare": bare_s / timings["extract_wall"],
        # within the job's own run, so free of the drift between runs: the share of the
        # wall time that the model's forward took inside the actor
        "forward_share_of_job": timings["extract_forward_sum"] / job_s,
        "forward_share_of_extract_stage": (
            timings["extract_forward_sum"] / timings["extract_wall"]
        ),
    }
    print(
        f"job: {job_s:.1f} s wall = {tokens / job_s:,.0f} tok/s; ratio to bare forward "
        f"{bare_s / job_s:.3f} (extraction stage {bare_s / timings['extract_wall']:.3f}); "
        f"the actor's forward took {result['forward_share_of_job']:.3f} of the job's wall "
        f"time ({result['forward_share_of_extract_stage']:.3f} of the extraction stage); "
        f"manifest timings: {timings}"
    )
    save(args.name, {"command": "python -m bench.end_to_end", "args": vars(args), **result})


if __name__ == "__main__":
    main()
