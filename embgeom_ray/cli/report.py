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

from embgeom_ray.cli import configure_logging, exit_process, exit_status

PROG = "embgeom report"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[1])
    p.add_argument("out_dir", metavar="OUT_DIR", help="output directory of a jobs.analyze run")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return p


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    configure_logging(args.verbose)

    def run() -> None:
        from embgeom_ray.report.html import write_report

        print(write_report(args.out_dir))

    return exit_status(run)


if __name__ == "__main__":
    exit_process(main())
