"""glibc's malloc thresholds, where hf_lmc sets them (docs/decisions.md#d-mmap-threshold).

glibc serves a block at or above its mmap threshold with fresh pages from the kernel, which
the kernel must fault in and zero, and hands it back to the kernel when freed; smaller blocks
come from its heap, where freed memory waits for the next allocation. By default the threshold
grows with each freed block (up to 32 MiB). Two kinds of work want opposite settings:

* a streamed merge allocates each layer's temporaries once: served from the heap they pile up
  and raise the peak, so the command line fixes the threshold at 1 MiB
  (:func:`return_freed_memory_promptly`);
* a training loop (learned matching, the demo's tiny models) allocates the same temporaries of
  a few MiB at every step: served by ``mmap`` each is fresh pages again, which can take longer
  than the arithmetic, so while it runs blocks below 32 MiB come from the heap
  (:func:`reused_memory`).

Every call is a no-op where glibc is not the allocator.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: The bounds glibc's own growing threshold keeps: mmap from 32 MiB, the heap trimmed past twice that.
HEAP_MMAP_THRESHOLD = 32 << 20
HEAP_TRIM_THRESHOLD = 64 << 20
#: glibc's trim threshold once any threshold is fixed (it stops growing): 128 KiB.
GLIBC_TRIM_THRESHOLD = 128 << 10

#: The thresholds hf_lmc has set in this process, by parameter (none: glibc's growing ones).
_SET: dict[int, int] = {}


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018 - absent where glibc is not the C library
        return libc
    except (OSError, AttributeError):
        return None


def set_threshold(parameter: int, value: int) -> bool:
    """``mallopt(parameter, value)``, remembered; whether glibc took it."""
    libc = _libc()
    if libc is None or not libc.mallopt(parameter, value):
        return False
    _SET[parameter] = value
    return True


def return_freed_memory_promptly() -> None:
    """Serve blocks from 1 MiB with ``mmap``, so freed tensors go back to the OS at once (the
    command line's setting, for streamed merges)."""
    set_threshold(M_MMAP_THRESHOLD, 1 << 20)


def small_blocks_from_the_heap() -> None:
    """Serve blocks below 32 MiB from the heap again, as glibc's growing threshold ends up doing."""
    set_threshold(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)
    set_threshold(M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD)


@contextlib.contextmanager
def reused_memory() -> Iterator[None]:
    """Inside, blocks below 32 MiB come from the heap (:func:`small_blocks_from_the_heap`) where
    hf_lmc had fixed a lower mmap threshold, and that threshold is set again after, the heap
    trimmed. Where none was fixed (the Python API: glibc's own threshold, which grows as a loop
    frees its blocks) nothing changes."""
    before = dict(_SET)
    if before.get(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD) >= HEAP_MMAP_THRESHOLD:
        yield
        return
    small_blocks_from_the_heap()
    try:
        yield
    finally:
        set_threshold(M_MMAP_THRESHOLD, before[M_MMAP_THRESHOLD])
        set_threshold(M_TRIM_THRESHOLD, before.get(M_TRIM_THRESHOLD, GLIBC_TRIM_THRESHOLD))
        _libc().malloc_trim(0)
