"""Huge pages: re-running a process with them for glibc's large allocations, and moving
arrays onto them in place."""

import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqdel._host_memory import (
    HUGE_PAGES_TUNABLE,
    collapse_into_huge_pages,
    huge_pages_available,
)

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


def _kernel_collapses() -> bool:
    """Linux 6.1 or later (`MADV_COLLAPSE`) with transparent huge pages allowed."""
    release = tuple(int(p) for p in platform.release().split(".")[:2] if p.isdigit())
    return huge_pages_available() and len(release) == 2 and release >= (6, 1)


@pytest.mark.skipif(not _kernel_collapses(), reason="no MADV_COLLAPSE here")
def test_collapse_moves_arrays_onto_huge_pages_and_keeps_their_values():
    values = np.random.default_rng(0).standard_normal((4, 1 << 20), np.float32)  # 16 MiB
    x = jnp.asarray(values)
    tree = {"weights": x, "small": jnp.arange(3), "not an array": "x"}
    assert collapse_into_huge_pages(tree) >= 8 - 1  # the whole pages under 16 MiB, at least
    np.testing.assert_array_equal(np.asarray(x), values)
    np.testing.assert_array_equal(np.asarray(tree["small"]), np.arange(3))


def test_collapse_passes_over_traced_and_deleted_arrays():
    counts = []

    @jax.jit
    def traced(x):
        counts.append(collapse_into_huge_pages(x))
        return x + 1

    traced(jnp.ones(4))
    gone = jnp.ones(4)
    gone.delete()
    assert counts == [0]
    assert collapse_into_huge_pages({"gone": gone}) == 0
