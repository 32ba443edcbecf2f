"""``embgeom reanalyze --watchlist models.yaml --corpus C --store STORE``
(in a checkout, for ``ray job submit``: ``python -m jobs.reanalyze``; anywhere: ``python -m
embgeom_ray reanalyze``).

Keeps every model of the watch list analysed over corpus C: resolves each model's exact
revision (hub commit hash, or content hash of a local directory), and runs jobs.analyze into
STORE/runs/<model>-<key>/ only where no complete run exists for (model revision, tokenizer,
corpus fingerprint, result options); STORE/runs.parquet indexes every run with its status and
headline metrics. A second invocation with nothing new runs nothing ("up to date"). Made for
cron or a KubeRay schedule (deploy/reanalyze-cronjob.yaml); see embgeom_ray/runs/reanalyze.py.

Exit status: 0 every model is up to date (or was analysed now); 1 at least one model could
not be resolved or its run failed (each reported on stderr; the others were still done, and a
failed run is retried next time); 2 the invocation itself is invalid (watch list, corpus,
--config, store), nothing was run; 75 another invocation is running on the same (local or
S3) store, nothing was run (that one goes on; the next one does what it leaves).
"""

from __future__ import annotations

import argparse
import json
import sys

from embgeom_ray.cli import configure_logging, exit_process, exit_status
from embgeom_ray.config import add_options
from embgeom_ray.errors import ConfigError

PROG = "embgeom reanalyze"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n")[2],
    )
    a = p.add_argument
    a(
        "--watchlist",
        help="YAML file: models: [{model: HUB_ID_OR_DIR, revision: latest|BRANCH|TAG|COMMIT, "
        "options: {...}}] (see deploy/models.yaml); required, except with --list",
    )
    a(
        "--store",
        required=True,
        help="where runs go (STORE/runs/<model>-<key>/) and the index STORE/runs.parquet; "
        "local directory or fsspec URL",
    )
    a(
        "--config",
        help="YAML file of jobs.analyze options shared by every model (the watch list's "
        "per-model options override it)",
    )
    a(
        "--dry-run",
        action="store_true",
        help="resolve every model and say what would run; run nothing, write nothing",
    )
    a(
        "--submit",
        metavar="ADDRESS",
        help="submit each needed run as its own Ray job to this job server (e.g. "
        "http://HEAD:8265) under the stable submission id embgeom-<key[:24]>, instead of "
        "running it in this process; the store must be reachable from the cluster",
    )
    a(
        "--runtime-env-json",
        help="with --submit: runtime environment of the submitted jobs, JSON [default: this "
        "checkout as working_dir, offline flags passed on]",
    )
    a(
        "--no-wait",
        action="store_true",
        help="with --submit: return once submitted (the index says 'submitted'; the next "
        "invocation follows or retries them) instead of waiting for the jobs",
    )
    a(
        "--list",
        action="store_true",
        help="print the runs the store holds (STORE/runs.parquet: status, revision, headline "
        "metrics, directory; '*' marks each model's latest complete run) and the command that "
        "compares the latest runs; needs no watch list, runs nothing, writes nothing",
    )
    a("-v", "--verbose", action="store_true", help="log at INFO level")
    # the corpus of every run: the job's own option, generated from its field
    add_options(p, ("corpus",), {"corpus": "'corpus' of --config"})
    return p


def _list(store: str) -> None:
    """``--list``: the store's runs (:func:`~embgeom_ray.runs.store_listing.listing_lines`)."""
    from embgeom_ray.runs.store_listing import listing_lines
    from embgeom_ray.storage import user_errors

    with user_errors(store, "store"):
        print("\n".join(listing_lines(store)))


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if not args.list and not args.watchlist:
        parser.error("the following arguments are required: --watchlist (except with --list)")
    configure_logging(args.verbose)
    if args.list:
        return exit_status(lambda: _list(args.store))
    results = []

    def run() -> None:
        if (args.runtime_env_json or args.no_wait) and not args.submit:
            raise ConfigError("--runtime-env-json and --no-wait apply with --submit only")
        runtime_env = None
        if args.runtime_env_json:
            try:
                runtime_env = json.loads(args.runtime_env_json)
            except ValueError as exc:
                raise ConfigError(f"--runtime-env-json is not valid JSON: {exc}") from None
            if not isinstance(runtime_env, dict):
                raise ConfigError("--runtime-env-json must be a JSON object")
        from embgeom_ray.runs.reanalyze import reanalyze

        results.append(reanalyze(
            args.watchlist,
            args.store,
            corpus=args.corpus,
            config_path=args.config,
            dry_run=args.dry_run,
            submit=args.submit,
            runtime_env=runtime_env,
            wait=not args.no_wait,
        ))  # fmt: skip

    status = exit_status(run)  # a user error (a store's fault included): 2; Ctrl-C: 130
    if status:
        return status
    (result,) = results
    if not result.ok:
        names = ", ".join(o.entry.label for o in result.failed)
        print(f"error: {len(result.failed)} model(s) failed: {names}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_process(main())
