"""``embgeom merge --out DIR RUN_A RUN_B [RUN ...]``
(in a checkout, for ``ray job submit``: ``python -m jobs.merge``; anywhere: ``python -m
embgeom_ray merge``).

Merges complete runs of the same model over disjoint corpora into the run over their union:
DIR gets the statistics, sample, tables and manifest that one ``jobs.analyze`` run over all the
corpora would have written (see :mod:`embgeom_ray.runs.merge`).

The runs must be complete and measure the same thing: same model and tokenizer (content
fingerprints), same layers, max_length, dtype, special-token option and clip dims. Two runs
over the same corpus are refused, since every token would be counted twice; corpora that
merely overlap cannot be detected and are the caller's responsibility (copies of the same
files under the same names are warned of, from the runs' samples; ``--dedup`` runs that
share a document, by the keys in their ``doc_hashes.npy``, are refused with the number
shared, and a ``--dedup`` run does not merge with a run without it). A merged run can itself
be merged. The merge sizes itself from the types the runs hold and the
cluster (in this process while that is small, else on reducer actors); --plan says how.
Exit status: 0 done, 2 a problem with the input (one-line message), 130 or 143 interrupted
(Ctrl-C, SIGTERM), 1 an internal error.
"""

from __future__ import annotations

import argparse

from embgeom_ray.cli import configure_logging, exit_process, exit_status
from embgeom_ray.config import MERGE_OPTIONS, SCHEDULING_OPTIONS
from embgeom_ray.config import build_parser as job_parser
from embgeom_ray.errors import ConfigError
from embgeom_ray.runs.merge import merge_runs

PROG = "embgeom merge"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The command line: the runs, ``--tokenizer``, and the job's options marked for the merge
    (:data:`~embgeom_ray.config.MERGE_OPTIONS`), generated from their fields."""
    parser = job_parser(
        prog,
        (__doc__ or "").split("\n\n")[1],
        options=MERGE_OPTIONS,
        usage=f"{prog} --out DIR RUN RUN [RUN ...] [options]",
        config_file=False,
        # a table option left out is the first run's; the report is drawn unless --no-report
        # is given to the merge itself, whatever the runs' own --no-report
        shown_defaults={
            k: "the first run's"
            for k in MERGE_OPTIONS
            if k not in SCHEDULING_OPTIONS and k != "no_report"
        },
    )
    (plan,) = [a for a in parser._actions if a.dest == "plan"]
    plan.help = (  # the job's says what the analysis plans: shards, actors, batches
        "print how the merge would run and exit, nothing merged or written: the runs, their "
        "layers, d and the types they saw, and where the statistics would be merged (the "
        "job's own process, or reducers: how many, and the memory of each)"
    )
    parser.add_argument("runs", nargs="+", metavar="RUN", help="output directories of complete runs")
    parser.add_argument(
        "--tokenizer",
        help="where to load the tokenizer that names token ids [default: the first run's model]",
    )
    return parser


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    configure_logging(args.verbose)
    options = {k: getattr(args, k) for k in MERGE_OPTIONS if k != "out"}

    def run() -> None:
        if args.out is None:
            raise ConfigError("--out is required")
        merge_runs(args.runs, args.out, tokenizer=args.tokenizer, **options)

    return exit_status(run)

if __name__ == "__main__":
    exit_process(main())
