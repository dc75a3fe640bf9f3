import subprocess
import sys

import eqdel


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "eqdel._cli", *args], capture_output=True, text=True, timeout=300
    )


def test_version():
    out = run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"eqdel {eqdel.__version__}"


def test_inspect_mesh():
    out = run("inspect-mesh", "--devices", "8", "--axis-dims", "2,-1,2,1")
    assert out.returncode == 0, out.stderr
    assert "8 devices, mesh {'dp': 2, 'fsdp': 2, 'tp': 2, 'sp': 1}" in out.stdout


def test_inspect_mesh_bad_dims_is_a_clear_error():
    out = run("inspect-mesh", "--devices", "8", "--axis-dims", "3,-1,1,1")
    assert out.returncode == 2
    assert "needs a multiple of 3 devices; found 8" in out.stderr


def test_demo_runs_the_tiny_llama_sharded():
    out = run("demo")
    assert out.returncode == 0, out.stderr
    assert "mesh (dp=1, fsdp=2, tp=2, sp=2)" in out.stdout
    assert ".model.layers.self_attn.q_proj.weight" in out.stdout
    difference = float(out.stdout.split("max |sharded - single device| = ")[1].split()[0])
    assert difference <= 1e-5
