"""The bare forward a user would compare the job with, at its best: every window of a corpus,
sorted by length over the whole corpus, ``model(..., output_hidden_states=True)``, outputs
discarded, under the batching, thread count, lanes and allocator that run it fastest.

A *batching* is ``rows:R`` (R windows a batch, in length order) or ``tokens:N`` (the windows
packed to at most N padded positions a batch by the job's own
:func:`~embgeom_ray.inputs.windows.plan_batches`, over the whole corpus). The *allocator* is
glibc's default or :func:`~embgeom_ray.inputs.malloc_tuning.reuse_freed_memory` (what the job's
CPU extractors set); it is process-wide, so each (threads, allocator) pair runs in a process
of its own, which times every batching alternately, and the processes alternate too. *Lanes*
K run K batches at once, the threads shared out (:mod:`embgeom_ray.inputs.lanes`, as the
job's CPU extractors do; K > threads is not tried).

    python -m bench.bare_forward --corpus c.jsonl [--model minilm] [--batchings rows:64,tokens:2048]
        [--threads 2] [--lanes 1,2] [--allocator default,reuse] [--repeats 2]

prints the sweep's table and the best configuration; :func:`best_bare_forward` and
:func:`timed_bare_forward` are what ``bench.end_to_end`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, median

#: the batchings a sweep tries by default: the 64-window batches of the first comparisons, and
#: the job's token-packed batches at the sizes it picks on CPUs and GPUs
BATCHINGS = ("rows:64", "tokens:1024", "tokens:2048", "tokens:4096", "tokens:5120", "tokens:8192")
ALLOCATORS = ("default", "reuse")


def corpus_windows(tokenizer, corpus: str, max_length: int) -> list:
    """Every window of ``corpus`` (all its shards), as the job cuts them."""
    from embgeom_ray.inputs.corpus import CorpusSpec, ReadReport, plan_shards, read_shard
    from embgeom_ray.inputs.windows import tokenize_windows

    spec = CorpusSpec(corpus)
    windows = []
    for shard in plan_shards(spec, 1 << 40).shards:
        docs = list(read_shard(shard, spec, ReadReport()))
        windows += tokenize_windows(
            tokenizer, [d.doc_id for d in docs], [d.text for d in docs], max_length
        )
    return windows


def batches(windows: list, batching: str, pad_id: int) -> list[tuple[Any, Any]]:
    """``windows`` as right-padded (input_ids, attention_mask) batches under ``batching``."""
    import torch

    from embgeom_ray.inputs.windows import plan_batches

    kind, _, size = batching.partition(":")
    lengths = [len(w.input_ids) for w in windows]
    if kind == "rows":
        order = sorted(range(len(windows)), key=lambda i: (lengths[i], i))
        plan = [order[s : s + int(size)] for s in range(0, len(order), int(size))]
    elif kind == "tokens":
        plan = plan_batches(lengths, batch_tokens=int(size))
    else:
        raise ValueError(f"a batching is rows:R or tokens:N, got {batching!r}")
    out = []
    for members in plan:
        width = max(lengths[i] for i in members)
        ids = torch.full((len(members), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(members), width), dtype=torch.long)
        for r, i in enumerate(members):
            ids[r, : lengths[i]] = torch.tensor(windows[i].input_ids)
            mask[r, : lengths[i]] = 1
        out.append((ids, mask))
    return out


def run(model, plan: list[tuple[Any, Any]], lanes: int = 1) -> None:
    """The forward over ``plan``'s batches, in ``lanes`` lanes as a CPU extractor runs them
    (:mod:`embgeom_ray.inputs.lanes`: the batches at once, the torch threads shared out)."""
    import torch

    from embgeom_ray.inputs.lanes import in_lanes

    def forward(batch: tuple[Any, Any]) -> None:
        ids, mask = batch
        model(input_ids=ids, attention_mask=mask, output_hidden_states=True)

    with torch.inference_mode():
        in_lanes(plan, forward, lambda *_: None, lanes)


def load(model_dir: str, threads: int, allocator: str):
    """(tokenizer, model) in this process, with ``threads`` torch threads and ``allocator``."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    if allocator == "reuse":
        from embgeom_ray.inputs.malloc_tuning import reuse_freed_memory

        reuse_freed_memory()
    elif allocator != "default":
        raise ValueError(f"the allocator is default or reuse, got {allocator!r}")
    torch.set_num_threads(threads)
    return AutoTokenizer.from_pretrained(model_dir), AutoModel.from_pretrained(model_dir).eval()


def sweep_here(
    model_dir: str, corpus: str, max_length: int, batchings: list[str], threads: int,
    allocator: str, repeats: int, lanes: tuple[int, ...] = (1,),
) -> dict[str, Any]:  # fmt: skip
    """In this process: the forward over ``corpus`` under each batching and lane count
    (``"B lanes:K"``), alternately, ``repeats`` times (tokenisation outside the clock: it is
    the same for all); real positions (special tokens included) a second, per configuration."""
    tok, model = load(model_dir, threads, allocator)
    windows = corpus_windows(tok, corpus, max_length)
    positions = sum(len(w.input_ids) for w in windows)
    plans = {b: batches(windows, b, tok.pad_token_id or 0) for b in batchings}
    run(model, plans[batchings[0]][:2])  # warm-up
    configs = [(b, k) for b in batchings for k in lanes]
    keys = {c: f"{c[0]} lanes:{c[1]}" for c in configs}
    rates: dict[str, list[float]] = {keys[c]: [] for c in configs}
    kernel: dict[str, list[float]] = {keys[c]: [] for c in configs}
    faults: dict[str, list[float]] = {keys[c]: [] for c in configs}
    for _ in range(repeats):
        for b, k in configs:
            key = keys[(b, k)]
            u0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            run(model, plans[b], k)
            t, u1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
            rates[key].append(positions / t)
            kernel[key].append(1e6 * (u1.ru_stime - u0.ru_stime) / positions)
            faults[key].append((u1.ru_minflt - u0.ru_minflt) / positions)
    padding = {b: sum(ids.numel() for ids, _ in plans[b]) / positions for b in batchings}
    return {
        "positions": positions,
        "rates": rates,
        "padding": padding,
        # the kernel's CPU time (µs) and the minor page faults, a position
        "kernel_us": kernel,
        "faults": faults,
    }


def timed_here(
    model_dir: str, corpus: str, max_length: int, batching: str, threads: int, allocator: str,
    lanes: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """In this process: tokenise ``corpus``, sort its windows, run them under ``batching``;
    the clock covers tokenising and the forward (what a user's bare forward costs)."""
    import torch

    tok, model = load(model_dir, threads, allocator)
    run(model, [(torch.ones((2, 16), dtype=torch.long), torch.ones((2, 16), dtype=torch.long))])
    t0 = time.perf_counter()
    windows = corpus_windows(tok, corpus, max_length)
    plan = batches(windows, batching, tok.pad_token_id or 0)
    run(model, plan, lanes)
    seconds = time.perf_counter() - t0
    special = set(tok.all_special_ids)
    tokens = sum(1 for w in windows for i in w.input_ids if i not in special)
    positions = sum(len(w.input_ids) for w in windows)
    padded = sum(ids.numel() for ids, _ in plan)
    return {"seconds": seconds, "tokens": tokens, "padding": padded / positions}


def in_subprocess(*args: str) -> dict[str, Any]:
    """``python -m bench.bare_forward ARGS`` in a fresh process; its JSON result."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-m", "bench.bare_forward", *args, "--json"],
        cwd=REPO, env=env, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def best_bare_forward(
    model_dir: str, corpus: str, max_length: int, batchings: list[str], threads: list[int],
    allocators: list[str], repeats: int = 2, rounds: int = 2, lanes: tuple[int, ...] = (1,),
) -> dict[str, Any]:  # fmt: skip
    """The fastest bare forward over ``corpus``: every (threads, allocator) pair in a process
    of its own, ``rounds`` times in turn, each process timing every batching and lane count
    ``repeats`` times alternately; the best configuration is the highest median rate. Returns
    the table (positions a second per configuration, all runs) and the best one."""
    table: dict[str, list[float]] = {}
    kernel: dict[str, list[float]] = {}
    faults: dict[str, list[float]] = {}
    padding: dict[str, float] = {}
    for _ in range(rounds):
        for n in threads:
            for allocator in allocators:
                res = in_subprocess(
                    "--model-dir", model_dir, "--corpus", corpus, "--max-length", str(max_length),
                    "--batchings", ",".join(batchings), "--threads", str(n),
                    "--allocator", allocator, "--repeats", str(repeats),
                    "--lanes", ",".join(str(k) for k in lanes if k <= n),
                )  # fmt: skip
                for key, rates in res["rates"].items():
                    config = f"{key} threads:{n} {allocator}"
                    table.setdefault(config, []).extend(rates)
                    kernel.setdefault(config, []).extend(res["kernel_us"][key])
                    faults.setdefault(config, []).extend(res["faults"][key])
                padding.update(res["padding"])
    best = max(table, key=lambda k: median(table[k]))
    batching, lanes_s, threads_s, allocator = best.split(" ")
    return {
        "positions_per_s": table,
        "kernel_us_per_position": kernel,
        "faults_per_position": faults,
        "padding": padding,
        "best": {
            "batching": batching,
            "lanes": int(lanes_s.split(":")[1]),
            "threads": int(threads_s.split(":")[1]),
            "allocator": allocator,
            "positions_per_s": median(table[best]),
        },
    }


def print_sweep(res: dict[str, Any]) -> None:
    """One line per configuration: its rates, their median, the kernel's µs and the page
    faults a position (medians)."""
    for config, rates in res["positions_per_s"].items():
        print(
            f"{config:34s} " + " ".join(f"{r:7,.0f}" for r in rates)
            + f"  median {median(rates):7,.0f} pos/s, kernel "
            f"{median(res['kernel_us_per_position'][config]):5.1f} µs, "
            f"{median(res['faults_per_position'][config]):5.2f} faults a position"
        )  # fmt: skip
    print(f"best: {res['best']}")


def timed_bare_forward(model_dir: str, corpus: str, max_length: int, best: dict) -> dict:
    """:func:`timed_here` in a fresh process, under the configuration ``best``
    (:func:`best_bare_forward`'s)."""
    return in_subprocess(
        "--model-dir", model_dir, "--corpus", corpus, "--max-length", str(max_length),
        "--batchings", best["batching"], "--threads", str(best["threads"]),
        "--allocator", best["allocator"], "--lanes", str(best.get("lanes", 1)), "--timed",
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--model", default="minilm", choices=["minilm", "bert-base"])
    p.add_argument("--model-dir", default=None, help="a model directory (instead of --model)")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batchings", default=",".join(BATCHINGS))
    p.add_argument("--threads", default=str(os.cpu_count() or 1), help="torch threads, a list")
    p.add_argument("--allocator", default=",".join(ALLOCATORS), help="default, reuse, or both")
    p.add_argument("--lanes", default=f"1,{os.cpu_count() or 1}", help="lane counts, a list")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timed", action="store_true", help="one timed run (tokenising included)")
    p.add_argument("--json", action="store_true", help="one configuration here, JSON out")
    args = p.parse_args(argv)
    from bench.common import minilm_dir, random_bert_dir

    model_dir = args.model_dir or (
        minilm_dir() if args.model == "minilm" else random_bert_dir(Path("/tmp/embgeom-bert-base"))
    )
    batchings = args.batchings.split(",")
    lanes = tuple(sorted({max(1, int(k)) for k in args.lanes.split(",")}))
    if args.json:  # one process's share of a sweep, or one timed run
        threads, allocator = int(args.threads), args.allocator
        if args.timed:
            out = timed_here(
                model_dir, args.corpus, args.max_length, batchings[0], threads, allocator, lanes[0]
            )
        else:
            out = sweep_here(
                model_dir, args.corpus, args.max_length, batchings, threads, allocator,
                args.repeats, lanes,
            )  # fmt: skip
        print(json.dumps(out))
        return
    res = best_bare_forward(
        model_dir, args.corpus, args.max_length, batchings,
        [int(t) for t in args.threads.split(",")], args.allocator.split(","),
        args.repeats, args.rounds, lanes,
    )  # fmt: skip
    print_sweep(res)
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
