"""``python -m jobs.reanalyze``: ``embgeom reanalyze`` (:mod:`embgeom_ray.cli.reanalyze`) under the name a checkout
gives it, which ``ray job submit --working-dir .`` and the deploy manifests run."""

from embgeom_ray.cli import exit_process
from embgeom_ray.cli.reanalyze import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    exit_process(main(prog="python -m jobs.reanalyze"))
