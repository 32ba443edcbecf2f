"""The peak of Ray's object store while a command runs, against the plan's formula.

Runs COMMAND (a job joining the Ray cluster at ``--address``) and reads the cluster's plasma
usage every ``--every`` seconds (``ray._private.internal_api.memory_summary(stats_only=True)``:
"Plasma memory usage N MiB, M objects", not a public API) until it ends; prints the peak, the
objects then, and each change (docs/sizing.md, "Ray's object store"):

    python -m bench.object_store_peak --address HOST:PORT -- \\
        python -m jobs.analyze --config configs/demo.yaml --model M --corpus C --out OUT \\
        --no-report --address HOST:PORT

The plan's figure: ``object_store.peak_bytes`` of the same command's ``--plan-json``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import time

USAGE = re.compile(r"Plasma memory usage (\d+) MiB, (\d+) objects")


def plasma_mib(address: str) -> tuple[int, int] | None:
    """(MiB used, objects) of the cluster's object stores now; None where Ray does not say."""
    from ray._private.internal_api import memory_summary

    try:
        found = USAGE.search(memory_summary(address=address, stats_only=True))
    except Exception:  # not this Ray's API, or the cluster is busy: no reading
        return None
    return (int(found.group(1)), int(found.group(2))) if found else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True, help="the Ray cluster's HOST:PORT")
    p.add_argument("--every", type=float, default=0.3, help="seconds between readings")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args(argv)
    import ray

    ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    job, t0, last, peak = subprocess.Popen(command), time.time(), None, (0, 0)
    while job.poll() is None:
        now = plasma_mib(args.address)
        if now is not None and now != last:
            print(f"{time.time() - t0:7.1f} s: {now[0]:,} MiB, {now[1]:,} objects", flush=True)
            last, peak = now, max(peak, now)
        time.sleep(args.every)
    print(f"peak: {peak[0]:,} MiB ({peak[1]:,} objects then); the command's exit status {job.returncode}")


if __name__ == "__main__":
    main()
