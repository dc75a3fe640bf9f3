"""Activation functions under their Hugging Face names."""

import functools

import jax
import jax.numpy as jnp


def _quick_gelu(x):
    return x * jax.nn.sigmoid(1.702 * x)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_fast": functools.partial(jax.nn.gelu, approximate=True),
    "quick_gelu": _quick_gelu,
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
}
"""Hugging Face `hidden_act` names and the functions they mean."""


def activation(name: str):
    """The activation function called `name` in Hugging Face configs.

    **Raises:**

    `ValueError` listing the known names when `name` is not one of them.
    """
    if name not in ACTIVATIONS:
        raise ValueError(f"Unknown activation {name!r}; known: {sorted(ACTIVATIONS)}.")
    return ACTIVATIONS[name]
