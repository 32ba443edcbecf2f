"""The peak of Ray's object store while a command runs, against the plan's formula.

Runs COMMAND (a job joining the Ray cluster at ``--address``) and reads the cluster's plasma
usage every ``--every`` seconds (``ray._private.internal_api.memory_summary(stats_only=True)``:
"Plasma memory usage N MiB, M objects", not a public API) until it ends; prints the peak, the
objects then, and each change (docs/sizing.md, "Ray's object store"):

    python -m bench.object_store_peak --address HOST:PORT -- \\
        python -m jobs.analyze --config configs/demo.yaml --model M --corpus C --out OUT \\
        --no-report --address HOST:PORT

The plan's figure: ``object_store.peak_bytes`` of the same command's ``--plan-json``; given
that file (``--plan-json PLAN``, written first by the same command with ``--plan-json PLAN``),
the measured peak is printed as a share of it. The result goes to
``bench/results/object_store_peak.json``. Joins the Ray this process has initialised, if any.
"""

from __future__ import annotations

import argparse
import json
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


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True, help="the Ray cluster's HOST:PORT")
    p.add_argument("--every", type=float, default=0.3, help="seconds between readings")
    p.add_argument("--plan-json", help="the command's --plan-json file: its peak_bytes compared")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args(argv)
    import ray

    from bench.common import save

    if not ray.is_initialized():
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
    result = {"command": command, "args": vars(args), "peak_mib": peak[0], "objects": peak[1],
              "exit_status": job.returncode, "seconds": round(time.time() - t0, 1)}  # fmt: skip
    if args.plan_json:
        with open(args.plan_json) as f:
            planned = json.load(f)["object_store"]["peak_bytes"] / 2**20
        result |= {"plan_peak_mib": round(planned, 1),
                   "measured_share_of_plan": round(peak[0] / planned, 3) if planned else None}  # fmt: skip
        if planned:
            print(f"the plan's peak: {planned:,.0f} MiB; measured {peak[0] / planned:.0%} of it")
    save("object_store_peak", result)
    return result


if __name__ == "__main__":
    main()
