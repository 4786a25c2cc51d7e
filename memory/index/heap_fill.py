"""Fill heap memory as glibc hands it out and takes it back, so that embedded Chroma never
writes stale process memory into its index files (docs/security.md, "Heap residue").

hnswlib, under Chroma's Rust bindings, mallocs room for 100 elements when it creates a
collection's index (1676 bytes each at 384 dimensions: a 167,600-byte base layer and a
400-byte length array) and writes all of it to `data_level0.bin` and `length.bin` at once,
though only the elements added are ever set. The rest is whatever that memory held before:
glibc reuses freed chunks uncleared (the bindings use the system malloc), and once a large
buffer has been freed its mmap threshold rises past 167,600 bytes, so the base layer comes
from the heap too. A memproxy process wrote a write-off request's text there, thousands of
copies of it (tests/security/test_heap_residue.py).

glibc's M_PERTURB makes it fill every chunk its allocator hands out with `FILL ^ 0xFF` and
every chunk it takes back with `FILL`. What it does not fill: a chunk of up to 1,032 bytes
that a thread takes back from its own cache of chunks it freed (tcache), so `length.bin` can
still hold up to 400 bytes that one of Chroma's own threads freed before.
"""

from __future__ import annotations

import ctypes
import os

# glibc's mallopt parameter for the perturb byte (malloc.h).
M_PERTURB = -6
# Handed-out memory reads as zeros (0xFF ^ 0xFF), as fresh pages from the kernel do; taken-back
# memory as 0xFF bytes. 0 would turn the filling off.
FILL = 0xFF


def fill_heap() -> bool:
    """Have glibc fill memory it hands out and takes back (unless the operator set the perturb
    byte); False where there is no glibc or the operator's setting stands.

    Process-wide, and may be called at any time, from any thread, more than once.
    """
    if "MALLOC_PERTURB_" in os.environ or "glibc.malloc.perturb" in os.environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return False  # glibc read the operator's own choice at start
    return mallopt(M_PERTURB, FILL)


def mallopt(parameter: int, value: int) -> bool:
    """glibc's `mallopt(parameter, value)` (malloc.h): whether it took it; False where there
    is no glibc."""
    return _glibc("mallopt", parameter, value)


def release_free_heap() -> bool:
    """Hand the pages glibc holds free inside its heaps back to the system (`malloc_trim(0)`);
    False where there is no glibc.

    free() returns memory to the system only from the top of the main heap: a large text's
    buffers, freed in the middle of a heap or in another thread's arena (and filled with
    FILL there, so resident), otherwise stay in the process's RSS for good. Walks every
    arena: milliseconds, so it runs after large work only (memory/index/turn_index.py).
    """
    return _glibc("malloc_trim", 0)


def _glibc(function: str, *arguments: int) -> bool:
    # Both calls return 1 when they did something; no glibc: no CDLL(None) or no such symbol.
    try:
        return bool(getattr(ctypes.CDLL(None), function)(*arguments))
    except (OSError, AttributeError):
        return False
