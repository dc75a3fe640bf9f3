"""Quantization judged on a real model and real text: the perplexity of SmolLM2-135M
(or any GGUF / checkpoint given) in float32, int8, NF4 and int4, rounded to nearest and
by GPTQ, against a bitsandbytes-style NF4 reference on the same weights, and (for a GGUF
file) with its Q4_0 / Q4_1 layers kept as int4 and its Q8_0 token embeddings as int8;
with the time each quantization takes and batch-1 decode speed (run with
`EQDEL_CPU_KERNELS=1` for the CPU kernels).

The text scored is the English passage shipped with eqdel (`eqdel perplexity`'s
default); GPTQ calibrates on different text: the shipped corpus and instruction set.

    python benchmarks/quant_perplexity.py [--model FILE] [--calibration-tokens 1024]
"""

import argparse
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _report import interleaved_medians, write

import eqdel
from eqdel._demo import calibration_text, perplexity_text_file
from eqdel._host_memory import rerun_with_huge_pages
from eqdel._paths import get_path, module_paths
from eqdel._quant import NF4_LEVELS
from eqdel.evaluate import perplexity
from eqdel.nn import Linear


def bitsandbytes_style_nf4(model, block: int = 64):
    """The model with every linear layer but the head rounded as bitsandbytes'
    `quantize_4bit(quant_type="nf4", blocksize=block)` does: the PyTorch `[out, in]`
    weight flattened, each block of `block` values scaled by its absolute maximum, every
    value rounded to the nearest NF4 level (in NumPy, float32)."""
    levels = np.asarray(NF4_LEVELS, np.float32)
    paths = module_paths(model, lambda name, m: isinstance(m, Linear) and name != "lm_head")

    def rounded(weight):
        lead = weight.shape[:-2]
        torch_layout = np.swapaxes(np.asarray(weight, np.float32), -1, -2)  # [..., out, in]
        flat = torch_layout.reshape(*lead, -1)
        pad = -flat.shape[-1] % block
        blocks = np.pad(flat, [(0, 0)] * len(lead) + [(0, pad)]).reshape(*lead, -1, block)
        absmax = np.abs(blocks).max(-1, keepdims=True)
        scaled = blocks / np.where(absmax == 0, 1, absmax)
        nearest = levels[np.abs(scaled[..., None] - levels).argmin(-1)]
        values = (nearest * absmax).reshape(*lead, -1)[..., : flat.shape[-1]]
        return jnp.asarray(np.swapaxes(values.reshape(torch_layout.shape), -1, -2))

    weights = [rounded(get_path(model, p).weight) for p in paths]
    return eqx.tree_at(lambda m: [get_path(m, p).weight for p in paths], model, weights)


def _bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


KEPT = "GGUF blocks kept (Q4 as int4, Q8_0 embeddings as int8)"


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="GGUF file or directory (SmolLM2-135M)")
    parser.add_argument("--calibration-tokens", type=int, default=1024)
    parser.add_argument("--calibration-rows", type=int, default=4)
    parser.add_argument("--new", type=int, default=64, help="decode: new tokens at batch 1")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    path = Path(args.model) if args.model else eqdel.smollm2_gguf()
    model = eqdel.from_pretrained(path, progress=False)
    gguf = path.suffix == ".gguf"
    tokenizer = eqdel.load_tokenizer(path)
    text = np.asarray(tokenizer.encode(perplexity_text_file().read_text()).ids, np.int32)
    calibration = np.asarray(tokenizer.encode(calibration_text()).ids, np.int32)
    calibration = calibration[: args.calibration_tokens]
    calibration = jnp.asarray(calibration.reshape(args.calibration_rows, -1))

    recipes = {
        "float32": lambda: model,
        "int8": lambda: eqdel.quantize(model, 8),
        "int8, embeddings too": lambda: eqdel.quantize(model, 8, embeddings=True),
        "int8 g32 (Q8_0's blocks)": lambda: eqdel.quantize(model, 8, group_size=32),
        "int8 GPTQ": lambda: eqdel.quantize(model, 8, calibration=calibration),
        "NF4 g64": lambda: eqdel.quantize(model, 4, group_size=64),
        "NF4 g32": lambda: eqdel.quantize(model, 4, group_size=32),
        "bitsandbytes-style NF4, blocks of 64": lambda: bitsandbytes_style_nf4(model, 64),
        "NF4 g64 GPTQ": lambda: eqdel.quantize(model, 4, group_size=64, calibration=calibration),
        "NF4 g32 GPTQ": lambda: eqdel.quantize(model, 4, group_size=32, calibration=calibration),
        "int4 g32": lambda: eqdel.quantize(model, 4, scheme="int4", group_size=32),
        "int4 g64": lambda: eqdel.quantize(model, 4, scheme="int4", group_size=64),
        "int4 g64 GPTQ": lambda: eqdel.quantize(
            model, 4, scheme="int4", group_size=64, calibration=calibration
        ),
    }
    if gguf:
        recipes[KEPT] = lambda: eqdel.from_pretrained(path, progress=False, keep_quantized=True)
    results, variants = {}, {}
    for name, recipe in recipes.items():
        start = time.perf_counter()
        variants[name] = jax.block_until_ready(recipe())
        seconds = time.perf_counter() - start
        score = perplexity(variants[name], text, progress=False)
        results[name] = dict(
            perplexity=score.perplexity,
            quantize_s=seconds,
            weight_bytes=_bytes(variants[name]),
        )
        print(f"{name}: perplexity {score.perplexity:.3f}, {seconds:.1f} s", flush=True)
    base = results["float32"]["perplexity"]
    for r in results.values():
        r["vs_float"] = r["perplexity"] / base - 1

    prompt = jnp.asarray(text[None, :16])
    decoded = ["float32", "int8", "int8, embeddings too", "int8 g32 (Q8_0's blocks)"]
    decoded += ["NF4 g64", "int4 g32"]
    decoded += [KEPT] if gguf else []
    prepared = {name: variants[name].for_generation() for name in decoded}  # as commands do
    seconds = interleaved_medians(
        {
            name: lambda m=prepared[name]: eqdel.generate(
                m, prompt, max_new_tokens=args.new, eos_token_id=[]
            ).block_until_ready()
            for name in decoded
        },
        args.repeats,
    )
    for name in decoded:
        results[name]["decode_b1_tokens_per_s"] = args.new / seconds[name]

    rows = [
        [
            name,
            f"{r['perplexity']:.3f}",
            "—" if name == "float32" else f"{100 * r['vs_float']:+.2f}%",
            f"{r['quantize_s']:.1f}" if name != "float32" else "",
            f"{r['weight_bytes'] / 2**20:.0f}",
            f"{r['decode_b1_tokens_per_s']:.1f}" if "decode_b1_tokens_per_s" in r else "",
        ]
        for name, r in results.items()
    ]
    write(
        "quant_perplexity",
        dict(model=str(path), args=vars(args), text_tokens=int(text.size), results=results),
        [
            (
                f"{path.name}: perplexity on {text.size} tokens of the shipped English passage; "
                f"GPTQ calibrated on {calibration.size} tokens of other text",
                ["model", "perplexity", "vs float", "quantize s", "MiB", "decode b1 tok/s"],
                rows,
            )
        ],
    )


if __name__ == "__main__":
    rerun_with_huge_pages(sys.argv)
    main()
