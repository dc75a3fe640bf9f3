"""Multi-process training on loopback: two processes with four CPU devices each join one
(2, 2, 2, 1) mesh through `jax.distributed.initialize` and run the same program as one
process with eight devices would: the same `ShardingConfig`, the same `eqdel.shard`, the
same train step. The launcher runs both and checks that the losses agree.

    python examples/multiprocess.py --steps 3

On a real cluster run the worker part once per host with the coordinator's address (or
let `jax.distributed.initialize()` read it from SLURM / TPU / Kubernetes environments).
"""

import argparse
import socket
import subprocess
import sys


def worker(coordinator: str | None, process_id: int, steps: int) -> None:
    """Train for `steps` steps as process `process_id` of two, or alone on eight devices
    when `coordinator` is `None`; print the losses."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    if coordinator is None:
        jax.config.update("jax_num_cpu_devices", 8)
    else:
        jax.config.update("jax_num_cpu_devices", 4)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes=2, process_id=process_id)

    import numpy as np
    import optax

    import eqdel
    from eqdel.models import LlamaConfig, LlamaForCausalLM
    from eqdel.train import batches, causal_lm_loss, init_train_state, make_train_step

    cfg = eqdel.ShardingConfig(axis_dims=(2, 2, 2, 1))  # dp crosses the two processes
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    # Every process builds the same model from the same key; `shard` keeps each
    # process's own shards of it.
    model = LlamaForCausalLM(config, key=jax.random.key(0))
    optimizer = optax.adamw(3e-3)
    state = eqdel.shard(init_train_state(model, optimizer, jax.random.key(1)), cfg)
    step = make_train_step(causal_lm_loss, optimizer)
    tokens = np.tile(np.arange(32, dtype=np.int32), (16, 1))
    data = batches(tokens, 8, seed=0, sharding=cfg)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, next(data))
        losses.append(float(metrics["loss"].addressable_data(0)))
    where = f"process {jax.process_index()} of {jax.process_count()}"
    print(
        f"{where}, {jax.local_device_count()} of {jax.device_count()} devices: losses",
        " ".join(f"{x:.6f}" for x in losses),
    )


def _run(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)


def _losses(proc: subprocess.Popen) -> list[float]:
    out = proc.communicate(timeout=300)[0]
    print(out, end="")
    if proc.returncode:
        sys.exit(f"a process failed with exit status {proc.returncode}")
    return [float(x) for x in out.split("losses")[-1].split()]


def launch(steps: int) -> None:
    """Run two processes on loopback, then one process alone, and compare."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    both = [
        _run(["--coordinator", coordinator, "--process-id", str(i), "--steps", str(steps)])
        for i in range(2)
    ]
    two_processes = [_losses(proc) for proc in both]
    one_process = _losses(_run(["--alone", "--steps", str(steps)]))
    gap = max(abs(a - b) for run in two_processes for a, b in zip(run, one_process))
    print(f"max |two processes - one process| loss = {gap:.1e}")
    sys.exit(0 if gap < 1e-5 else 1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--coordinator", help="host:port of process 0 (worker mode)")
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--alone", action="store_true", help="one process, eight devices")
    args = parser.parse_args()
    if args.coordinator is None and not args.alone:
        launch(args.steps)
    else:
        worker(args.coordinator, args.process_id, args.steps)
