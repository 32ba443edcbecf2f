"""What the digests of :mod:`embgeom_ray.integrity` cost, next to the write and the read they check.

Builds a buffer of ``--gib`` GiB of random float64 (what a flush's serialised statistics
look like to a hash) and times, ``--repeats`` times each, alternately, in one process:

- ``write``: :func:`~embgeom_ray.io_utils.atomic_write_bytes` of the buffer to a local file
  (temporary name, fsync, rename): how a checkpoint group's piece is written;
- ``digest``: :meth:`~embgeom_ray.integrity.Digest.of` of the buffer, what each write adds;
- ``read`` and ``read_checked``: the whole file read back (from the page cache: the hash's
  share is the largest it can be), without and with :func:`~embgeom_ray.integrity.read_verified`;
- ``part`` and ``part_checked``: a reducer's part, a quarter of the rows of every one of 32
  "layers" of the file, read as ranges without and with a digest
  (:class:`~embgeom_ray.integrity.VerifiedFile`, which reads whole blocks);
- ``blake2b``: hashlib's BLAKE2b of the buffer, the other fast digest the issue named;
- ``json_write`` and ``json_seal``: a checkpoint group's JSON as a 61 GiB group's would be
  (its digest of 3,904 blocks of 16 MiB, 42 KB of base64), written
  (:func:`~embgeom_ray.io_utils.atomic_write_json`), and the digest of its own content that
  :func:`~embgeom_ray.integrity.seal` adds to it (:func:`~embgeom_ray.integrity.unseal`
  checks the same on each read).

    python -m bench.checksums [--gib 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import numpy as np

from bench.common import alternate, median, save, work_dir


def read_part(path: Path, digest, layers: int = 32) -> int:
    """A quarter of the rows of each of ``layers`` equal slices of the file, each one range."""
    import fsspec

    from embgeom_ray.integrity import VerifiedFile

    size = path.stat().st_size
    per = size // layers
    got = 0
    with fsspec.open(str(path), "rb") as raw:
        f = VerifiedFile(raw, digest, str(path))
        for i in range(layers):
            start = i * per + per // 3
            got += len(f.read_range(start, start + per // 4))
    return got


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="size of the file in GiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--name", default="checksums")
    args = p.parse_args(argv)

    from embgeom_ray.counts import Counts
    from embgeom_ray.integrity import Digest, FileRef, digests_json, read_verified, seal
    from embgeom_ray.io_utils import atomic_write_bytes, atomic_write_json, read_bytes

    n = int(args.gib * (1 << 30)) // 8
    buf = np.random.default_rng(0).normal(size=n).view(np.uint8)
    with work_dir("checksums") as work:
        path = work / "group.safetensors"
        group = 61 << 30
        block = 16 << 20
        hashes = np.random.default_rng(1).bytes(8 * (group // block))
        record = {
            "format": "embgeom-checkpoint-group/1", "group": "f0-b0000-n64",
            "shards": [f"f0-b{i:04d}" for i in range(64)], "counts": Counts().to_json(), "parts": 1,
            "digests": digests_json({"f0-b0000-n64.safetensors": Digest(group, block, hashes)}),
        }  # fmt: skip
        atomic_write_bytes(str(path), buf)
        digest = Digest.of(buf)
        ref = FileRef(str(path), digest)
        times, _ = alternate(
            {
                "write": lambda: atomic_write_bytes(str(path), buf),
                "digest": lambda: Digest.of(buf),
                "read": lambda: read_bytes(str(path)),
                "read_checked": lambda: read_verified(ref),
                "part": lambda: read_part(path, None),
                "part_checked": lambda: read_part(path, digest),
                "blake2b": lambda: hashlib.blake2b(memoryview(buf), digest_size=16).digest(),
                "json_write": lambda: atomic_write_json(str(work / "group.json"), record),
                "json_seal": lambda: seal(record),
            },
            args.repeats,
        )
    m = {k: median(v) for k, v in times.items()}
    gib = buf.nbytes / (1 << 30)
    print(
        f"{gib:g} GiB: write {m['write']:.3f} s ({gib / m['write']:.2f} GiB/s), digest "
        f"{m['digest']:.3f} s ({gib / m['digest']:.1f} GiB/s) = {m['digest'] / m['write']:.1%} "
        f"of the write; read {m['read']:.3f} s, checked {m['read_checked']:.3f} s "
        f"(+{m['read_checked'] / m['read'] - 1:.0%}); a reducer's quarter {m['part']:.3f} s, "
        f"checked {m['part_checked']:.3f} s; BLAKE2b {m['blake2b']:.3f} s "
        f"({gib / m['blake2b']:.2f} GiB/s); a group's JSON: written in {m['json_write'] * 1e3:.2f} ms, "
        f"its digest {m['json_seal'] * 1e3:.2f} ms"
    )
    save(
        args.name,
        {
            "command": "python -m bench.checksums",
            "args": vars(args),
            "bytes": int(buf.nbytes),
            "block": digest.block,
            "times_s": times,
            "digest_share_of_write": m["digest"] / m["write"],
            "read_check_overhead": m["read_checked"] / m["read"] - 1,
            "part_check_overhead": m["part_checked"] / m["part"] - 1,
            "json_seal_share_of_write": m["json_seal"] / m["json_write"],
        },
    )


if __name__ == "__main__":
    main()
