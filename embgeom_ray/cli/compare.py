"""``embgeom compare RUN_A RUN_B [RUN ...] --out DIR [--labels a,b,...]``
(in a checkout, for ``ray job submit``: ``python -m jobs.compare``; anywhere: ``python -m
embgeom_ray compare``).

Compares complete runs of jobs.analyze layer by layer against the first (the baseline): every
per-layer metric side by side, the largest changes, and the rogue dimensions that appeared or
vanished. Exact and sampled changes are listed apart; changes of sampled metrics are ranked
by z = change / its standard error (from the runs' half-sample *_se columns), |z| < 2 being
within noise, under a line saying how many were tested and how many chance alone would put
beyond noise; one warning line says when the runs differ more than 10x in tokens or one has
fewer tokens than the sample size. DIR gets comparison.parquet (long: run, label, layer, depth,
metric, value), comparison_wide.parquet (one column per run), changes.parquet,
rogue_dims.parquet, comparison.json (summary) and report.html with its plot (see
embgeom_ray/runs/compare.py).

Layers are matched by index when the models have the same number of blocks, otherwise by
relative depth (and the output says so).
Exit status: 0 done, 2 a problem with the input (one-line message), 130 or 143 interrupted
(Ctrl-C, SIGTERM), 1 an internal error.
"""

from __future__ import annotations

import argparse

from embgeom_ray.cli import exit_process, exit_status

PROG = "embgeom compare"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[1],
        epilog=__doc__.split("\n\n")[2],
    )
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="output directories of complete runs; first = baseline",
    )
    p.add_argument("--out", required=True, help="output directory of the comparison")
    p.add_argument(
        "--labels",
        help="names of the runs in tables and plots, comma-separated, one per run "
        "[default: each run directory's name]",
    )
    p.add_argument(
        "--top",
        type=int,
        default=20,
        help="largest changes of each list (exact, sampled, not comparable) in comparison.json "
        "and the report [default: 20]; changes.parquet has all",
    )
    return p


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)

    def run() -> None:
        from embgeom_ray.runs.compare import CompareError, compare_runs

        if len(args.runs) < 2:
            raise CompareError(f"a comparison needs at least two runs, got {len(args.runs)}")
        if args.top < 1:
            raise CompareError(f"--top must be at least 1, got {args.top}")
        labels = args.labels.split(",") if args.labels is not None else None
        compare_runs(args.runs, args.out, labels=labels, top=args.top)

    return exit_status(run)


if __name__ == "__main__":
    exit_process(main())
