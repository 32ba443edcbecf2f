"""Extraction cost: the extractor (tokenise, forward, fold) against a bare forward pass.

For each model, the same shard is processed alternately by
  (a) the bare forward: tokenise + the same length-bucketed batches + ``model(...,
      output_hidden_states=True)``, hidden states discarded;
  (b) the extractor: :meth:`ShardProcessor.process` (tokenise, forward, fold every layer into
      the float64 statistics, plus the activation sample) — as configured by default, without
      the sample, and with ``comoment_precision="float64"``,
same dtype, same threads, same process, ``--repeats`` times; the printed ratio is
median(bare) / median(extractor) — the extractor's throughput as a fraction of the forward's.
On a GPU each extractor first processes the shard once untimed (its fold compiles kernels on
first use, tens of seconds for the int8 product's).
The bare forward also runs at each batch size of ``--bare-batch-tokens`` (alternated with the
rest): the extractor is compared with the fastest of them too, since its own batch size need
not be the forward's best. On a CPU the process's allocator is tuned as the job's extractors
tune theirs (:func:`~embgeom_ray.inputs.malloc_tuning.reuse_freed_memory`).

``--device-map`` adds the ``--gpus-per-worker`` path on the GPUs this process sees, one GPU
included: the model loaded through accelerate's device map (:func:`balanced_device_map`, its
dispatch hooks), every layer folded on the GPU that computed it into one statistics part per
GPU (``SplitStatistics``), combined at the end; its statistics are compared with the plain
extractor's (counts exactly, moments to rounding). Give ``--batch-tokens``: a split model
otherwise gets 8,192 tokens a batch.

    python -m bench.extraction [--models minilm,bert-base] [--tokens 20000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from pathlib import Path
from unittest import mock

import torch

from bench.common import english_jsonl, median, minilm_dir, random_bert_dir, save, timed, work_dir


def bare_forward(proc, shard, batch_tokens: int | None = None, lanes: int = 1) -> int:
    """Tokenise and batch as the extractor does (at ``batch_tokens`` padded tokens a batch,
    default the extractor's own), run the model, discard the output; in ``lanes`` lanes as
    the extractor's (:mod:`embgeom_ray.inputs.lanes`: the batches at once, one intra-op
    thread each)."""
    from embgeom_ray.counts import Counts
    from embgeom_ray.inputs.corpus import ReadReport, read_shard
    from embgeom_ray.inputs.lanes import in_lanes

    counts = Counts()
    tokens = 0

    def count(batch, _) -> None:
        nonlocal tokens
        tokens += batch.num_tokens

    own, proc.batch_tokens = proc.batch_tokens, batch_tokens or proc.batch_tokens
    try:
        with torch.inference_mode():
            docs = read_shard(shard, proc.corpus, ReadReport())
            in_lanes(proc.batches(docs, counts), proc.forward, count, lanes)
    finally:
        proc.batch_tokens = own
    if proc.device == "cuda":
        torch.cuda.synchronize()  # the clock stops when the device has finished
    return tokens


def device_map_over_visible_gpus(options, device: str) -> dict[str, int]:
    """``gpu_device_map`` over every GPU this process sees, even one (where the job maps a
    model only for ``--gpus-per-worker`` ≥ 2)."""
    from embgeom_ray.inputs.extractor import device_map_over_gpus

    return device_map_over_gpus(options, torch.cuda.device_count())


def bench_model(name: str, model: str, corpus: str, args, workdir: Path) -> dict:
    from bench.fold import same_state
    from embgeom_ray.config import build_config
    from embgeom_ray.core.statistics import EmbeddingStatistics
    from embgeom_ray.inputs import extractor
    from embgeom_ray.inputs.corpus import CorpusSpec, plan_shards
    from embgeom_ray.inputs.extractor import ShardProcessor
    from embgeom_ray.inputs.model_loading import resolve_identity, resolve_layers

    identity, _ = resolve_identity(model, None, False)
    layers = resolve_layers(None, identity.num_layers)
    variants = {
        "extractor": {"sample_size": args.sample_size},
        "extractor_one_lane": {"sample_size": args.sample_size, "cpu_lanes": 1},
        "extractor_no_sample": {"sample_size": 0},
        "extractor_f64_comoment": {
            "sample_size": args.sample_size,
            "comoment_precision": "float64",
        },
    }
    if args.device_map:
        variants["extractor_device_map"] = {"sample_size": args.sample_size}
    procs = {}
    for variant, overrides in variants.items():
        cfg = build_config(
            None,
            {
                "model": model,
                "corpus": corpus,
                "out": str(workdir / "unused"),
                "max_length": args.max_length,
                "batch_tokens": args.batch_tokens,
                "device": args.device,
                "dtype": args.dtype,
                **overrides,
            },
        )
        mapped = variant == "extractor_device_map"
        patch = (
            mock.patch.object(extractor, "gpu_device_map", device_map_over_visible_gpus)
            if mapped
            else contextlib.nullcontext()
        )
        with patch:
            procs[variant] = ShardProcessor(cfg.extraction, layers, {"model_fingerprint": "bench"})
        if mapped:
            assert procs[variant].device_map is not None
    shard = plan_shards(CorpusSpec(corpus), 1 << 40).shards[0]
    base = procs["extractor"]
    bare_forward(base, shard)  # warm-up
    if torch.device(base.device).type != "cpu":  # a GPU's fold compiles its kernels once
        for proc in procs.values():
            proc.process(shard)
    # the bare forward at the extractor's batch size, and at each other one tried
    others = [b for b in args.bare_batch_tokens if b != base.batch_tokens]
    # (batch tokens, lanes): the extractor's batch in one lane, and in its lanes
    bares = {"bare_forward": (None, 1), **{f"bare_forward_{b}": (b, 1) for b in others}}
    if base.lanes() > 1:
        bares["bare_forward_lanes"] = (None, base.lanes())
    times: dict[str, list[float]] = {**{k: [] for k in bares}, **{v: [] for v in variants}}
    tokens = 0
    folds: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for key, (size, lanes) in bares.items():
            t, tokens = timed(lambda size=size, lanes=lanes: bare_forward(base, shard, size, lanes))
            times[key].append(t)
        for variant, proc in procs.items():
            t, (_, _, counts) = timed(lambda proc=proc: proc.process(shard))
            times[variant].append(t)
            folds[variant].append(counts.fold_seconds)
    bare = median(times["bare_forward"])
    best_bare = min(bares, key=lambda k: median(times[k]))
    best = median(times[best_bare])
    same = None
    if args.device_map:  # the split fold against the plain one, over the same shard
        plain, _, _ = procs["extractor"].process(shard)
        split, _, _ = procs["extractor_device_map"].process(shard)
        same = same_state(EmbeddingStatistics.from_bytes(split.to_bytes()), plain)
        print(f"{name}: device-map statistics against the plain extractor's: {same}")
    result = {
        "model": name,
        "layers": len(layers),
        "hidden_size": identity.hidden_size,
        "tokens": tokens,
        "dtype": args.dtype,
        "device": base.device,
        "batch_tokens": base.batch_tokens,
        "seconds": {k: median(v) for k, v in times.items()},
        "fold_seconds": {k: median(v) for k, v in folds.items()},
        "tokens_per_s": {k: tokens / median(v) for k, v in times.items()},
        "ratio_to_bare_forward": {v: bare / median(times[v]) for v in variants},
        # against the fastest bare forward over the same shard, whatever its batch size
        "lanes": base.lanes(),
        "bare_forward_best": {
            "batch_tokens": bares[best_bare][0] or base.batch_tokens,
            "lanes": bares[best_bare][1],
            "seconds": best,
        },
        "ratio_to_best_bare_forward": {v: best / median(times[v]) for v in variants},
        **({} if same is None else {"device_map_state": same}),
    }
    print(
        f"{name:10s} L+1={len(layers):2d} d={identity.hidden_size:4d} tokens={tokens:,} "
        f"batches of {base.batch_tokens:,} "
        f"bare {tokens / bare:8,.0f} tok/s, best bare {tokens / best:8,.0f} tok/s at "
        f"{bares[best_bare][0] or base.batch_tokens:,} in {bares[best_bare][1]} lane(s) | "
        + " | ".join(
            f"{v} {tokens / median(times[v]):8,.0f} tok/s ratio {bare / median(times[v]):.3f} "
            f"(to the best bare {best / median(times[v]):.3f})"
            for v in variants
        )
    )
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="minilm,bert-base")
    p.add_argument("--tokens", type=int, default=20_000, help="approximate tokens per shard")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument(
        "--batch-tokens", type=int, default=None,
        help="default: the job's (on a CPU from the model's shape, 1,024-8,192; more on GPUs)",
    )
    p.add_argument(
        "--bare-batch-tokens", default="1024,2048,4096,5120,8192",
        help="the bare forward's batch sizes tried besides the extractor's (the best is kept)",
    )  # fmt: skip
    p.add_argument("--sample-size", type=int, default=4096)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--device-map", action="store_true",
        help="also the --gpus-per-worker path (accelerate's device map, split statistics)",
    )  # fmt: skip
    p.add_argument("--name", default="extraction")
    args = p.parse_args(argv)
    args.bare_batch_tokens = [int(b) for b in args.bare_batch_tokens.split(",") if b]
    if args.threads:
        torch.set_num_threads(args.threads)
    from embgeom_ray.inputs.extractor import resolve_device
    from embgeom_ray.inputs.malloc_tuning import reuse_freed_memory

    if resolve_device(args.device) == "cpu":
        reuse_freed_memory()  # as the job's CPU extractors do
    with work_dir("extraction") as work:
        corpus_full = english_jsonl(work / "full.jsonl")
        # a shard of about --tokens tokens: the first documents of the demo corpus
        lines = Path(corpus_full).read_text().splitlines(keepends=True)
        corpus = work / "shard.jsonl"
        chars = 0
        with corpus.open("w") as f:  # the documents again from the first if they run out
            for line in itertools.cycle(lines):
                f.write(line)
                chars += len(line)
                if chars > args.tokens * 5:  # ~5 characters per token in this prose
                    break
        models = {"minilm": minilm_dir, "bert-base": lambda: random_bert_dir(work / "bert-base")}
        results = [
            bench_model(m, models[m](), str(corpus), args, work) for m in args.models.split(",")
        ]
        save(
            args.name,
            {"command": "python -m bench.extraction", "args": vars(args), "results": results},
        )


if __name__ == "__main__":
    main()
