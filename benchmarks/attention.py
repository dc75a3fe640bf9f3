"""Peak memory and time of causal attention, forward and backward, against sequence
length: the vanilla kernel (the whole score matrix) vs the chunked one (blocks with an
online softmax). Memory is XLA's own account of the compiled program's temporaries;
a run is timed only when it fits comfortably in this machine's memory.

    python benchmarks/attention.py [--lengths 1024,2048,4096,8192,16384]
"""

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from _report import write

from eqdel._host_memory import rerun_with_huge_pages
from eqdel.attention import AttentionMask, chunked_attention, vanilla_attention

KERNELS = {"vanilla": vanilla_attention, "chunked": chunked_attention}


def _memory_budget() -> int:
    """Half of this machine's physical memory, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def measure(kernel, length: int, heads: int, kv_heads: int, head_dim: int, repeats: int):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, length, heads, head_dim))
    k = jax.random.normal(keys[1], (1, length, kv_heads, head_dim))
    v = jax.random.normal(keys[2], (1, length, kv_heads, head_dim))
    index = jnp.arange(length)[None]
    mask = AttentionMask(index, index, jnp.ones((1, length), bool))

    def loss(q, k, v):
        return jnp.sum(kernel(q, k, v, mask, scale=head_dim**-0.5))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    compiled = step.lower(q, k, v).compile()
    memory = compiled.memory_analysis()
    temporaries = memory.temp_size_in_bytes
    row = {"length": length, "temp_bytes": temporaries, "seconds": None}
    if temporaries > _memory_budget():
        return row
    jax.block_until_ready(compiled(q, k, v))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - start)
    row["seconds"] = statistics.median(times)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    results = {
        name: [
            measure(kernel, n, args.heads, args.kv_heads, args.head_dim, args.repeats)
            for n in lengths
        ]
        for name, kernel in KERNELS.items()
    }

    def mib(row):
        return f"{row['temp_bytes'] / 2**20:,.0f}"

    def seconds(row):
        return "not run (too large)" if row["seconds"] is None else f"{row['seconds']:.2f}"

    rows = [
        [n, mib(v), mib(c), seconds(v), seconds(c)]
        for n, v, c in zip(lengths, results["vanilla"], results["chunked"], strict=True)
    ]
    write(
        "attention",
        {"shape": vars(args), "results": results},
        [
            (
                f"Causal attention, forward + backward, float32, batch 1, {args.heads} query "
                f"heads over {args.kv_heads} key/value heads of {args.head_dim}, blocks 128",
                [
                    "length",
                    "vanilla temp MiB",
                    "chunked temp MiB",
                    "vanilla s",
                    "chunked s",
                ],
                rows,
            )
        ],
    )


if __name__ == "__main__":
    rerun_with_huge_pages(sys.argv)
    main()
