"""Re-running a process with huge pages for glibc's large allocations."""

import os
import subprocess
import sys

import pytest

from eqdel._host_memory import HUGE_PAGES_TUNABLE, huge_pages_available

RERUN = "import os; print('rerun', os.environ['GLIBC_TUNABLES'])"
CHILD = (
    "from eqdel._host_memory import rerun_with_huge_pages\n"
    f"rerun_with_huge_pages(['-c', {RERUN!r}])\n"
    "print('not rerun')\n"
)


def run_child(**env):
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "EQDEL_HUGE_PAGES")}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages here")
def test_rerun_adds_the_tunable_to_those_already_set():
    assert run_child() == f"rerun {HUGE_PAGES_TUNABLE}"
    kept = "glibc.malloc.arena_max=4"
    assert run_child(GLIBC_TUNABLES=kept) == f"rerun {kept}:{HUGE_PAGES_TUNABLE}"


def test_no_rerun_when_set_or_switched_off():
    assert run_child(GLIBC_TUNABLES=HUGE_PAGES_TUNABLE) == "not rerun"
    assert run_child(EQDEL_HUGE_PAGES="0") == "not rerun"


def test_the_command_runs_after_its_rerun():
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-m", "eqdel._cli", "--version"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("eqdel "), out.stderr
