"""Backing large host allocations with transparent huge pages.

XLA's CPU runtime allocates its buffers afresh on every call, and glibc's `malloc`
serves large ones with new `mmap` regions, so every call pays a page fault for each
4 KiB it touches: on a 2-core machine about a fifth of a small Llama's train step.
glibc's `glibc.malloc.hugetlb=1` tunable asks for transparent huge pages instead, 512
times fewer faults. Tunables are read when a process starts, hence a re-run.

Memory that stays, such as a model's weights for generation, can instead be moved onto
huge pages where it lies, at any time (`collapse_into_huge_pages`).
"""

import ctypes
import os
import platform
import sys
from pathlib import Path

import jax

HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
"""The glibc tunable that backs `malloc`'s large regions with transparent huge pages."""

_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_THP_SIZE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
_MADV_COLLAPSE = 25  # Linux 6.1


def _huge_page_bytes() -> int:
    """The size of a transparent huge page; 0 where the kernel allows none."""
    if sys.platform != "linux":
        return 0
    try:
        return 0 if "[never]" in _THP_MODE.read_text() else int(_THP_SIZE.read_text())
    except (OSError, ValueError):
        return 0


def huge_pages_available() -> bool:
    """Whether this is glibc on a Linux kernel that allows transparent huge pages."""
    return platform.libc_ver()[0] == "glibc" and _huge_page_bytes() > 0


def rerun_with_huge_pages(argv: list[str]) -> None:
    """Replace this process by `python *argv` with `HUGE_PAGES_TUNABLE` added to
    `GLIBC_TUNABLES`; return without doing anything when the tunable is already set,
    when huge pages are not available, or when `EQDEL_HUGE_PAGES=0`.

    Call it first thing, before any work that a re-run would repeat.

    **Arguments:**

    - `argv`: the arguments after the interpreter: a script's `sys.argv`, or
        `["-m", module, *sys.argv[1:]]`.
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if (
        "glibc.malloc.hugetlb" in tunables
        or os.environ.get("EQDEL_HUGE_PAGES") == "0"
        or not huge_pages_available()
    ):
        return
    env = {**os.environ, "GLIBC_TUNABLES": ":".join(filter(None, (tunables, HUGE_PAGES_TUNABLE)))}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)


def _host_spans(tree) -> list[tuple[int, int]]:
    """The `(address, bytes)` of the host memory under each array of `tree` on a CPU
    device; traced or deleted arrays are left out."""
    spans = []
    for leaf in jax.tree.leaves(tree):
        # A tracer counts as a `jax.Array` too.
        if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
            continue
        if leaf.is_deleted():
            continue
        for shard in leaf.addressable_shards:
            data = shard.data
            if shard.device.platform == "cpu" and data.nbytes:
                spans.append((data.unsafe_buffer_pointer(), data.nbytes))
    return spans


def collapse_into_huge_pages(tree) -> int:
    """Move the host memory under `tree`'s CPU arrays onto transparent huge pages, in
    place, with Linux's `madvise(MADV_COLLAPSE)` (6.1 and later; elsewhere, or where
    transparent huge pages are off, nothing happens).

    A decode step streams every weight from memory. On 4 KiB pages each page of the
    weights costs a TLB miss and stops the hardware prefetchers at its end; on 2 MiB
    pages a SmolLM2 decode step ran about 6% faster. Each huge page that holds any byte of
    an array is collapsed whole (the bytes around the arrays keep their values too);
    a page that cannot be (not mapped, or no huge page free) is left as it is.

    **Arguments:**

    - `tree`: any pytree; its leaves that are concrete arrays on CPU devices count.

    **Returns:**

    The number of huge pages now holding the arrays.
    """
    size = _huge_page_bytes()
    spans = _host_spans(tree) if size else []
    if not spans:
        return 0
    pages = {p for start, n in spans for p in range(start // size, (start + n - 1) // size + 1)}
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return sum(libc.madvise(p * size, size, _MADV_COLLAPSE) == 0 for p in sorted(pages))
