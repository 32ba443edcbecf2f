"""Entry point: ``python -m jobs.merge --out DIR RUN_A RUN_B [RUN ...]``.

Merges complete runs of the same model over disjoint corpora into the run over their union:
DIR gets the statistics, sample, tables and manifest that one ``jobs.analyze`` run over all the
corpora would have written (see :mod:`embgeom_ray.runs.merge`).

The runs must be complete and measure the same thing: same model and tokenizer (content
fingerprints), same layers, max_length, dtype, special-token option and clip dims. Two runs
over the same corpus are refused, since every token would be counted twice; corpora that
merely overlap cannot be detected and are the caller's responsibility (except between
``--dedup`` runs: runs that share a document, by the keys in their ``doc_hashes.npy``, are
refused with the number shared, and a ``--dedup`` run does not merge with a run without it). A
merged run can itself be merged.
Exit status: 0 done, 2 a problem with the input (one-line message), 1 an internal error.
"""

from __future__ import annotations

import argparse
import sys

from embgeom_ray.errors import UserError
from embgeom_ray.runs.merge import merge_runs


def _byte_size(text: str) -> int:
    """``16GiB``, ``500MB``, ``1048576``: bytes (pydantic's ByteSize, as the job's options)."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 16GiB)") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jobs.merge",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="output directories of complete runs")
    p.add_argument("--out", required=True, help="output directory of the merged run")
    p.add_argument(
        "--min-count",
        type=int,
        help="minimum occurrences of a type in norm_variance_corr [default: the first run's]",
    )
    p.add_argument(
        "--tokenizer",
        help="where to load the tokenizer that names token ids [default: the first run's model]",
    )
    p.add_argument(
        "--reducers",
        type=int,
        default=1,
        help="reducer actors merging the statistics partition by partition (token ranges and "
        "layers), so no process holds them whole; 1 merges in this process [default: 1]",
    )
    p.add_argument(
        "--reducer-memory",
        type=_byte_size,
        help="bytes each reducer actor may hold (e.g. 16GiB): merge on as many reducers as "
        "that takes, at least --reducers [default: no bound]",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        merge_runs(
            args.runs,
            args.out,
            min_count=args.min_count,
            tokenizer=args.tokenizer,
            overwrite=args.overwrite,
            reducers=args.reducers,
            reducer_memory=args.reducer_memory,
        )
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
