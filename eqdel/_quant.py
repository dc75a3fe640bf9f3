"""Weight quantization as a pure model transformation: int8 per output channel, and NF4
(4-bit normal-float codes, two per byte, one scale per block of inputs)."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int8, UInt8

from ._field import field
from ._paths import get_path, module_paths
from .nn import Linear

NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
"""The 16 NF4 values: quantiles of a standard normal scaled to [-1, 1] (QLoRA)."""


class Int8Linear(eqx.Module):
    """A `Linear` whose `[in, out]` weight is int8 codes times one float scale per output
    channel, dequantised in the matmul."""

    codes: Int8[Array, "*layers in_features out_features"] = field(axes=lambda self: self.axes)
    scales: Float[Array, "*layers out_features"] = field(axes=lambda self: self.axes[1:])
    bias: Float[Array, "*layers out_features"] | None = field(axes=lambda self: self.axes[1:])
    axes: tuple = eqx.field(static=True)
    checkpoint_transposed: bool = eqx.field(static=True)

    def __init__(self, linear: Linear):
        """**Arguments:**

        - `linear`: the layer to quantize (its weight may carry leading layer dimensions).
        """
        w = linear.weight.astype(jnp.float32)
        scales = jnp.max(jnp.abs(w), axis=-2) / 127.0
        safe = jnp.where(scales == 0, 1.0, scales)
        self.codes = jnp.clip(jnp.round(w / safe[..., None, :]), -127, 127).astype(jnp.int8)
        self.scales = scales.astype(linear.weight.dtype)
        self.bias = linear.bias
        self.axes = linear.axes
        self.checkpoint_transposed = linear.checkpoint_transposed

    def weight(self, dtype) -> Float[Array, "*layers in_features out_features"]:
        """The dequantised weight."""
        return self.codes.astype(dtype) * self.scales.astype(dtype)[..., None, :]

    def __call__(
        self, x: Float[Array, "*batch in_features"]
    ) -> Float[Array, "*batch out_features"]:
        y = x @ self.weight(x.dtype)
        return y if self.bias is None else y + self.bias.astype(y.dtype)


class NF4Linear(eqx.Module):
    """A `Linear` whose weight is NF4 codes packed two per byte along the input
    dimension, with the absolute maximum of every `group_size` inputs of every output as
    its scale."""

    codes: UInt8[Array, "*layers half_in out_features"] = field(axes=lambda self: self.axes)
    scales: Float[Array, "*layers groups out_features"] = field(axes=lambda self: self.axes)
    bias: Float[Array, "*layers out_features"] | None = field(axes=lambda self: self.axes[1:])
    group_size: int = eqx.field(static=True)
    axes: tuple = eqx.field(static=True)
    checkpoint_transposed: bool = eqx.field(static=True)

    def __init__(self, linear: Linear, group_size: int = 64):
        """**Arguments:**

        - `linear`: the layer to quantize.
        - `group_size`: inputs per scale; must divide `in_features` and be even.
        """
        w = linear.weight.astype(jnp.float32)
        *lead, n_in, n_out = w.shape
        blocks = w.reshape(*lead, n_in // group_size, group_size, n_out)
        scales = jnp.max(jnp.abs(blocks), axis=-2)
        safe = jnp.where(scales == 0, 1.0, scales)[..., None, :]
        scaled = (blocks / safe)[..., None]
        levels = jnp.asarray(NF4_LEVELS, jnp.float32).reshape((1,) * (scaled.ndim - 1) + (16,))
        nearest = jnp.argmin(jnp.abs(scaled - levels), axis=-1)
        nearest = nearest.reshape(*lead, n_in // 2, 2, n_out).astype(jnp.uint8)
        self.codes = nearest[..., 0, :] | (nearest[..., 1, :] << 4)
        self.scales = scales.astype(linear.weight.dtype)
        self.bias = linear.bias
        self.group_size = group_size
        self.axes = linear.axes
        self.checkpoint_transposed = linear.checkpoint_transposed

    def weight(self, dtype) -> Float[Array, "*layers in_features out_features"]:
        """The dequantised weight."""
        *lead, half, n_out = self.codes.shape
        pairs = jnp.stack([self.codes & 15, self.codes >> 4], axis=-2)
        values = jnp.asarray(NF4_LEVELS, dtype)[pairs.reshape(*lead, 2 * half, n_out)]
        scales = jnp.repeat(self.scales.astype(dtype), self.group_size, axis=-2)
        return values * scales

    def __call__(
        self, x: Float[Array, "*batch in_features"]
    ) -> Float[Array, "*batch out_features"]:
        y = x @ self.weight(x.dtype)
        return y if self.bias is None else y + self.bias.astype(y.dtype)


QUANTIZED = (Int8Linear, NF4Linear)


def dequantized_linear(layer) -> Linear:
    """The plain `Linear` a quantized layer stands for."""
    n_in, n_out = layer.weight(jnp.float32).shape[-2:]
    plain = eqx.filter_eval_shape(
        lambda: Linear(
            n_in,
            n_out,
            axes=layer.axes,
            checkpoint_transposed=layer.checkpoint_transposed,
            key=jax.random.key(0),
        )
    )
    weight = layer.weight(layer.scales.dtype)
    return eqx.tree_at(
        lambda m: (m.weight, m.bias),
        plain,
        (weight, layer.bias),
        is_leaf=lambda x: x is None,
    )


def quantize(model, bits: int = 8, *, group_size: int = 64, targets=None):
    """A new model whose linear layers are quantized: `bits=8` gives int8 codes with a
    scale per output channel ([`eqdel.Int8Linear`][]), `bits=4` NF4 codes with a scale per
    `group_size` inputs ([`eqdel.NF4Linear`][]). Embeddings, norms and biases stay as
    they are.

    **Arguments:**

    - `model`: any eqdel model.
    - `bits`: `8` or `4`.
    - `group_size`: NF4's block of inputs per scale.
    - `targets`: field names of the linear layers to quantize; by default every `Linear`
        but the language-model head (`lm_head`).

    **Returns:**

    The quantized model; [`eqdel.dequantize`][] undoes it (to rounding).

    **Raises:**

    `ValueError` for other `bits`, a `group_size` that does not divide a layer's inputs
    (naming the layer), no matching layer, or a model already quantized.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 8 (int8) or 4 (NF4), not {bits}.")
    if module_paths(model, lambda _, m: isinstance(m, QUANTIZED)):
        raise ValueError("The model is already quantized; dequantize it first.")

    def wanted(name, module):
        if not isinstance(module, Linear):
            return False
        return name != "lm_head" if targets is None else name in set(targets)

    paths = module_paths(model, wanted)
    if not paths:
        raise ValueError(f"No linear layer to quantize (targets={targets}).")
    layers = [get_path(model, p) for p in paths]
    if bits == 4:
        for where, layer in zip(paths, layers):
            n_in = layer.weight.shape[-2]
            if group_size % 2 or n_in % group_size:
                raise ValueError(
                    f"{'.'.join(where)}: group_size {group_size} must be even and divide its "
                    f"{n_in} inputs."
                )
        replaced = [NF4Linear(layer, group_size) for layer in layers]
    else:
        replaced = [Int8Linear(layer) for layer in layers]
    return eqx.tree_at(lambda m: [get_path(m, p) for p in paths], model, replaced)


def dequantize(model):
    """A new model with every quantized linear layer back as a float `Linear` (holding
    the dequantised weights).

    **Raises:**

    `ValueError` when nothing is quantized.
    """
    paths = module_paths(model, lambda _, m: isinstance(m, QUANTIZED))
    if not paths:
        raise ValueError("The model has no quantized layers.")
    plain = [dequantized_linear(get_path(model, p)) for p in paths]
    return eqx.tree_at(lambda m: [get_path(m, p) for p in paths], model, plain)


QUANT_METHOD = "eqdel"
"""The `quant_method` eqdel writes in `config.json`'s `quantization_config`."""


def quantization_config(model) -> dict | None:
    """What `config.json` records of a quantized model, so that
    [`eqdel.from_pretrained`][] can quantize its skeleton the same way; `None` for a
    float model.

    **Raises:**

    `ValueError` for a model mixing int8 and NF4, or NF4 group sizes.
    """
    paths = module_paths(model, lambda _, m: isinstance(m, QUANTIZED))
    if not paths:
        return None
    layers = [get_path(model, p) for p in paths]
    kinds = {(8, None) if isinstance(q, Int8Linear) else (4, q.group_size) for q in layers}
    if len(kinds) > 1:
        raise ValueError(f"The model mixes quantizations {sorted(kinds, key=str)}; save one kind.")
    ((bits, group_size),) = kinds
    return dict(
        quant_method=QUANT_METHOD,
        bits=bits,
        group_size=group_size,
        modules=sorted({p[-1] for p in paths}),
    )
