"""Two local processes on loopback build the same global mesh as one process would."""

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import three_train_steps
from jax.sharding import NamedSharding

import eqdel
from eqdel import axes

WORKER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[3])
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]),
        initialization_timeout=60,
    )
    import numpy as np
    from jax.sharding import NamedSharding
    import eqdel
    from eqdel import axes

    cfg = eqdel.ShardingConfig(axis_dims=(2, 2, 2, 1))
    mesh = cfg.mesh()
    data = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    spec = cfg.resolve((axes.BATCH, axes.EMBED), shape=data.shape)
    x = jax.make_array_from_callback(data.shape, NamedSharding(mesh, spec), lambda i: data[i])
    total = jax.jit(lambda x: (x * x).sum(), out_shardings=NamedSharding(mesh, jax.P()))(x)
    import three_train_steps
    trained = three_train_steps.train(cfg, sys.argv[4])
    print("RESULT " + json.dumps({
        "mesh": [[d.id, d.process_index] for d in mesh.devices.flat],
        "shape": dict(mesh.shape),
        "spec": str(spec),
        "total": float(total.addressable_data(0)),
        "trained": trained,
        "restored": three_train_steps.restored_sums(cfg, sys.argv[4]),
    }))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_processes(timeout: float, checkpoint_dir) -> list[dict] | None:
    """Both workers' results, or `None` if they did not finish in time."""
    address = f"127.0.0.1:{_free_port()}"
    tests = str(Path(__file__).parent)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, address, str(i), tests, str(checkpoint_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, err[-3000:]
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert len(lines) == 1, out + err[-3000:]
            results.append(json.loads(lines[0].removeprefix("RESULT ")))
    except subprocess.TimeoutExpired:
        return None
    finally:
        for proc in procs:
            proc.kill()
    return results


def test_two_processes_share_one_global_mesh_and_train_as_one(tmp_path):
    # A second attempt on a fresh port covers another program taking the free port
    # between its discovery and the coordinator binding it.
    results = _run_two_processes(120, tmp_path / "first") or _run_two_processes(
        120, tmp_path / "second"
    )
    assert results is not None, "the two processes did not finish twice in a row"
    assert results[0] == results[1]
    assert results[0]["shape"] == {"dp": 2, "fsdp": 2, "tp": 2, "sp": 1}
    assert len({d for d, _ in results[0]["mesh"]}) == 8
    # dp, the outermost axis, spans the two processes; the inner axes stay within one.
    assert [p for _, p in results[0]["mesh"]] == [0, 0, 0, 0, 1, 1, 1, 1]

    cfg = eqdel.ShardingConfig(axis_dims=(2, 2, 2, 1))
    data = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    spec = cfg.resolve((axes.BATCH, axes.EMBED), shape=data.shape)
    x = jax.device_put(jnp.asarray(data), NamedSharding(cfg.mesh(), spec))
    assert results[0]["spec"] == str(spec)
    assert results[0]["total"] == float(jax.jit(lambda x: (x * x).sum())(x))

    # Three train steps across the two processes equal them in one, and the checkpoint
    # both processes wrote restores here to the same parameters.
    single = three_train_steps.train(cfg)
    np.testing.assert_allclose(results[0]["trained"]["losses"], single["losses"], rtol=1e-6)
    np.testing.assert_allclose(results[0]["trained"]["sums"], single["sums"], rtol=1e-5, atol=1e-6)
    assert results[0]["restored"] == results[0]["trained"]["sums"]
    written = next(d for d in (tmp_path / "first", tmp_path / "second") if d.is_dir())
    assert three_train_steps.restored_sums(cfg, written) == results[0]["trained"]["sums"]
