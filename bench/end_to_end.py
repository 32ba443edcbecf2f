"""End to end: the whole job against a bare forward pass, at two corpus sizes.

The corpus is the demo corpus (Python Language Reference prose) ``--repeat`` times over (N
tokens) and ``--factor`` times that (F·N tokens). In one process, in this order:

1. the best bare forward (:mod:`bench.bare_forward`): over the N corpus, every batching of
   ``--bare-batchings`` (64 windows a batch; packed to 1,024 … 8,192 padded tokens), with
   ``--bare-threads`` torch threads shared by ``--bare-lanes`` lanes (batches run at once, as
   the job's CPU extractors run them) and glibc's allocator as it is or tuned as the job's CPU
   extractors tune it, each (threads, allocator) pair in a process of its own, alternately;
   the fastest configuration is what the job is compared with;
2. that bare forward over the F·N corpus, the ideal a user compares with: every window of the
   corpus tokenised, sorted by length over the whole corpus, run under the best configuration,
   ``model(..., output_hidden_states=True)``, outputs discarded (a fresh process);
3. ``python -m jobs.analyze`` on the N corpus and on the F·N corpus, as a user runs it (a fresh
   process: Ray start, model load in the actor, extraction, reduce, tables, sampled metrics,
   report);
4. the best bare forward over F·N again (this machine's speed drifts by ±10-20% over minutes;
   the ratios use the mean of the two).

Printed, and saved in ``bench/results/NAME.json``:

- padding: the job's padded positions / real positions (tokens + special tokens), from its
  manifest;
- marginal throughput: (F − 1)·N / (T_F − T_1) tokens/s — what each further token costs the
  job — as a fraction of the bare forward's tokens/s;
- the same over the extraction stage alone, (F − 1)·N / (E_F − E_1) with E the manifests'
  ``extract_wall``: the sampled stage's cost follows each run's sample (how far its K-means
  search grew, printed per layer), not the tokens, so T_F − T_1 also holds the difference
  between two samples' stages;
- fixed cost: T_1 − N / marginal, split by stage from the N run's manifest and wall time
  (process start and exit, plan, Ray's start, extraction beyond the marginal cost, reduce,
  metrics, write, report);
- end to end: bare-forward time of the F·N tokens / T_F.

    python -m bench.end_to_end [--model minilm] [--repeat 1] [--factor 4] [--extra-args "..."]
        [--bare-batchings rows:64,tokens:2048] [--bare-threads 1,2] [--bare-lanes 1,2]
        [--bare-allocators default]
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

from bench.bare_forward import (
    ALLOCATORS,
    BATCHINGS,
    best_bare_forward,
    print_sweep,
    timed_bare_forward,
)
from bench.common import english_jsonl, minilm_dir, random_bert_dir, save, work_dir
from embgeom_ray.sizing import lanes_for

ROOT = Path(__file__).resolve().parents[1]


def print_bare(res: dict, best: dict) -> None:
    print(
        f"bare forward (sorted corpus, {best['batching']}, {best['threads']} threads in "
        f"{best.get('lanes', 1)} lane(s), "
        f"{best['allocator']} allocator): {res['tokens']:,} tokens in {res['seconds']:.1f} s = "
        f"{res['tokens'] / res['seconds']:,.0f} tok/s, padded/real {res['padding']:.3f}"
    )


def run_job(model: str, corpus: str, out: Path, args) -> tuple[float, dict]:
    """``python -m jobs.analyze`` in a fresh process; (wall seconds, its manifest)."""
    threads = os.cpu_count() or 1
    cmd = [
        sys.executable, "-m", "jobs.analyze", "--model", model, "--corpus", corpus,
        "--out", str(out), "--max-length", str(args.max_length), "--num-workers", "1",
        "--cpus-per-worker", str(threads), *shlex.split(args.extra_args),
    ]  # fmt: skip
    env = dict(os.environ, RAY_ADDRESS="")
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    manifest = json.loads((out / "manifest.json").read_text())
    print(f"job: {manifest['counts']['tokens']:,} tokens in {wall:.1f} s; "
          f"timings {manifest['timings_s']}")
    return wall, manifest


def job_lanes(args) -> int:
    """The CPU lanes of :func:`run_job`'s extractor: ``--cpu-lanes`` in ``--extra-args``, else
    one a CPU (it has them all)."""
    extra = shlex.split(args.extra_args)
    given = extra[extra.index("--cpu-lanes") + 1] if "--cpu-lanes" in extra[:-1] else None
    return lanes_for(int(given) if given else None, os.cpu_count() or 1)


def kmeans_searched(out: Path) -> list[int]:
    """The largest k each layer's K-means model selection fitted (``kmeans_k_searched``): the
    sampled stage's cost grows with it (the search grows past 15 while the best silhouette is
    at the top of the range), so two runs' stages differ with their samples."""
    import pandas as pd

    layers = pd.read_parquet(out / "layers.parquet", columns=["layer", "kmeans_k_searched"])
    return [int(k) for k in layers.sort_values("layer")["kmeans_k_searched"]]


def fixed_cost_split(wall: float, manifest: dict, tokens: int, marginal: float) -> dict:
    """Where the N run's time beyond N / marginal went, stage by stage."""
    t = manifest["timings_s"]
    return {
        # Python's start and imports, and Ray's shutdown at exit (Ray's start is ray_start)
        "process_start_and_exit": wall - t["total"] - t.get("report", 0.0),
        "plan": t["plan"],
        "ray_start": t.get("ray_start", 0.0),
        "extraction_beyond_marginal": t["extract_wall"] - tokens / marginal,
        "reduce": t["reduce"],
        "metrics_tables_and_sampled": t["metrics"],
        # the two parts of metrics (manifests of this version on)
        **({"tables": t["tables"], "sampled_stage": t["sampled"]} if "sampled" in t else {}),
        "write": t["write"],
        "report": t.get("report", 0.0),
    }


def summarise(
    before: dict, after: dict, small: tuple[float, dict], large: tuple[float, dict], lanes: int = 1
) -> dict:
    """The bench's numbers from the two bare forwards (:func:`bench.bare_forward.timed_bare_forward`) and the two
    jobs' (wall seconds, manifest) (:func:`run_job`) on N and F·N tokens, whose extractor ran
    ``lanes`` CPU lanes (its forwards' sum counts each lane's: divided by the lanes, the
    forward's share of the wall time)."""
    (t_small, m_small), (t_large, m_large) = small, large
    bare_s = (before["seconds"] + after["seconds"]) / 2
    n_small, n_large = m_small["counts"]["tokens"], m_large["counts"]["tokens"]
    if n_large != before["tokens"]:
        raise ValueError(f"the job counted {n_large} tokens, the bare forward {before['tokens']}")
    bare_rate = n_large / bare_s
    marginal = (n_large - n_small) / (t_large - t_small)
    fixed = t_small - n_small / marginal
    # the same difference over the extraction stage alone: free of the sampled stage, whose
    # cost follows each run's sample (kmeans_searched), not the number of tokens
    e_small, e_large = (m["timings_s"]["extract_wall"] for m in (m_small, m_large))
    forward_sum = m_large["timings_s"]["extract_forward_sum"]
    forward_large = forward_sum / lanes
    marginal_extract = (n_large - n_small) / (e_large - e_small)
    return {
        "tokens": {"N": n_small, "FN": n_large},
        "padding_job": m_large["counts"].get("padding_ratio"),
        "padding_bare_sorted": before["padding"],
        "bare_forward_s": bare_s,
        "bare_forward_before_after_s": [before["seconds"], after["seconds"]],
        "bare_tokens_per_s": bare_rate,
        "job_wall_s": {"N": t_small, "FN": t_large},
        "job_timings_s": {"N": m_small["timings_s"], "FN": m_large["timings_s"]},
        "marginal_tokens_per_s": marginal,
        "marginal_ratio": marginal / bare_rate,
        "marginal_extraction_tokens_per_s": marginal_extract,
        "marginal_extraction_ratio": marginal_extract / bare_rate,
        "fixed_cost_s": fixed,
        "fixed_cost_split_s": fixed_cost_split(t_small, m_small, n_small, marginal),
        "end_to_end_ratio_FN": bare_s / t_large,
        # within the F·N run itself, free of the drift between runs
        "forward_share_of_job_FN": forward_large / t_large,
        # the model inside the job (its forward calls alone, no tokenising, no fold) against
        # the bare forward (whose clock includes tokenising)
        "job_forward_tokens_per_s_FN": n_large / forward_large,
        "job_forward_ratio_FN": n_large / forward_large / bare_rate,
        # both sums over the lanes: the fold's CPU time against the forward's
        "job_fold_per_forward_FN": m_large["timings_s"].get("extract_fold_sum", 0.0)
        / forward_sum,
        "lanes": lanes,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="minilm", choices=["minilm", "bert-base"])
    p.add_argument("--repeat", type=int, default=1, help="copies of the demo corpus in N")
    p.add_argument("--factor", type=int, default=4, help="the larger corpus is this times N")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument(
        "--bare-batchings", default=",".join(BATCHINGS),
        help="the bare forward's batchings to try: rows:R (R windows a batch), tokens:N",
    )  # fmt: skip
    p.add_argument("--bare-threads", default=str(os.cpu_count() or 1), help="a list to try")
    p.add_argument("--bare-lanes", default=f"1,{os.cpu_count() or 1}", help="a list to try")
    p.add_argument("--bare-allocators", default=",".join(ALLOCATORS), help="default, reuse")
    p.add_argument("--bare-repeats", type=int, default=2, help="per process of the sweep")
    p.add_argument("--extra-args", default="", help="more jobs.analyze flags, quoted")
    p.add_argument("--name", default="end_to_end")
    args = p.parse_args(argv)
    with work_dir("end-to-end") as work:
        small = english_jsonl(work / "small.jsonl", repeat=args.repeat)
        large = english_jsonl(work / "large.jsonl", repeat=args.repeat * args.factor)
        model = minilm_dir() if args.model == "minilm" else random_bert_dir(work / "bert-base")
        sweep = best_bare_forward(
            model, small, args.max_length, args.bare_batchings.split(","),
            [int(t) for t in args.bare_threads.split(",")], args.bare_allocators.split(","),
            args.bare_repeats, lanes=tuple(int(k) for k in args.bare_lanes.split(",")),
        )  # fmt: skip
        print_sweep(sweep)
        best = sweep["best"]
        before = timed_bare_forward(model, large, args.max_length, best)
        print_bare(before, best)
        t_small, m_small = run_job(model, small, work / "small", args)
        t_large, m_large = run_job(model, large, work / "large", args)
        after = timed_bare_forward(model, large, args.max_length, best)
        print_bare(after, best)
        result = {
            "model": args.model,
            "bare_forward_best": best,
            "bare_forward_sweep": sweep,
            "extra_args": args.extra_args,
            "load_average": os.getloadavg(),
            **summarise(before, after, (t_small, m_small), (t_large, m_large), job_lanes(args)),
            "kmeans_k_searched": {
                "N": kmeans_searched(work / "small"), "FN": kmeans_searched(work / "large")
            },
        }
        marginal = result["marginal_tokens_per_s"]
        marginal_extract = result["marginal_extraction_tokens_per_s"]
        fixed, bare_rate = result["fixed_cost_s"], result["bare_tokens_per_s"]
        n_large = result["tokens"]["FN"]
        print(
            f"padding: job {result['padding_job']:.3f}, bare sorted "
            f"{result['padding_bare_sorted']:.3f}; "
            f"marginal {marginal:,.0f} tok/s = {result['marginal_ratio']:.3f} of the bare forward "
            f"({bare_rate:,.0f} tok/s), extraction stage alone {marginal_extract:,.0f} tok/s = "
            f"{result['marginal_extraction_ratio']:.3f}; K-means searched up to k = "
            f"{result['kmeans_k_searched']} (N, F·N); fixed cost {fixed:.1f} s "
            f"{ {k: round(v, 1) for k, v in result['fixed_cost_split_s'].items()} }; "
            f"end to end at {n_large:,} tokens {result['end_to_end_ratio_FN']:.3f}; the forward "
            f"inside the F·N job {result['job_forward_tokens_per_s_FN']:,.0f} tok/s = "
            f"{result['job_forward_ratio_FN']:.3f} of the bare forward, its fold "
            f"{result['job_fold_per_forward_FN']:.3f} of its forward"
        )
        save(args.name, {"command": "python -m bench.end_to_end", "args": vars(args), **result})


if __name__ == "__main__":
    main()
