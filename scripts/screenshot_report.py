"""Render a report.html with headless Chromium to a PNG, so a person (or a test) can look at it.

Usage::

    python scripts/screenshot_report.py RUN_DIR_OR_REPORT_HTML [-o OUT.png]
        [--width 1400] [--height 4000] [--chromium /usr/bin/chromium]

Prints the PNG's path (default: ``report.png`` beside the report). Chromium runs with a fresh
temporary profile, no sandbox, no GPU and no background networking, so it works as root in a
container and never touches the network (the report is self-contained anyway). Install it on
Debian/Ubuntu with ``apt-get install -y chromium``.

The helpers :func:`screenshot` and :func:`dump_dom` are used by ``tests/report/test_report.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--mute-audio",
]


def find_chromium(explicit: str | None = None) -> str | None:
    """The Chromium binary: ``explicit``, $CHROMIUM, /usr/bin/chromium, or chromium on PATH."""
    for cand in (explicit, os.environ.get("CHROMIUM"), DEFAULT_CHROMIUM):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _run(args: list[str], chromium: str | None, timeout: float) -> subprocess.CompletedProcess:
    exe = find_chromium(chromium)
    if exe is None:
        raise FileNotFoundError(
            "Chromium not found: apt-get install -y chromium (or set $CHROMIUM)"
        )
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        cmd = [exe, *FLAGS, f"--user-data-dir={profile}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def screenshot(
    html_path: str | os.PathLike,
    png_path: str | os.PathLike,
    *,
    width: int = 1400,
    height: int = 4000,
    chromium: str | None = None,
    timeout: float = 120.0,
) -> str:
    """Screenshot ``html_path`` (a local file) into ``png_path``; returns the PNG's path."""
    html_path = Path(html_path).resolve()
    png_path = Path(png_path).resolve()
    if png_path.exists():
        png_path.unlink()
    proc = _run(
        [f"--screenshot={png_path}", f"--window-size={width},{height}", html_path.as_uri()],
        chromium,
        timeout,
    )
    if not png_path.exists():
        raise RuntimeError(
            f"Chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"
        )
    return str(png_path)


def dump_dom(
    html_path: str | os.PathLike,
    *,
    chromium: str | None = None,
    timeout: float = 120.0,
    virtual_time_ms: int = 10_000,
) -> str:
    """The DOM of ``html_path`` after load (scripts in the page have run), as HTML text."""
    html_path = Path(html_path).resolve()
    proc = _run(
        [f"--virtual-time-budget={virtual_time_ms}", "--dump-dom", html_path.as_uri()],
        chromium,
        timeout,
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(
            f"Chromium --dump-dom failed (exit {proc.returncode}): {proc.stderr[-2000:]}"
        )
    return proc.stdout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", help="a report.html, or a run directory holding one")
    p.add_argument("-o", "--output", help="PNG to write [default: report.png beside the report]")
    p.add_argument("--width", type=int, default=1400)
    p.add_argument("--height", type=int, default=4000)
    p.add_argument("--chromium", help=f"Chromium binary [default: $CHROMIUM or {DEFAULT_CHROMIUM}]")
    args = p.parse_args(argv)
    report = Path(args.report)
    if report.is_dir():
        report = report / "report.html"
    if not report.is_file():
        print(
            f"error: {report} not found (build it with: python -m jobs.report RUN_DIR)",
            file=sys.stderr,
        )
        return 2
    if find_chromium(args.chromium) is None:
        print(
            "error: Chromium not found; install it with: apt-get install -y chromium",
            file=sys.stderr,
        )
        return 2
    out = Path(args.output) if args.output else report.with_suffix(".png")
    print(screenshot(report, out, width=args.width, height=args.height, chromium=args.chromium))
    return 0


if __name__ == "__main__":
    sys.exit(main())
