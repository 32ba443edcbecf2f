"""glibc's allocator keeps freed blocks under 32 MiB for reuse once tuned (a fresh process
each way: the setting is process-wide)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from embgeom_ray.inputs.malloc_tuning import MMAP_THRESHOLD_MAX

#: one "batch": three 24 MiB blocks written through (bytearray zero-fills), then freed; the
#: minor page faults of ten more batches after the first
SCRIPT = """
import resource, sys
from embgeom_ray.inputs.malloc_tuning import reuse_freed_memory
tuned = reuse_freed_memory() if sys.argv[1] == "tuned" else None
def batch():
    blocks = [bytearray(24 << 20) for _ in range(3)]
    del blocks
batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    batch()
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], check=True, capture_output=True, text=True
    ).stdout.split()
    return out[0], int(out[1])


def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    pages = (24 << 20) // 4096  # a block's 4 KiB pages
    assert 24 << 20 < MMAP_THRESHOLD_MAX
    tuned, tuned_faults = faults("tuned")
    _, default_faults = faults("default")
    if platform.libc_ver()[0] == "glibc":
        assert tuned == "True"
        # glibc's own thresholds: the heap top (72 MiB freed) exceeds the trim threshold
        # (2 × 24 MiB), so each batch maps and faults in at least one block again
        assert default_faults >= 10 * pages
        assert tuned_faults < pages  # every batch reuses the blocks the first one faulted in
    else:  # another C library: nothing is changed
        assert tuned == "False"


#: three 24 MiB blocks kept by the tuned heap once freed; the private memory (RssAnon, KiB)
#: then, and after release_freed_memory
RELEASE = """
import sys
from embgeom_ray.inputs.malloc_tuning import release_freed_memory, reuse_freed_memory
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon"))
reuse_freed_memory()
blocks = [bytearray(24 << 20) for _ in range(3)]
del blocks
kept = anon()
released = release_freed_memory()
print(released, kept, anon())
"""


def test_the_freed_heap_is_handed_back_when_asked():
    """What the tuned heap keeps of freed blocks (an extractor's serialisations between two
    flushes) goes back to the system at release_freed_memory, which an extractor calls before
    the first shard after a flush."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    out = subprocess.run([sys.executable, "-c", RELEASE], check=True, capture_output=True,
                         text=True).stdout.split()  # fmt: skip
    released, kept, after = out[0], int(out[1]), int(out[2])
    assert released == "True"
    assert kept - after > 60 << 10  # KiB: most of the 72 MiB freed
