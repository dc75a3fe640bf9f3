"""Float32 products of many rows through OpenBLAS against XLA's own, in one process and
alternating: each product of SmolLM2-135M's prefill shapes alone, then the model's
prefill and AdamW train step (4 x 256 tokens) with every linear layer's and the head's
forward products, and attention's outside differentiation, routed either way (their
gradients are XLA's products). Needs
`EQDEL_CPU_KERNELS=1` and `pip install "eqdel[cpu]"`.

    EQDEL_CPU_KERNELS=1 python benchmarks/openblas.py [--model FILE.gguf] [--repeats 10]
"""

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _report import interleaved_medians, interleaved_times, write

import eqdel
from eqdel._demo import perplexity_text_file
from eqdel._host_memory import rerun_with_huge_pages
from eqdel.nn import _few_rows
from eqdel.train import causal_lm_loss, init_train_state, make_train_step

# (name, rows, weight as stored, whether it is stored [out, in])
PRODUCTS = [
    ("gate, up", (1024, 576), (576, 1536), False),
    ("down", (1024, 1536), (1536, 576), False),
    ("query, output", (1024, 576), (576, 576), False),
    ("key, value", (1024, 576), (576, 192), False),
    ("tied head", (1024, 576), (49152, 576), True),
]


def _off(a, b) -> bool:
    return False


def products(repeats: int) -> list[list]:
    """GFLOP/s of each product through XLA and OpenBLAS."""
    rows = []
    for name, rows_shape, weight_shape, transposed in PRODUCTS:
        a = jax.random.normal(jax.random.key(0), rows_shape)
        b = jax.random.normal(jax.random.key(1), weight_shape)
        xla = jax.jit(lambda a, b, t=transposed: a @ (b.T if t else b))
        blas = jax.jit(lambda a, b, t=transposed: _few_rows.gemm(a, b, t))
        gap = float(jnp.max(jnp.abs(xla(a, b) - blas(a, b))))
        m, k = rows_shape
        n = weight_shape[0] if transposed else weight_shape[1]
        timed = {"xla": xla, "openblas": blas}
        seconds = interleaved_medians(
            {key: lambda f=f, a=a, b=b: f(a, b).block_until_ready() for key, f in timed.items()},
            repeats,
        )
        rate = {key: 2 * m * k * n / s / 1e9 for key, s in seconds.items()}
        rows.append(
            [
                name,
                f"{m} x {k} x {n}",
                f"{rate['xla']:.0f}",
                f"{rate['openblas']:.0f}",
                f"{gap:.1e}",
            ]
        )
    return rows


def model_steps(path: Path, repeats: int) -> dict:
    """Seconds per prefill and train step with the products through XLA and OpenBLAS."""
    tokenizer = eqdel.load_tokenizer(path)
    text = perplexity_text_file().read_text() * 2
    ids = np.asarray(tokenizer.encode(text).ids[: 4 * 256], np.int32).reshape(4, 256)
    batch = {"input_ids": jnp.asarray(ids)}
    model = eqdel.from_pretrained(
        path, dtype="float32", progress=False, remat_policy="dots_with_no_batch_dims_saveable"
    )
    optimizer = optax.adamw(1e-5)
    routes = {name: getattr(_few_rows, name) for name in ("gemm_usable", "batched_gemm_usable")}
    forwards, steps, states, losses = {}, {}, {}, {"xla": [], "openblas": []}
    for route in ("xla", "openblas"):  # each traced with its products' route
        for name, usable in routes.items():
            setattr(_few_rows, name, usable if route == "openblas" else _off)
        forwards[route] = jax.jit(lambda model, ids: model(ids).logits)
        forwards[route](model, ids).block_until_ready()
        steps[route] = make_train_step(causal_lm_loss, optimizer)
        own = jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, model)
        states[route] = init_train_state(own, optimizer, jax.random.key(0))
        states[route], _ = steps[route](states[route], batch)  # compiles it
    for name, usable in routes.items():
        setattr(_few_rows, name, usable)
    gap = float(jnp.max(jnp.abs(forwards["xla"](model, ids) - forwards["openblas"](model, ids))))

    def step(route):
        states[route], metrics = steps[route](states[route], batch)
        losses[route].append(float(metrics["loss"]))

    prefill = interleaved_times(
        {route: lambda r=route: forwards[r](model, ids).block_until_ready() for route in forwards},
        repeats,
    )
    train = interleaved_times({route: lambda r=route: step(r) for route in steps}, repeats)
    return {
        "prefill_s": prefill,
        "train_s": train,
        "max_abs_logit_difference": gap,
        "losses": losses,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not _few_rows.gemm_available():
        sys.exit('needs EQDEL_CPU_KERNELS=1, a C++ compiler and pip install "eqdel[cpu]"')
    path = Path(args.model) if args.model else eqdel.smollm2_gguf()
    product_rows = products(max(args.repeats, 15))
    model = model_steps(path, args.repeats)
    model_rows = []
    for task in ("prefill_s", "train_s"):
        seconds = {route: float(np.median(t)) for route, t in model[task].items()}
        spread = {route: f"{min(t):.2f}-{max(t):.2f}" for route, t in model[task].items()}
        model_rows.append(
            [
                task[:-2],
                f"{seconds['xla']:.3f} ({spread['xla']})",
                f"{seconds['openblas']:.3f} ({spread['openblas']})",
                f"{seconds['xla'] / seconds['openblas']:.2f}x",
            ]
        )
    same_losses = np.allclose(model["losses"]["xla"], model["losses"]["openblas"], atol=1e-3)
    write(
        "openblas",
        {"model": str(path), "args": vars(args), "products": product_rows, **model},
        [
            (
                "float32 products, GFLOP/s (medians)",
                ["product", "m x k x n", "XLA", "OpenBLAS", "max abs difference"],
                product_rows,
            ),
            (
                f"{path.name}, 4 x 256 tokens, seconds (median, range); logits within "
                f"{model['max_abs_logit_difference']:.1e}; train losses equal to 1e-3: "
                f"{same_losses}",
                ["", "XLA", "OpenBLAS", "speedup"],
                model_rows,
            ),
        ],
    )


if __name__ == "__main__":
    rerun_with_huge_pages(sys.argv)
    main()
