"""glibc's allocator set up for a CPU training process: freed memory is kept for reuse.

A training step on the CPU allocates and frees the same large tensors every step
(activations, gradients, logits). glibc's ``malloc`` serves a block above its mmap threshold
(128 KiB, raised as large blocks are freed) with fresh pages from the kernel and returns them
on ``free``, and it gives the top of its heap back to the kernel once more than twice that
threshold is free there; every step then faults its pages in again, each fault zeroing a
page. Measured on a 2-core Intel Xeon, one torch thread: 4,400-6,000 page faults per ``tiny``
GRPO step and 46,000 per ``small`` one, against 250-750 and 3,600 with the settings here
(``docs/results.md``, "The allocator").

:func:`keep_freed_memory` raises the mmap threshold to its maximum (32 MiB on 64-bit glibc:
larger blocks still come from ``mmap``) and the trim threshold to 2 GiB, as the
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` environment variables would. The
process keeps its peak heap instead of returning it between steps (the peak is unchanged).
PyTorch's CUDA caching allocator keeps GPU memory the same way; this does not touch it.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""glibc's largest mmap threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``)."""
TRIM_THRESHOLD = (1 << 31) - 1
"""The largest trim threshold ``mallopt`` takes (an ``int``): 2 GiB."""
OFF = "ANCHOR_RL_MALLOC"
"""``ANCHOR_RL_MALLOC=default`` leaves glibc's settings as they are."""

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for a CPU training process (once per process);
    whether they are set. False, changing nothing, off Linux, without glibc (musl), with
    ``ANCHOR_RL_MALLOC=default``, or where the user set either ``MALLOC_*`` variable (their
    values stand)."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def kept() -> bool:
    """Whether this process set the thresholds (:func:`keep_freed_memory` ran and took
    effect); reads only, never sets them."""
    return bool(_applied)


def _apply() -> bool:
    if os.environ.get(OFF, "") == "default" or not sys.platform.startswith("linux"):
        return False
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl has mallopt too, as a stub)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
