"""The local model's content hash, computed against cached, in one process.

Writes a model-like directory of ``--gib`` GiB (``--files`` weight shards of random bytes, a
config and a tokenizer file), waits until its files are older than the cache's racy window,
then times, ``--repeats`` times each, alternately: (a) :func:`~embgeom_ray.inputs.fingerprints.
content_fingerprint`, which reads every byte (what every run, resume and scheduled
re-analysis did before the cache), and (b) :func:`~embgeom_ray.inputs.fingerprints.
directory_fingerprint` with a warm cache (a stat of each file). The files were just written,
so (a) reads them from the page cache: it measures hashing, not the disk or the network
filesystem a real model directory may sit on, which can only be slower.

    python -m bench.fingerprint [--gib 2] [--files 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from bench.common import median, save, timed, work_dir


def make_dir(root: Path, gib: float, files: int) -> Path:
    d = root / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "tokenizer.json").write_text("{}")
    per_file = int(gib * (1 << 30)) // files
    block = os.urandom(1 << 24)
    for i in range(files):
        with open(d / f"model-{i + 1:05d}-of-{files:05d}.safetensors", "wb") as f:
            left = per_file
            while left > 0:
                left -= f.write(block[: min(left, len(block))])
    return d


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="size of the weight files in GiB")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--name", default="fingerprint")
    args = p.parse_args(argv)

    from embgeom_ray.inputs import fingerprints

    before = os.environ.get(fingerprints.CACHE_ENV)
    with work_dir("fingerprint") as work:
        os.environ[fingerprints.CACHE_ENV] = str(work / "cache")  # a cache of its own
        try:
            d = str(make_dir(work, args.gib, args.files))
            time.sleep(fingerprints.RACY_SECONDS + 0.5)
            t_first, first = timed(lambda: fingerprints.directory_fingerprint(d))
            times: dict[str, list[float]] = {"content": [], "cached": []}
            for _ in range(args.repeats):
                t, full = timed(lambda: fingerprints.content_fingerprint(d))
                times["content"].append(t)
                t, cached = timed(lambda: fingerprints.directory_fingerprint(d))
                times["cached"].append(t)
                assert full == cached == first
        finally:
            if before is None:
                os.environ.pop(fingerprints.CACHE_ENV, None)
            else:
                os.environ[fingerprints.CACHE_ENV] = before
    content, cached = median(times["content"]), median(times["cached"])
    gib = args.gib
    print(
        f"{gib:g} GiB in {args.files} files: content hash {content:.3f} s ({gib / content:.2f} GiB/s), "
        f"first call {t_first:.3f} s, cached {cached * 1e3:.2f} ms: x{content / cached:,.0f}"
    )
    save(
        args.name,
        {
            "command": "python -m bench.fingerprint",
            "args": vars(args),
            "first_call_s": t_first,
            "content_s": times["content"],
            "cached_s": times["cached"],
            "gib_per_s": gib / content,
            "ratio": content / cached,
        },
    )


if __name__ == "__main__":
    main()
