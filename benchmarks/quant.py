"""Weight memory, greedy decode throughput and agreement with float of a random-weight
Llama in float32, int8 and NF4 (rounded to nearest, and by GPTQ on calibration tokens),
in one run.

    python benchmarks/quant.py [--batch 4 --prompt 64 --new 64]
"""

import argparse
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
from _report import LLAMA_SIZES, interleaved_medians, write

import eqdel
from eqdel._host_memory import rerun_with_huge_pages
from eqdel.models import LlamaConfig, LlamaForCausalLM

SIZES = {**LLAMA_SIZES, "vocab_size": 4096}


def _bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds of decode")
    parser.add_argument("--group-size", type=int, default=16, help="must divide 688")
    args = parser.parse_args()

    model = LlamaForCausalLM(LlamaConfig(**SIZES), key=jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (args.batch, args.prompt), 3, SIZES["vocab_size"])
    calibration = jax.random.randint(
        jax.random.key(2), (4 * args.batch, args.prompt), 3, SIZES["vocab_size"]
    )
    recipes = {
        "float32": lambda: model,
        "int8": lambda: eqdel.quantize(model, 8),
        "int8 + gptq": lambda: eqdel.quantize(model, 8, calibration=calibration),
        "nf4": lambda: eqdel.quantize(model, 4, group_size=args.group_size),
        "nf4 + gptq": lambda: eqdel.quantize(
            model, 4, group_size=args.group_size, calibration=calibration
        ),
    }
    variants, quantize_s = {}, {}
    for name, recipe in recipes.items():
        start = time.perf_counter()
        variants[name] = jax.block_until_ready(recipe())
        quantize_s[name] = time.perf_counter() - start
    forward = jax.jit(lambda m: m(ids).logits)
    reference = forward(model)
    prepared = {name: variant.for_generation() for name, variant in variants.items()}
    decode_s = interleaved_medians(
        {
            name: lambda m=prepared[name]: eqdel.generate(
                m, ids, max_new_tokens=args.new, eos_token_id=[]
            ).block_until_ready()
            for name in variants
        },
        args.repeats,
    )
    results = {}
    for name, variant in variants.items():
        logits = forward(variant)
        log_p, log_q = jax.nn.log_softmax(reference), jax.nn.log_softmax(logits)
        results[name] = {
            "quantize_s": quantize_s[name],
            "model_bytes": _bytes(variant),
            "decoder_linear_bytes": sum(
                x.nbytes
                for x in jax.tree.leaves(eqx.filter(variant.model.layers, eqx.is_array))
                if x.ndim >= 3
            ),
            "tokens_per_s": args.batch * args.new / decode_s[name],
            "top1_agreement": float(jnp.mean(logits.argmax(-1) == reference.argmax(-1))),
            "kl": float(jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1))),
        }
    base = results["float32"]
    rows = [
        [
            name,
            f"{r['model_bytes'] / 2**20:.1f}",
            f"{r['decoder_linear_bytes'] / base['decoder_linear_bytes']:.3f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{100 * r['top1_agreement']:.1f}%",
            f"{r['kl']:.2e}",
            f"{r['quantize_s']:.1f}",
        ]
        for name, r in results.items()
    ]
    write(
        "quant",
        {"sizes": SIZES, "args": vars(args), "results": results},
        [
            (
                f"Greedy decode, batch {args.batch}, prompt {args.prompt}, {args.new} new tokens; "
                f"random weights, hidden {SIZES['hidden_size']}, {SIZES['num_hidden_layers']} "
                f"layers, vocab {SIZES['vocab_size']}, NF4 group {args.group_size}; GPTQ "
                f"calibrated on {4 * args.batch} x {args.prompt} other random tokens",
                [
                    "weights",
                    "model MiB",
                    "decoder linears vs float32",
                    "decode tokens/s",
                    "top-1 agreement",
                    "KL",
                    "quantize s",
                ],
                rows,
            )
        ],
    )


if __name__ == "__main__":
    rerun_with_huge_pages(sys.argv)
    main()
