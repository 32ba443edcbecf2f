"""``embgeom report OUT_DIR`` (re)builds the plots and report of a run
(in a checkout, for ``ray job submit``: ``python -m jobs.report``; anywhere: ``python -m
embgeom_ray report``).

Draws every figure into ``OUT_DIR/plots/`` and writes the self-contained ``OUT_DIR/report.html``
for the output directory of an earlier ``python -m jobs.analyze`` run, then prints the report's
path. Exit status: 0 done, 2 OUT_DIR is not a run directory (one-line message), 1 an internal
error (with traceback).
"""

from __future__ import annotations

import argparse
import sys

from embgeom_ray.cli import configure_logging, exit_process
from embgeom_ray.errors import UserError

PROG = "embgeom report"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[1])
    p.add_argument("out_dir", metavar="OUT_DIR", help="output directory of a jobs.analyze run")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return p


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    configure_logging(args.verbose)
    try:
        from embgeom_ray.report.html import write_report

        path = write_report(args.out_dir)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(path)
    return 0


if __name__ == "__main__":
    exit_process(main())
