"""Rotary position embeddings for every `rope_type` of the Llama family."""

import math
from collections.abc import Mapping

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ._broadcast import trailing

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
"""The Hugging Face `rope_type`s [`eqdel.nn.RotaryEmbedding`][] implements."""


def _base_inv_freq(base: float, dim: int) -> np.ndarray:
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(base) ** exponents)).astype(np.float32)


def _yarn(params: Mapping, base: float, dim: int, max_positions: int):
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_positions / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (
            float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
        )
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp.astype(np.float32)
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    inv_extrapolation = np.float32(1.0) / pos_freqs
    inv_interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv_freq = inv_interpolation * (1 - extrapolation) + inv_extrapolation * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def _llama3(params: Mapping, base: float, dim: int):
    inv_freq = _base_inv_freq(base, dim)
    factor = params["factor"]
    low_factor, high_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low_factor, old_context / high_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq)
    smooth = (np.float32(old_context) / wavelen - low_factor) / (high_factor - low_factor)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def freeze_parameters(parameters: Mapping | tuple | None) -> tuple:
    """Rope parameters as sorted `(name, value)` pairs with lists made tuples: hashable,
    so they can live in static fields and frozen configs."""
    items = dict(parameters or {}).items()
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in items))


class RotaryEmbedding(eqx.Module):
    """Cos/sin tables for rotary position embeddings, computed from positions on the fly.

    Holds no arrays: the frequencies are constants of the configuration, so nothing here is
    trained, sharded or saved.
    """

    head_dim: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)
    rope_type: str = eqx.field(static=True)
    parameters: tuple = eqx.field(static=True)
    max_position_embeddings: int = eqx.field(static=True)
    partial_rotary_factor: float = eqx.field(static=True)

    def __init__(
        self,
        head_dim: int,
        rope_theta: float = 10000.0,
        *,
        rope_type: str = "default",
        parameters: Mapping | None = None,
        max_position_embeddings: int = 2048,
    ):
        """**Arguments:**

        - `head_dim`: the per-head size the rotation applies to.
        - `rope_theta`: the base of the frequencies.
        - `rope_type`: one of `default`, `linear`, `dynamic`, `yarn`, `llama3`, `longrope`.
        - `parameters`: that type's Hugging Face parameters (`factor`,
            `original_max_position_embeddings`, `low_freq_factor`, ...).
        - `max_position_embeddings`: the model's context length.
        """
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"Unknown rope_type {rope_type!r}; supported: {ROPE_TYPES}.")
        parameters = dict(parameters or {})
        self.head_dim = head_dim
        self.rope_theta = float(rope_theta)
        self.rope_type = rope_type
        self.partial_rotary_factor = float(parameters.pop("partial_rotary_factor", 1.0))
        self.parameters = freeze_parameters(parameters)
        self.max_position_embeddings = max_position_embeddings

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def _frequencies(self, positions):
        """Inverse frequencies (possibly depending on the longest position) and the scale
        applied to cos and sin."""
        params, base, dim = dict(self.parameters), self.rope_theta, self.rotary_dim
        kind = self.rope_type
        if kind == "default":
            return jnp.asarray(_base_inv_freq(base, dim)), 1.0
        if kind == "linear":
            return jnp.asarray(_base_inv_freq(base, dim) / np.float32(params["factor"])), 1.0
        if kind == "llama3":
            return jnp.asarray(_llama3(params, base, dim)), 1.0
        if kind == "yarn":
            inv_freq, scale = _yarn(params, base, dim, self.max_position_embeddings)
            return jnp.asarray(inv_freq), scale
        seq_len = (jnp.max(positions) + 1).astype(jnp.float32)
        exponents = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
        if kind == "dynamic":
            factor = float(params["factor"])
            max_positions = float(self.max_position_embeddings)
            seq_len = jnp.maximum(seq_len, max_positions)
            scaled_base = base * ((factor * seq_len / max_positions) - (factor - 1)) ** (
                dim / (dim - 2)
            )
            return 1.0 / (scaled_base ** jnp.asarray(exponents)), 1.0
        # longrope
        original = params["original_max_position_embeddings"]
        factor = params.get("factor") or self.max_position_embeddings / original
        scale = params.get("attention_factor")
        if scale is None:
            scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        base_freq = np.float32(base) ** exponents
        long_freq = 1.0 / (np.asarray(params["long_factor"], np.float32) * base_freq)
        short_freq = 1.0 / (np.asarray(params["short_factor"], np.float32) * base_freq)
        inv_freq = jnp.where(seq_len > original, jnp.asarray(long_freq), jnp.asarray(short_freq))
        return inv_freq, float(scale)

    def __call__(
        self, positions: Int[Array, "*batch seq"]
    ) -> tuple[Float[Array, "*batch seq rotary_dim"], Float[Array, "*batch seq rotary_dim"]]:
        """**Arguments:**

        - `positions`: the position of every token.

        **Returns:**

        `(cos, sin)` tables, float32, with the frequencies repeated over both halves.
        """
        inv_freq, scale = self._frequencies(positions)
        freqs = positions.astype(jnp.float32)[..., None] * trailing(
            inv_freq.astype(jnp.float32), positions.ndim + 1
        )
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def _rotate_half(x):
    """`concatenate([-second_half, first_half])`, written as a reversal of the two halves
    and a sign: XLA's CPU backend runs a concatenation of slices several times slower,
    most of all in the backward pass, where it fuses the slicing of the layer's saved
    queries and keys out of the scan's stack into it."""
    halves = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)[..., ::-1, :]
    sign = jnp.array([-1, 1], x.dtype).reshape((1,) * (x.ndim - 1) + (2, 1))
    return (halves * sign).reshape(x.shape)


def apply_rotary(
    x: Float[Array, "*batch seq heads head_dim"],
    cos: Float[Array, "*batch seq rotary_dim"],
    sin: Float[Array, "*batch seq rotary_dim"],
) -> Float[Array, "*batch seq heads head_dim"]:
    """Rotate the first `rotary_dim` features of every head.

    **Arguments:**

    - `x`: queries or keys.
    - `cos`, `sin`: tables from [`eqdel.nn.RotaryEmbedding`][].

    **Returns:**

    The rotated `x`, in its dtype.
    """
    rotary_dim = cos.shape[-1]
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = rotated * cos + _rotate_half(rotated) * sin
    return rotated if passed.shape[-1] == 0 else jnp.concatenate([rotated, passed], axis=-1)
