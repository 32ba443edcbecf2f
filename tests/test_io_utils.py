"""embgeom_ray/io_utils.py: the comparable form of a local path however its URL is written, and
writes to an object store other than S3 (``gs://``, …): through the
store's fsspec file a block at a time, never gathered whole, and never made when the write
fails. The store here is an fsspec filesystem of buffered files, as gcsfs's are (a resumable
upload of the file's blocks, the object made when the file closes): it records each chunk
uploaded, the objects made and the uploads discarded."""

from __future__ import annotations

from typing import ClassVar

import fsspec
import numpy as np
import pytest
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from embgeom_ray.io_utils import atomic_write_blocks, atomic_write_bytes

BLOCK = 1 << 20  # the store's block (gcsfs: 50 MiB by default)


class _UploadFile(AbstractBufferedFile):
    def _initiate_upload(self) -> None:
        self.parts: list[bytes] = []

    def _upload_chunk(self, final: bool = False) -> bool:
        data = self.buffer.getvalue()
        self.fs.chunks.append(len(data))
        self.parts.append(data)
        if final:
            self.fs.objects[self.path] = b"".join(self.parts)
        return True

    def discard(self) -> None:
        self.fs.discarded.append(self.path)


class _Uploads(AbstractFileSystem):
    protocol = "uploadtest"
    objects: ClassVar[dict[str, bytes]] = {}
    chunks: ClassVar[list[int]] = []
    discarded: ClassVar[list[str]] = []

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        return _UploadFile(self, path, mode, block_size=block_size or BLOCK)


@pytest.fixture
def store():
    fsspec.register_implementation("uploadtest", _Uploads, clobber=True)
    _Uploads.objects, _Uploads.chunks, _Uploads.discarded = {}, [], []
    return _Uploads


def test_a_large_write_goes_up_a_block_at_a_time(store) -> None:
    """10 MiB given in blocks of 3 MiB (a host tier's statistics) or whole: uploaded in chunks
    of at most a block and a slice, never the whole file in the file's buffer."""
    data = np.random.default_rng(3).integers(0, 256, (10 << 20) + 123, dtype=np.uint8)
    blocks = [data[i : i + (3 << 20)] for i in range(0, data.nbytes, 3 << 20)]
    atomic_write_blocks("uploadtest://bucket/tier.bin", iter(blocks), data.nbytes)
    assert store.objects["bucket/tier.bin"] == data.tobytes()
    assert len(store.chunks) >= 10 and max(store.chunks) < 2 * BLOCK
    store.chunks.clear()
    atomic_write_bytes("uploadtest://bucket/whole.bin", data)
    assert store.objects["bucket/whole.bin"] == data.tobytes()
    assert len(store.chunks) >= 10 and max(store.chunks) < 2 * BLOCK
    atomic_write_bytes("uploadtest://bucket/small.json", b"{}")  # under a block: one chunk
    assert store.objects["bucket/small.json"] == b"{}" and store.discarded == []


def test_a_failed_write_makes_no_object(store) -> None:
    """Blocks short of the size, or blocks that fail on the way: the upload is discarded and
    no object is made, neither then nor when the file is collected."""
    data = np.arange(5 << 20, dtype=np.uint8)
    with pytest.raises(ValueError, match="bytes to write"):
        atomic_write_blocks("uploadtest://bucket/short.bin", iter([data]), data.nbytes + 1)

    def failing():
        yield data
        raise OSError("the statistics could not be read")

    with pytest.raises(OSError, match="could not be read"):
        atomic_write_blocks("uploadtest://bucket/failed.bin", failing(), 2 * data.nbytes)
    import gc

    gc.collect()
    assert store.objects == {}
    assert store.discarded == ["bucket/short.bin", "bucket/failed.bin"]
    assert store.chunks  # both had begun their uploads


@pytest.mark.parametrize("scheme", ["", "file://", "local://"])
def test_a_local_url_of_either_scheme_names_its_path(scheme, tmp_path) -> None:
    """fsspec's local filesystem takes ``file://`` and ``local://``: both are the path they
    name, so an output directory given either way is compared as the same directory."""
    from embgeom_ray.io_utils import location, path_key, within

    real = tmp_path / "runs" / "a"
    real.mkdir(parents=True)
    url = f"{scheme}{real}/"
    assert location(url) == str(real.resolve())
    assert path_key(url) == str(real)
    assert within(f"{scheme}{real}/b.jsonl", str(real))
    assert path_key("s3://bucket/runs/") == "s3://bucket/runs"
