"""``python -m jobs.reanalyze``: ``embgeom reanalyze`` (:mod:`embgeom_ray.cli.reanalyze`) under the name a checkout
gives it, which ``ray job submit --working-dir .`` and the deploy manifests run."""

import sys

from embgeom_ray.cli.reanalyze import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main(prog="python -m jobs.reanalyze"))
