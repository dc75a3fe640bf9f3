"""Sharded inference on eight simulated CPU devices: a checkpoint loaded straight onto a
(dp=1, fsdp=2, tp=2, sp=2) mesh, the placement of every parameter printed, and the sharded
logits and greedy tokens checked against one device.

    python examples/sharded_inference.py [path/to/checkpoint] [--axis-dims 1,2,2,2]

Without a checkpoint a tiny random-weight Llama is written first. On real accelerators
drop the `jax_num_cpu_devices` line: the same code uses the devices JAX finds.
"""

import argparse
import tempfile
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from load_and_generate import tiny_checkpoint  # noqa: E402

import eqdel  # noqa: E402


def main(model_dir: Path, axis_dims: tuple[int, ...]) -> None:
    cfg = eqdel.ShardingConfig(axis_dims=axis_dims)
    print(f"mesh {dict(cfg.mesh().shape)} over {jax.device_count()} devices")
    sharded = eqdel.from_pretrained(model_dir, sharding=cfg, progress=False)
    print(eqdel.explain_sharding(sharded, cfg))
    single = eqdel.from_pretrained(model_dir, progress=False)

    vocab = sharded.config.vocab_size
    ids = jax.random.randint(jax.random.key(0), (4, 32), 0, vocab)
    forward = jax.jit(lambda model, ids: model(ids).logits)
    difference = np.max(
        np.abs(np.asarray(forward(sharded, ids)) - np.asarray(forward(single, ids)))
    )
    print(f"max |sharded - single device| logits = {float(difference):.2e}")

    prompt = ids[:, :8]
    same = np.array_equal(
        eqdel.generate(sharded, prompt, max_new_tokens=16),
        eqdel.generate(single, prompt, max_new_tokens=16),
    )
    print(f"sharded greedy tokens equal single-device tokens: {bool(same)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_dir", nargs="?", type=Path, help="Hugging Face checkpoint")
    parser.add_argument("--axis-dims", default="1,2,2,2", help="dp,fsdp,tp,sp sizes")
    args = parser.parse_args()
    dims = tuple(int(d) for d in args.axis_dims.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        main(args.model_dir or tiny_checkpoint(Path(tmp) / "tiny-llama"), dims)
