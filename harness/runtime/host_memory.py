"""Keep freed host memory in the process (glibc malloc), so that a CPU run does not page-fault every iteration.

PyTorch's CPU allocator is glibc's malloc: each iteration's activations are large blocks that glibc maps
fresh and returns to the kernel when freed, so every iteration page-faults them back in (kernel time, and
costly in a VM). A profiled layer, run over and over, reuses its few blocks and does not; a dp=2 run's
steps came out 7-25% slower than with freed memory kept. On a GPU, PyTorch's caching allocator keeps freed
memory, and production CPU training uses allocators that do; `harness profile` and `harness train` on a
CPU both call this so that they measure compute, not the kernel's page handling.
"""
from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def prepare_host_memory(device_type: str) -> str:
    """On a CPU keep freed memory in the process; the label recorded in the environment (`host_memory`)."""
    return "retained" if device_type == "cpu" and retain_freed_host_memory() else "default"


def retain_freed_host_memory() -> bool:
    """Make glibc serve every block from its heap (no mmap) and never return the heap's top to the kernel.
    Returns False where this is not glibc (the call then changes nothing)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
