"""Freed heap memory handed back to the kernel: a CPU run's phases and micro-batches call it (agentopd.memory_host
plans what a CPU run holds; this keeps what it frees from staying resident).

    release_freed_memory()   # glibc's malloc_trim(0); nothing where the C library has none
"""

from __future__ import annotations


def release_freed_memory() -> None:
    """Give the heap pages that freed tensors leave behind back to the kernel (glibc's malloc_trim; nothing elsewhere).

    glibc keeps freed memory in its arenas for reuse, and after a large mmapped block is freed it serves blocks up to
    32 MiB from them too (its dynamic mmap threshold): measured 2026-11-29 on SmolLM2-135M in fp32, two forward and
    backward passes of 1,024 tokens left the process at 1.75, then 2.42 GiB resident after every tensor was freed (0.84
    loaded), 0.88 after malloc_trim(0); in a 135M <- 0.5B run the rollout phase after the first train step sat 4.5 GiB
    above the one before it. A CPU run calls this after each phase and each micro-batch's backward (milliseconds)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()
