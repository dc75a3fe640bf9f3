"""Greedy decode throughput of eqdel (compiled loop, float and int8 cache) vs transformers
generate on the same random-weight Llama, and the cache memory of each.

    python benchmarks/generate.py [--batch 4 --prompt 64 --new 64]
"""

import argparse
import sys
import tempfile
import time

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from _report import LLAMA_SIZES, torch_greedy, write

import eqdel
from eqdel._host_memory import rerun_with_huge_pages

SIZES = {**LLAMA_SIZES, "vocab_size": 4096}


def _seconds(fn) -> float:
    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES)).eval()
    ids = np.random.RandomState(0).randint(3, SIZES["vocab_size"], (args.batch, args.prompt))
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        for name, int8 in (("eqdel", False), ("eqdel int8 cache", True)):
            model = eqdel.from_pretrained(tmp, progress=False, quantize_kv_cache=int8)
            run = lambda m=model: eqdel.generate(  # noqa: E731
                m, jnp.asarray(ids), max_new_tokens=args.new, eos_token_id=[]
            ).block_until_ready()
            seconds = _seconds(run)
            cache = model.init_cache(args.batch, args.prompt + args.new)
            results[name] = {
                "tokens_per_s": args.batch * args.new / seconds,
                "cache_bytes": cache.nbytes,
                "tokens": np.asarray(run()).tolist(),
            }

    hf_run = torch_greedy(hf_model, ids, args.new)
    seconds = _seconds(hf_run)
    hf_tokens = hf_run().numpy()
    results["transformers"] = {"tokens_per_s": args.batch * args.new / seconds}
    for name in ("eqdel", "eqdel int8 cache"):
        same = np.array_equal(np.asarray(results[name].pop("tokens")), hf_tokens)
        results[name]["identical_to_transformers"] = bool(same)
        rows.append(
            [
                name,
                f"{results[name]['tokens_per_s']:,.0f}",
                f"{results[name]['cache_bytes'] / 2**20:.2f} MiB",
                same,
            ]
        )
    rows.append(
        [
            "transformers (DynamicCache)",
            f"{results['transformers']['tokens_per_s']:,.0f}",
            "-",
            "-",
        ]
    )
    write(
        "generate",
        {"sizes": SIZES, "args": vars(args), "results": results},
        [
            (
                f"Greedy decode, float32, batch {args.batch}, prompt {args.prompt}, "
                f"{args.new} new tokens",
                ["", "new tokens/s", "cache", "tokens identical to transformers"],
                rows,
            )
        ],
    )


if __name__ == "__main__":
    rerun_with_huge_pages(sys.argv)
    main()
