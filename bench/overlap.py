"""Would folding batch i while the model runs batch i + 1 hide the fold on a CPU? Measured.

Over the same batches of one shard (the demo prose, MiniLM, the extractor's own batching),
alternately ``--repeats`` times in one process:

  (a) bare: the forward alone, hidden states discarded;
  (b) sequential: forward, then fold into the statistics and the sample (what an extractor
      of one lane does: :meth:`~embgeom_ray.inputs.extractor.ShardProcessor.fold_batch`; the
      job's CPU extractors run one lane a CPU, :mod:`embgeom_ray.inputs.lanes`, measured by
      ``bench.extraction``);
  (c) overlapped: the fold of batch i in a second thread while the main thread runs the forward
      of batch i + 1 (at most one fold pending; folds in batch order, so the same state).

Printed: median seconds, the bare forward's throughput as a fraction of (b)'s and (c)'s, and
whether (b) and (c) end in the same statistics (they must: same folds, same order). Also the
forward alone at 1 and at ``--threads`` threads, i.e. how much of the cores the forward leaves
idle, which is all that overlapping could use. Torch's thread count is per process, so the two
threads of (c) share ``--threads`` threads.

    python -m bench.overlap [--repeats 3] [--threads 2] [--copies 1] [--max-batches N]
        [--batch-tokens N]
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from itertools import islice

import torch

from bench.common import alternate, english_jsonl, median, minilm_dir, save, timed, work_dir
from bench.fold import same_state


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--copies", type=int, default=1, help="the demo prose, this many times")
    p.add_argument("--max-batches", type=int, default=0, help="use only the first N (0: all)")
    p.add_argument(
        "--batch-tokens",
        type=int,
        default=None,
        help="padded tokens per batch (default: the job's)",
    )
    p.add_argument("--name", default="overlap")
    args = p.parse_args(argv)

    from embgeom_ray.config import build_config
    from embgeom_ray.core.sketch import finite_layers
    from embgeom_ray.counts import Counts
    from embgeom_ray.inputs.corpus import CorpusSpec, ReadReport, plan_shards, read_shard
    from embgeom_ray.inputs.extractor import ShardProcessor
    from embgeom_ray.inputs.model_loading import resolve_identity, resolve_layers

    with work_dir("overlap") as work:
        corpus = english_jsonl(work / "corpus.jsonl", repeat=args.copies)
        model = minilm_dir()
        identity, _ = resolve_identity(model, None, False)
        layers = resolve_layers(None, identity.num_layers)
        cfg = build_config(
            None,
            {
                "model": model,
                "corpus": corpus,
                "out": str(work / "unused"),
                "batch_tokens": args.batch_tokens,
            },
        )
        proc = ShardProcessor(cfg.extraction, layers, {"model_fingerprint": "bench"})
        shard = plan_shards(CorpusSpec(corpus), 1 << 40).shards[0]
        batches = list(  # the first --max-batches batches only, without batching the rest
            islice(
                proc.batches(read_shard(shard, proc.corpus, ReadReport()), Counts()),
                args.max_batches or None,
            )
        )
        tokens = sum(b.num_tokens for b in batches)

        @torch.inference_mode()
        def fold(stats, sample, hidden, batch) -> None:
            finite = finite_layers(hidden)
            stats.update(hidden, batch.input_ids, batch.keep, finite=finite)
            if sample is not None:
                sample.update(
                    hidden, batch.input_ids, batch.keep, batch.doc_ids, batch.window_index,
                    finite=finite,
                )  # fmt: skip

        @torch.inference_mode()
        def bare() -> None:
            for b in batches:
                proc.forward(b)

        @torch.inference_mode()
        def sequential():
            stats, sample = proc.new_statistics(), proc.new_sample()
            for b in batches:
                fold(stats, sample, proc.forward(b), b)
            return stats

        @torch.inference_mode()
        def overlapped():
            stats, sample = proc.new_statistics(), proc.new_sample()
            with ThreadPoolExecutor(max_workers=1) as folder:
                pending = None
                for b in batches:
                    hidden = proc.forward(b)
                    if pending is not None:
                        pending.result()
                    pending = folder.submit(fold, stats, sample, hidden, b)
                if pending is not None:
                    pending.result()
            return stats

        torch.set_num_threads(1)
        t_one, _ = timed(bare)
        torch.set_num_threads(args.threads)
        bare()  # warm-up at the measured thread count
        t_many, _ = timed(bare)
        runs = {"bare": bare, "sequential": sequential, "overlapped": overlapped}
        times, states = alternate(runs, args.repeats)
        med = {name: median(ts) for name, ts in times.items()}
        same = same_state(states["overlapped"], states["sequential"])
        ratio = {name: med["bare"] / med[name] for name in ("sequential", "overlapped")}
        print(
            f"{tokens:,} tokens in {len(batches)} batches | forward at 1 thread {t_one:.2f} s, at "
            f"{args.threads} {t_many:.2f} s (x{t_one / t_many:.2f}) | bare {med['bare']:.2f} s, "
            f"sequential {med['sequential']:.2f} s ({ratio['sequential']:.3f} of bare), overlapped "
            f"{med['overlapped']:.2f} s ({ratio['overlapped']:.3f}) | same state: {same['same']} "
            f"(max rel diff {same['max_rel_diff']:.1e})"
        )
        save(
            args.name,
            {
                "command": "python -m bench.overlap",
                "args": vars(args),
                "tokens": tokens,
                "batches": len(batches),
                "forward_1_thread_s": t_one,
                "forward_threads_s": t_many,
                "seconds": times,
                "median_s": med,
                "ratio_to_bare": ratio,
                "state": same,
            },
        )


if __name__ == "__main__":
    main()
