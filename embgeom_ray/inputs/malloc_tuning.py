"""glibc's allocator set to reuse a CPU forward's freed tensors instead of handing them back to
the operating system and faulting fresh pages in for the next batch.

glibc serves an allocation of at least its *mmap threshold* with a mapping of its own, which
``free`` unmaps; the threshold starts at 128 KiB and rises to the size of each mapped block
freed, up to 32 MiB (``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit systems). Smaller blocks come
from the heap, whose free top is returned to the system once it exceeds the *trim threshold*
(twice the mmap threshold). A forward on a CPU allocates the same tensors batch after batch:
one layer's feed-forward activations are n · d_ff · 4 bytes (48 MiB for MiniLM at 8,192
tokens). Each one above the threshold, and each heap top freed past the trim threshold, is
a fresh mapping on the next batch, faulted in page by page (4 KiB each, zeroed by the
kernel): MiniLM's bare forward at 8,192 tokens faulted ~21 pages a token and spent 35–40 µs
a token in the kernel, against 0.2–3 µs at 1,024–2,048 tokens, for ~270 µs a token of its own
work (one thread, ``python -m bench.bare_forward``).

:func:`reuse_freed_memory` fixes the mmap threshold at its largest (which also stops its
rising) and raises the trim threshold, so that tensors up to 32 MiB are taken from the heap
and, once freed, stay there for the next batch. Larger blocks (the statistics' arrays, a
flush's serialised copy) are still mapped and unmapped, so the memory a process keeps beyond
what it uses is bounded by the trim threshold in the main heap, and by a heap's 64 MiB in
each thread's arena. :func:`embgeom_ray.sizing.cpu_batch_tokens` keeps a batch's tensors
within the mmap threshold. :func:`release_freed_memory` hands the heap's free memory back
when asked. An extractor does so after each spill and after each flush, where its spills'
and flush's serialisations (pieces of a small statistics budget are within the threshold
too) had left up to the trim threshold and more kept (a flush every shard on a 128k
vocabulary with a 24 MiB budget, ``bench.host_tier``'s spills: 1,194–1,260 MiB peak private
against 910 MiB asked; 866–935 MiB trimmed after each flush; 732–752 MiB after each spill
too). It also does before each flush, so that the serialised copy of its statistics is not
made beside what the fold's batches left kept (on ``bench.self_sized``'s V = 128,256 model,
the extractor's peak went from 6,447–6,920 to 5,860–5,870 MiB private, against the
6,040 MiB it asked: docs/sizing.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

from ..sizing.formulas import MMAP_THRESHOLD_MAX

#: ``mallopt`` parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: free heap kept at its top before glibc returns it to the system
TRIM_THRESHOLD = 256 << 20


@functools.cache
def _libc(name: str, *argtypes: type) -> Any:
    """The C library's function ``name`` taking ``argtypes`` and returning an int, or None
    (another C library than glibc: musl, macOS)."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


def _mallopt() -> Any:
    """glibc's ``mallopt``, or None."""
    return _libc("mallopt", ctypes.c_int, ctypes.c_int)


def reuse_freed_memory(
    mmap_threshold: int = MMAP_THRESHOLD_MAX, trim_threshold: int = TRIM_THRESHOLD
) -> bool:
    """Set this process's glibc mmap threshold to ``mmap_threshold`` and trim threshold to
    ``trim_threshold`` (both fixed from then on); True where glibc took both, False where
    the C library has no ``mallopt`` or refused a value (nothing else changes)."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(M_TRIM_THRESHOLD, trim_threshold)
    )


def release_freed_memory() -> bool:
    """Hand the heap's free memory back to the system now (glibc's ``malloc_trim(0)``: the main
    heap's free top and, in every arena, the free pages between blocks), whatever the trim
    threshold keeps. A thread's arena keeps the free top of its heap (at most 64 MiB an arena:
    glibc shrinks it only past the trim threshold). An extractor does so before each flush,
    so that the statistics' serialised copy is not made beside what the fold's freed batches
    left kept, and after it: the memory kept for the next batch's tensors is faulted in again
    once per flush, and what a flush's and the spills' serialisations freed is not kept beside
    the next interval's statistics. True where glibc returned memory."""
    trim = _libc("malloc_trim", ctypes.c_size_t)
    return bool(trim(0)) if trim is not None else False
