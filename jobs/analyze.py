"""Entry point: ``python -m jobs.analyze --model M --corpus C --out DIR [options]``.

Measures the geometry of M's contextual embeddings over corpus C, layer by layer and token
type by token type, and writes the tables, the statistics artefact and manifest.json to DIR.
Without a running cluster it starts a local Ray; under ``ray job submit`` or with RAY_ADDRESS
it joins that cluster. Exit status: 0 done, 2 a problem with the input (one-line message),
1 an internal error (with traceback).
"""

from __future__ import annotations

import argparse
import logging
import sys

from embgeom_ray.config import build_config
from embgeom_ray.errors import UserError


def parse_layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"layers must be integers separated by commas, e.g. 0,3,-1 (got {text!r})"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jobs.analyze",
        description=__doc__.split("\n\n")[1],
    )
    a = p.add_argument
    a("--config", help="YAML file of options (keys as below, with underscores); flags override it")
    a("--model", help="local HF model directory or hub id (required)")
    a("--revision", help="hub revision: branch, tag or commit hash")
    a(
        "--corpus",
        help="a .txt/.jsonl/.parquet file, a glob, a directory, an fsspec URL (s3://, gs://) or hf:NAME[:CONFIG] (required)",
    )
    a("--out", help="output directory, local or fsspec URL (required)")
    a("--text-column", help="text column of .jsonl/.parquet/HF corpora [default: text]")
    a("--split", help="split of an HF dataset [default: train]")
    a(
        "--max-length",
        type=int,
        help="tokens per window, special tokens included; longer documents are split into consecutive windows [default: 128]",
    )
    a(
        "--layers",
        type=parse_layers,
        help="hidden-state layers to measure, e.g. 0,3,-1 (0 = embedding output, -1 = last) [default: all]",
    )
    a(
        "--num-workers",
        type=int,
        help="extractor actors [default: one per GPU, else CPUs // cpus-per-worker]",
    )
    a(
        "--cpus-per-worker",
        type=int,
        help="CPUs (torch threads) per extractor actor [default: 1 with a GPU, else min(4, CPUs)]",
    )
    a("--batch-tokens", type=int, help="padded tokens per forward batch [default: 8192]")
    a(
        "--docs-per-chunk",
        type=int,
        help="documents tokenized at a time per actor (bounds memory) [default: 512]",
    )
    a(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="dtype the model runs in; statistics are float64 regardless [default: float32]",
    )
    a("--device", choices=["auto", "cpu", "cuda"], help="device of the extractors [default: auto]")
    a(
        "--keep-special",
        action="store_true",
        default=None,
        help="count special tokens ([CLS], [SEP], BOS, …) too [default: excluded]",
    )
    a(
        "--min-count",
        type=int,
        help="minimum occurrences for a type to enter norm_variance_corr [default: 5]",
    )
    a(
        "--shard-bytes",
        type=int,
        help="bytes of corpus text per shard [default: derived from the corpus size]",
    )
    a(
        "--trust-remote-code",
        action="store_true",
        default=None,
        help="allow model code from the hub (off unless given)",
    )
    a(
        "--overwrite",
        action="store_true",
        default=None,
        help="discard an earlier run in --out instead of resuming it",
    )
    a(
        "--max-shard-retries",
        type=int,
        help="times a shard is retried after losing its worker [default: 3]",
    )
    a(
        "--checkpoint-interval",
        type=float,
        help="seconds of work an extractor accumulates over several shards before they are checkpointed together (at most this much work per worker is redone after a failure); 0 checkpoints every shard on its own [default: 300]",
    )
    a(
        "--outlier-mean-z",
        type=float,
        help="flag a dimension whose mean's z-score among the layer's dimensions exceeds this [default: 3]",
    )
    a(
        "--outlier-variance-ratio",
        type=float,
        help="flag a dimension whose variance is at least this times the mean variance [default: 5]",
    )
    a(
        "--outlier-tail-share",
        type=float,
        help="flag a dimension that is the argmax or argmin of at least this share of tokens [default: 0.25]",
    )
    a(
        "--clip-dims",
        type=parse_layers,
        help="dimensions to zero for exact clipped cosine metrics over the whole corpus, e.g. 12,300",
    )
    a(
        "--clip-dims-from",
        help="take --clip-dims from an earlier run's output: every dimension flagged in its dims.parquet",
    )
    a(
        "--comoment-precision",
        choices=["float64", "float32"],
        help="dtype of the per-batch product of the centred rows behind the covariance (IsoScore, PCA spectrum, dims std), accumulated in float64 either way: float32 (~1e-6 relative error on covariance entries) is ~2x faster on CPUs and up to 32x on GPUs with slow float64; float64 for the exact product. Every per-type statistic is float64 regardless [default: float32]",
    )
    a(
        "--sample-size",
        type=int,
        help="token occurrences in the uniform sample (the same in every layer) for K-means, LID, silhouette and sampled cosines; 0 turns sampling off [default: 4096]",
    )
    a(
        "--sample-type-size",
        type=int,
        help="token types in the type-uniform sample (one random occurrence each; Cai's S_inter) [default: --sample-size]",
    )
    a("--sample-seed", type=int, help="seed of the sample's random keys [default: 0]")
    a(
        "--kmeans-k-max",
        type=int,
        help="K-means tries k = 2..this and keeps the best silhouette (Cai et al.) [default: 15]",
    )
    a(
        "--kmeans-min-silhouette",
        type=float,
        help="below this best silhouette, k = 1 (no clusters) [default: 0.1]",
    )
    a("--kmeans-n-init", type=int, help="K-means initialisations per k [default: 3]")
    a(
        "--lid-k",
        type=int,
        help="nearest neighbours of the LID estimate (Levina-Bickel) [default: 20]",
    )
    a(
        "--silhouette-max-points",
        type=int,
        help="points a silhouette is computed on [default: 4096]",
    )
    a("-v", "--verbose", action="store_true", help="log at INFO level")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    overrides = {k: v for k, v in vars(args).items() if k not in {"config", "verbose"}}
    try:
        config = build_config(args.config, overrides)
        from embgeom_ray.runs.pipeline import analyze

        analyze(config)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
