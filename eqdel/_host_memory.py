"""Backing large host allocations with transparent huge pages.

XLA's CPU runtime allocates its buffers afresh on every call, and glibc's `malloc`
serves large ones with new `mmap` regions, so every call pays a page fault for each
4 KiB it touches: on a 2-core machine about a fifth of a small Llama's train step.
glibc's `glibc.malloc.hugetlb=1` tunable asks for transparent huge pages instead, 512
times fewer faults. Tunables are read when a process starts, hence a re-run.
"""

import os
import platform
import sys
from pathlib import Path

HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
"""The glibc tunable that backs `malloc`'s large regions with transparent huge pages."""

_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether this is glibc on a Linux kernel that allows transparent huge pages."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        return "[never]" not in _THP_MODE.read_text()
    except OSError:
        return False


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
