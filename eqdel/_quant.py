"""Weight quantization as a pure model transformation: int8 per output channel; NF4
(4-bit normal-float codes, two per byte, one scale per block of inputs); int4 (4-bit
integers, two per byte, a scale and an offset per block of inputs); and int8 token
embeddings with a scale per block of each row (which a tied head reads too)."""

import warnings
from concurrent.futures import ThreadPoolExecutor

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int, Int8, Shaped, UInt8
from tqdm.auto import tqdm

from . import axes as ax
from ._field import field
from ._gptq import gptq_round, input_grams
from ._paths import get_path, module_paths
from .nn import Embedding, Linear, _few_rows
from .nn._broadcast import trailing
from .nn._linear import matmul

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

_NF4_MIDPOINTS = (np.float32(NF4_LEVELS[1:]) + np.float32(NF4_LEVELS[:-1])) / np.float32(2)
"""The 15 float32 midpoints between consecutive NF4 levels."""

GROUP_SIZE = 64
"""Inputs per scale of 4-bit quantization, unless told otherwise."""


def _safe(scales: Array) -> Array:
    return jnp.where(scales == 0, 1.0, scales)


def int8_scales(
    w: Float[Array, "*layers in_features out_features"], group_size: int | None = None
) -> Float[Array, "*layers out_features"] | Float[Array, "*layers groups out_features"]:
    """Each output channel's absolute maximum over 127; with a `group_size`, that of
    every block of `group_size` inputs of every output (the last block holds what is left
    when `group_size` does not divide the inputs)."""
    if group_size is None:
        return jnp.max(jnp.abs(w), axis=-2) / 127.0
    return nf4_scales(w, group_size) / 127.0


def int8_codes(w: Float[Array, "*shape"], scales: Float[Array, "..."]) -> Int8[Array, "*shape"]:
    """The int8 code nearest to every weight, given its (broadcast) scale."""
    return jnp.clip(jnp.round(w / _safe(scales)), -127, 127).astype(jnp.int8)


def _blocks(
    x: Shaped[Array, "*layers in_features out_features"], group_size: int, mode: str = "constant"
) -> Shaped[Array, "*layers groups group_size out_features"]:
    """`x` in blocks of `group_size` inputs; a last, partial block is padded with zeros
    (or, with `mode="edge"`, with copies of its last input)."""
    *lead, n_in, n_out = x.shape
    pad = -n_in % group_size
    x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad), (0, 0)], mode=mode)
    return x.reshape(*lead, (n_in + pad) // group_size, group_size, n_out)


def nf4_scales(
    w: Float[Array, "*layers in_features out_features"], group_size: int
) -> Float[Array, "*layers groups out_features"]:
    """The absolute maximum of every block of `group_size` inputs of every output (the
    last block holds what is left when `group_size` does not divide the inputs)."""
    return jnp.max(jnp.abs(_blocks(w, group_size)), axis=-2)


def per_input(
    scales: Float[Array, "*layers groups out_features"], group_size: int, n_in: int
) -> Float[Array, "*layers in_features out_features"]:
    """Block scales repeated for every one of the `n_in` inputs of their block."""
    return jnp.repeat(scales, group_size, axis=-2)[..., :n_in, :]


def nf4_codes(w: Float[Array, "*shape"], scales: Float[Array, "..."]) -> UInt8[Array, "*shape"]:
    """The index of the NF4 level nearest to every weight over its (broadcast) scale: the
    number of midpoints between levels below it (the lower level on a tie)."""
    midpoints = jnp.asarray(_NF4_MIDPOINTS).reshape((1,) * w.ndim + (15,))
    return jnp.sum((w / _safe(scales))[..., None] > midpoints, axis=-1, dtype=jnp.uint8)


def int4_ranges(
    w: Float[Array, "*layers in_features out_features"], group_size: int
) -> tuple[
    Float[Array, "*layers groups out_features"], Float[Array, "*layers groups out_features"]
]:
    """Every block's scale and offset for int4: its range over 15 and its minimum, so
    that codes 0 and 15 land on the block's smallest and largest weight."""
    blocks = _blocks(w, group_size, mode="edge")
    low, high = jnp.min(blocks, axis=-2), jnp.max(blocks, axis=-2)
    return (high - low) / 15, low


def int4_codes(
    w: Float[Array, "*shape"], scales_offsets: tuple[Array, Array]
) -> UInt8[Array, "*shape"]:
    """The int4 code (0 to 15) nearest to every weight, given its (broadcast) scale and
    offset: `w ≈ code * scale + offset`."""
    scales, offsets = scales_offsets
    return jnp.clip(jnp.round((w - offsets) / _safe(scales)), 0, 15).astype(jnp.uint8)


def int4_values(
    w: Float[Array, "*shape"], scales_offsets: tuple[Array, Array]
) -> Float[Array, "*shape"]:
    """The nearest values int4 codes can hold at these scales and offsets."""
    scales, offsets = scales_offsets
    return int4_codes(w, scales_offsets).astype(jnp.float32) * scales + offsets


def int8_values(w: Float[Array, "*shape"], scales: Float[Array, "..."]) -> Float[Array, "*shape"]:
    """The nearest values int8 codes can hold at these scales."""
    return int8_codes(w, scales).astype(jnp.float32) * scales


def nf4_values(w: Float[Array, "*shape"], scales: Float[Array, "..."]) -> Float[Array, "*shape"]:
    """The nearest values NF4 codes can hold at these scales: the level above the last
    midpoint below `w / scale`, picked by a chain of selects (on CPU, faster than
    looking the codes up)."""
    ratio = w / _safe(scales)
    value = jnp.full(ratio.shape, NF4_LEVELS[0], jnp.float32)
    for midpoint, level in zip(_NF4_MIDPOINTS, np.float32(NF4_LEVELS[1:])):
        value = jnp.where(ratio > midpoint, level, value)
    return value * scales


NF4_SHRINKS = tuple(1.0 - 0.02 * i for i in range(26))
"""The fractions of a block's absolute maximum tried as its scale: a smaller scale clips
the block's largest weights but spaces the levels closer for the rest."""


_COARSE = 3


@eqx.filter_jit
def fitted_nf4_scales(
    w: Float[Array, "*layers in_features out_features"],
    group_size: int,
    importance: Float[Array, "*layers in_features"] | None = None,
) -> Float[Array, "*layers groups out_features"]:
    """Every block's scale among `NF4_SHRINKS` of its absolute maximum that rounds the
    block with the least squared error, each input's error weighted by its `importance`
    (by default all alike), found coarse to fine: every third fraction, then the two
    beside the best of those.

    **Arguments:**

    - `w`: the float weight.
    - `group_size`: inputs per block.
    - `importance`: a non-negative weight per input, e.g. the mean square of its
        activations.

    **Returns:**

    One scale per block of every output, float32.
    """
    absmax = nf4_scales(w, group_size)
    shrinks = jnp.asarray(NF4_SHRINKS, jnp.float32)
    blocks = _blocks(w, group_size)
    if importance is None:
        importance = jnp.ones(w.shape[:-1], jnp.float32)
    weighting = _blocks(importance[..., None], group_size)[..., 0]

    def block_errors(shrink):
        error = (blocks - nf4_values(blocks, (absmax * shrink)[..., None, :])) ** 2
        # Weighted and summed as one product: on CPU, 4 times faster than
        # a multiply and a sum.
        return jnp.einsum("...gio,...gi->...go", error, weighting)

    # Every third fraction first, then the two beside the best of those: 11 roundings of
    # the weight instead of 26.
    errors = jax.lax.map(block_errors, shrinks[::_COARSE])
    coarse = jnp.argmin(errors, axis=0) * _COARSE
    best, least = coarse, jnp.min(errors, axis=0)
    for step in (-1, 1):
        near = jnp.clip(coarse + step, 0, len(NF4_SHRINKS) - 1)
        error = block_errors(shrinks[near])
        best, least = jnp.where(error < least, near, best), jnp.minimum(error, least)
    return absmax * shrinks[best]


def _through_dequantised(layer, x: Float[Array, "*batch in_features"]) -> Array:
    """A quantized layer's output: `x` times its dequantised weight, plus its bias.

    With `EQDEL_CPU_KERNELS=1`, a few float32 rows (a decode step) run through a kernel
    that reads the codes as stored (`layer._kernel_product`); otherwise XLA multiplies by
    the dequantised weight, which inside a compiled loop it computes once, before the loop.
    """
    rows = x.reshape(-1, x.shape[-1])
    if _few_rows.usable(rows, layer.codes):
        y = layer._kernel_product(rows).reshape(*x.shape[:-1], -1)
    else:
        y = matmul(x, layer.weight(x.dtype))
    return y if layer.bias is None else y + trailing(layer.bias.astype(y.dtype), y.ndim)


def _reference(layer, names: tuple[str, ...]):
    """`rows @ layer.weight` as a function of the rows and the layer's arrays `names`:
    what a kernel's product is differentiated as."""

    def product(rows, *arrays):
        rebuilt = eqx.tree_at(lambda m: [getattr(m, n) for n in names], layer, list(arrays))
        return matmul(rows, rebuilt.weight(rows.dtype))

    return product


class Int8Linear(eqx.Module):
    """A `Linear` whose `[in, out]` weight is int8 codes times a float scale, one per
    output channel or, with a `group_size`, one per block of `group_size` inputs of every
    output (llama.cpp's Q8_0 blocks are groups of 32); dequantised in the matmul. When
    `group_size` does not divide the inputs, the last block holds the rest."""

    codes: Int8[Array, "*layers in_features out_features"] = field(axes=lambda self: self.axes)
    scales: Float[Array, "*layers out_features"] | Float[Array, "*layers groups out_features"] = (
        field(axes=lambda self: self.axes if self.group_size else self.axes[1:])
    )
    bias: Float[Array, "*layers out_features"] | None = field(axes=lambda self: self.axes[1:])
    group_size: int | None = eqx.field(static=True)
    axes: tuple = eqx.field(static=True)
    checkpoint_transposed: bool = eqx.field(static=True)

    def __init__(
        self,
        linear: Linear,
        scales: Float[Array, "*layers out_features"]
        | Float[Array, "*layers groups out_features"]
        | None = None,
        group_size: int | None = None,
    ):
        """**Arguments:**

        - `linear`: the layer to quantize (its weight may carry leading layer dimensions).
        - `scales`: the scales to round against, kept as given; by default each output
            channel's (or block's) absolute maximum over 127, in the weight's dtype.
        - `group_size`: inputs per scale; `None` for one scale per output channel.

        **Raises:**

        `ValueError` for a `group_size` below 1.
        """
        if group_size is not None and group_size < 1:
            raise ValueError(f"int8 group_size must be at least 1, not {group_size}.")
        w = linear.weight.astype(jnp.float32)
        if scales is None:
            scales = int8_scales(w, group_size).astype(linear.weight.dtype)
        self.group_size = group_size
        self.codes = int8_codes(w, self._per_weight(scales.astype(jnp.float32), w.shape[-2]))
        self.scales = scales
        self.bias = linear.bias
        self.axes = linear.axes
        self.checkpoint_transposed = linear.checkpoint_transposed

    def _per_weight(self, scales: Array, n_in: int) -> Array:
        if self.group_size is None:
            return scales[..., None, :]
        return per_input(scales, self.group_size, n_in)

    def weight(self, dtype) -> Float[Array, "*layers in_features out_features"]:
        """The dequantised weight."""
        scales = self._per_weight(self.scales.astype(dtype), self.codes.shape[-2])
        return self.codes.astype(dtype) * scales

    def _kernel_product(self, rows: Float[Array, "rows in_features"]) -> Array:
        reference = _reference(self, ("codes", "scales"))
        return _few_rows.int8(rows, self.codes, self.scales, self.group_size, reference)

    def __call__(
        self, x: Float[Array, "*batch in_features"]
    ) -> Float[Array, "*batch out_features"]:
        return _through_dequantised(self, x)


class NF4Linear(eqx.Module):
    """A `Linear` whose weight is NF4 codes packed two per byte along the input
    dimension, with the absolute maximum of every `group_size` inputs of every output as
    its scale. When `group_size` does not divide the inputs, the last group holds the
    rest (and an odd input count packs a last half-empty byte)."""

    codes: UInt8[Array, "*layers half_in out_features"] = field(axes=lambda self: self.axes)
    scales: Float[Array, "*layers groups out_features"] = field(axes=lambda self: self.axes)
    bias: Float[Array, "*layers out_features"] | None = field(axes=lambda self: self.axes[1:])
    group_size: int = eqx.field(static=True)
    in_features: int = eqx.field(static=True)
    axes: tuple = eqx.field(static=True)
    checkpoint_transposed: bool = eqx.field(static=True)

    def __init__(
        self,
        linear: Linear,
        group_size: int = GROUP_SIZE,
        scales: Float[Array, "*layers groups out_features"] | None = None,
    ):
        """**Arguments:**

        - `linear`: the layer to quantize.
        - `group_size`: inputs per scale (the last group takes what is left).
        - `scales`: the block scales to round against, kept as given; by default each
            block's absolute maximum, in the weight's dtype.
        """
        w = linear.weight.astype(jnp.float32)
        if scales is None:
            scales = nf4_scales(w, group_size).astype(linear.weight.dtype)
        *lead, n_in, n_out = w.shape
        nearest = nf4_codes(w, per_input(scales.astype(jnp.float32), group_size, n_in))
        nearest = jnp.pad(nearest, [(0, 0)] * len(lead) + [(0, n_in % 2), (0, 0)])
        nearest = nearest.reshape(*lead, -1, 2, n_out)
        self.codes = nearest[..., 0, :] | (nearest[..., 1, :] << 4)
        self.scales = scales
        self.bias = linear.bias
        self.group_size = group_size
        self.in_features = n_in
        self.axes = linear.axes
        self.checkpoint_transposed = linear.checkpoint_transposed

    def weight(self, dtype) -> Float[Array, "*layers in_features out_features"]:
        """The dequantised weight."""
        *lead, half, n_out = self.codes.shape
        pairs = jnp.stack([self.codes & 15, self.codes >> 4], axis=-2)
        codes = pairs.reshape(*lead, 2 * half, n_out)[..., : self.in_features, :]
        values = jnp.asarray(NF4_LEVELS, dtype)[codes]
        return values * per_input(self.scales.astype(dtype), self.group_size, self.in_features)

    def _kernel_product(self, rows: Float[Array, "rows in_features"]) -> Array:
        levels = jnp.asarray(NF4_LEVELS, jnp.float32)
        reference = _reference(self, ("codes", "scales"))
        return _few_rows.nf4(rows, self.codes, self.scales, levels, self.group_size, reference)

    def __call__(
        self, x: Float[Array, "*batch in_features"]
    ) -> Float[Array, "*batch out_features"]:
        return _through_dequantised(self, x)


def _pack_halves(
    codes: UInt8[Array, "*layers in_features out_features"], group_size: int
) -> UInt8[Array, "*layers packed out_features"]:
    """Two codes per byte: in every block of `group_size` inputs, byte `k` holds input
    `k` in its low four bits and input `k + group_size / 2` in its high four bits (a last
    partial block is padded with zero codes)."""
    blocks = _blocks(codes, group_size)
    *lead, groups, _, n_out = blocks.shape
    halves = blocks.reshape(*lead, groups, 2, group_size // 2, n_out)
    packed = halves[..., 0, :, :] | (halves[..., 1, :, :] << 4)
    return packed.reshape(*lead, groups * group_size // 2, n_out)


class Int4Linear(eqx.Module):
    """A `Linear` whose weight is 4-bit codes `q` from 0 to 15 with a scale and an offset
    for every block of `group_size` inputs of every output, `w = q * scale + offset`: the
    form of asymmetric GPTQ checkpoints and of llama.cpp's Q4_0 and Q4_1 blocks. Codes
    pack two per byte as llama.cpp packs them (see `codes`); when `group_size` does not
    divide the inputs, the last block holds the rest."""

    codes: UInt8[Array, "*layers packed out_features"] = field(axes=lambda self: self.axes)
    """In every block of inputs, byte `k` holds input `k` (low four bits) and input
    `k + group_size / 2` (high four bits)."""
    scales: Float[Array, "*layers groups out_features"] = field(axes=lambda self: self.axes)
    offsets: Float[Array, "*layers groups out_features"] = field(axes=lambda self: self.axes)
    bias: Float[Array, "*layers out_features"] | None = field(axes=lambda self: self.axes[1:])
    group_size: int = eqx.field(static=True)
    in_features: int = eqx.field(static=True)
    axes: tuple = eqx.field(static=True)
    checkpoint_transposed: bool = eqx.field(static=True)

    def __init__(
        self,
        linear: Linear,
        group_size: int = GROUP_SIZE,
        scales_offsets: tuple[Array, Array] | None = None,
    ):
        """**Arguments:**

        - `linear`: the layer to quantize.
        - `group_size`: inputs per scale and offset, even (the last group takes what is
            left).
        - `scales_offsets`: the block scales and offsets to round against, kept as
            given; by default each block's range over 15 and its minimum, in the
            weight's dtype.

        **Raises:**

        `ValueError` for an odd `group_size`.
        """
        if group_size < 2 or group_size % 2:
            raise ValueError(f"int4 group_size must be even and at least 2, not {group_size}.")
        w = linear.weight.astype(jnp.float32)
        if scales_offsets is None:
            ranges = int4_ranges(w, group_size)
            scales_offsets = tuple(a.astype(linear.weight.dtype) for a in ranges)
        n_in = w.shape[-2]
        per_weight = tuple(
            per_input(a.astype(jnp.float32), group_size, n_in) for a in scales_offsets
        )
        self.codes = _pack_halves(int4_codes(w, per_weight), group_size)
        self.scales, self.offsets = scales_offsets
        self.bias = linear.bias
        self.group_size = group_size
        self.in_features = n_in
        self.axes = linear.axes
        self.checkpoint_transposed = linear.checkpoint_transposed

    def weight(self, dtype) -> Float[Array, "*layers in_features out_features"]:
        """The dequantised weight."""
        *lead, packed, n_out = self.codes.shape
        groups = self.scales.shape[-2]
        codes = self.codes.reshape(*lead, groups, 1, self.group_size // 2, n_out)
        codes = jnp.concatenate([codes & 15, codes >> 4], axis=-3)
        codes = codes.reshape(*lead, groups, self.group_size, n_out).astype(dtype)
        scales = self.scales.astype(dtype)[..., None, :]
        values = codes * scales + self.offsets.astype(dtype)[..., None, :]
        return values.reshape(*lead, 2 * packed, n_out)[..., : self.in_features, :]

    def _kernel_product(self, rows: Float[Array, "rows in_features"]) -> Array:
        reference = _reference(self, ("codes", "scales", "offsets"))
        return _few_rows.int4(
            rows, self.codes, self.scales, self.offsets, self.group_size, reference
        )

    def __call__(
        self, x: Float[Array, "*batch in_features"]
    ) -> Float[Array, "*batch out_features"]:
        return _through_dequantised(self, x)


EMBEDDING_GROUP = 32
"""Entries of an embedding row per int8 scale (as in llama.cpp's Q8_0 blocks)."""


def _per_entry(
    scales: Float[Array, "*rows groups"], group_size: int, n: int
) -> Float[Array, "*rows n"]:
    """Each entry's scale, from one scale per `group_size` consecutive entries of a row."""
    return jnp.repeat(scales, group_size, axis=-1)[..., :n]


class Int8Embedding(eqx.Module):
    """An `Embedding` whose `[vocab, embed]` table is int8 codes times one float scale
    per `group_size` consecutive entries of a row (the last group of a row takes what is
    left), as llama.cpp's Q8_0 blocks store it. It serves as a tied language-model head
    too (`unembed`)."""

    codes: Int8[Array, "vocab embed"] = field(axes=(ax.VOCAB, ax.EMBED))
    scales: Float[Array, "vocab groups"] = field(axes=(ax.VOCAB, None))
    group_size: int = eqx.field(static=True)

    def __init__(
        self,
        embedding: Embedding,
        group_size: int = EMBEDDING_GROUP,
        scales: Float[Array, "vocab groups"] | None = None,
    ):
        """**Arguments:**

        - `embedding`: the table to quantize.
        - `group_size`: entries of a row per scale.
        - `scales`: the scales to round against, kept as given; by default each group's
            absolute maximum over 127, in the table's dtype.
        """
        w = embedding.weight.astype(jnp.float32)
        n = w.shape[-1]
        if scales is None:
            padded = jnp.pad(jnp.abs(w), [(0, 0), (0, -n % group_size)])
            absmax = jnp.max(padded.reshape(w.shape[0], -1, group_size), axis=-1)
            scales = (absmax / 127.0).astype(embedding.weight.dtype)
        self.codes = int8_codes(w, _per_entry(scales.astype(jnp.float32), group_size, n))
        self.scales = scales
        self.group_size = group_size

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the embeddings it gives: its scales'."""
        return self.scales.dtype

    def weight(self, dtype) -> Float[Array, "vocab embed"]:
        """The dequantised table."""
        scales = _per_entry(self.scales.astype(dtype), self.group_size, self.codes.shape[-1])
        return self.codes.astype(dtype) * scales

    def __call__(self, ids: Int[Array, "*batch"]) -> Float[Array, "*batch embed"]:
        """**Arguments:**

        - `ids`: token ids.

        **Returns:**

        Their dequantised embeddings, in the scales' dtype.
        """
        dtype, n = self.dtype, self.codes.shape[-1]
        codes = jnp.take(self.codes, ids, axis=0).astype(dtype)
        scales = jnp.take(self.scales, ids, axis=0).astype(dtype)
        return codes * _per_entry(scales, self.group_size, n)

    def unembed(self, x: Float[Array, "*batch embed"]) -> Float[Array, "*batch vocab"]:
        """Logits against the dequantised table, for tied language-model heads.

        With `EQDEL_CPU_KERNELS=1`, a few float32 rows (a decode step) run through a
        kernel that reads the codes as stored.

        **Arguments:**

        - `x`: hidden states.

        **Returns:**

        `x @ weight.T`.
        """
        rows = x.reshape(-1, x.shape[-1])
        if not _few_rows.usable(rows, self.codes):
            return matmul(x, self.weight(self.dtype), transposed=True)

        def reference(rows, codes, scales):
            rebuilt = eqx.tree_at(lambda m: (m.codes, m.scales), self, (codes, scales))
            return matmul(rows, rebuilt.weight(rows.dtype), transposed=True)

        y = _few_rows.int8_transposed(rows, self.codes, self.scales, self.group_size, reference)
        return y.reshape(*x.shape[:-1], -1)


QUANTIZED = (Int8Linear, NF4Linear, Int4Linear)


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


SCHEMES = {8: ("int8",), 4: ("nf4", "int4")}
"""The schemes of each bit width; the first is the default."""


NEAREST = {"int8": int8_values, "nf4": nf4_values, "int4": int4_values}
"""Each scheme's rounding to nearest, given every weight's scale (and offset)."""


@eqx.filter_jit
def _fixed_scales(
    weight: Float[Array, "*layers in_features out_features"],
    scheme: str,
    group_size: int | None,
    gram: Float[Array, "*layers in_features in_features"] | None,
):
    """The scales a layer rounds against, in its weight's dtype (a scale and an offset
    for int4), and the same as float32 blocks `[*layers, groups, out_features]` (one
    block of all inputs for int8 per channel). NF4 fits its block scales weighting each
    input by its calibration activations' mean square, from `gram`."""
    w, dtype = weight.astype(jnp.float32), weight.dtype
    if scheme == "int8":
        scales = int8_scales(w, group_size).astype(dtype)
        blocks = scales if group_size else scales[..., None, :]
        return scales, blocks.astype(jnp.float32)
    if scheme == "nf4":
        importance = None if gram is None else jnp.diagonal(gram, axis1=-2, axis2=-1)
        scales = fitted_nf4_scales(w, group_size, importance).astype(dtype)
        return scales, scales.astype(jnp.float32)
    ranges = tuple(a.astype(dtype) for a in int4_ranges(w, group_size))
    return ranges, tuple(a.astype(jnp.float32) for a in ranges)


@eqx.filter_jit
def _built(linear: Linear, scheme: str, group_size: int | None, scales):
    """The quantized layer holding `linear`'s weights (already on the grid of `scales`,
    or rounded to nearest on it)."""
    if scheme == "int8":
        return Int8Linear(linear, scales, group_size)
    if scheme == "nf4":
        return NF4Linear(linear, group_size, scales)
    return Int4Linear(linear, group_size, scales)


def _same_inputs(layers: list[Linear], grams: list[Array]) -> list[list[int]]:
    """The layers grouped by the inputs they read (equal `Σ xᵀx`), such as an attention
    block's query, key and value projections."""
    groups: list[list[int]] = []
    for i, (layer, gram) in enumerate(zip(layers, grams)):
        for group in groups:
            first = group[0]
            if layers[first].weight.shape[:-1] == layer.weight.shape[:-1] and np.array_equal(
                grams[first], gram
            ):
                group.append(i)
                break
        else:
            groups.append([i])
    return groups


@eqx.filter_jit
def _gptq_round_together(
    weights: list[Array], gram: Array, scheme: str, group_size: int | None
) -> tuple[list[Array], list]:
    """GPTQ on layers that read the same inputs, side by side as one wider layer: they
    share one Hessian, so one factorisation and one pass over the inputs serve all, and
    one compiled program fits their scales and rounds them (each output's scales depend
    on that output's weights alone). Returns each layer's rounded weight and scales."""
    scales, blocks = _fixed_scales(jnp.concatenate(weights, axis=-1), scheme, group_size, gram)
    joined = jnp.concatenate([w.astype(jnp.float32) for w in weights], axis=-1)
    rounded = gptq_round(joined, gram, blocks, group_size or joined.shape[-2], NEAREST[scheme])
    splits = np.cumsum([w.shape[-1] for w in weights])[:-1].tolist()
    split = lambda a: jnp.split(a, splits, axis=-1)  # noqa: E731
    per_layer = list(zip(*map(split, scales))) if isinstance(scales, tuple) else split(scales)
    return jnp.split(rounded, splits, axis=-1), per_layer


def _gptq_rounded(
    layers: list[Linear],
    grams: list[Array],
    scheme: str,
    group_size: int | None,
    progress: bool,
) -> tuple[list[Linear], list]:
    """The layers with their weights rounded by GPTQ, those that read the same inputs
    together, and the scales they were rounded against."""
    rounded, scales = list(layers), [None] * len(layers)
    groups = _same_inputs(layers, grams)

    def placed(group):
        weights = [layers[i].weight for i in group]
        # Replicated, GPTQ's loop over rows needs no collectives.
        everywhere = weights[0].sharding
        if isinstance(everywhere, NamedSharding):
            everywhere = NamedSharding(everywhere.mesh, PartitionSpec())
        return jax.device_put((weights, grams[group[0]]), everywhere)

    def compiled(group):
        return _gptq_round_together.lower(*placed(group), scheme, group_size).compile()

    # Each group's program compiles in the background while the group before it rounds.
    with ThreadPoolExecutor(1) as compiler:
        programs = [compiler.submit(compiled, group) for group in groups]
        for group, program in tqdm(
            list(zip(groups, programs)), disable=not progress, unit="layer group"
        ):
            parts, part_scales = program.result()(*placed(group), scheme, group_size)
            for i, part, s in zip(group, parts, part_scales):
                part = jax.device_put(part, layers[i].weight.sharding)
                rounded[i] = eqx.tree_at(lambda m: m.weight, layers[i], part)
                scales[i] = s
    return rounded, scales


def checked_request(
    bits: int, scheme: str | None, group_size: int | None
) -> tuple[str, int | None]:
    """The scheme and group size asked for, checked against `bits`, with the defaults
    filled in: the first scheme of `bits`, and `GROUP_SIZE` for 4 bits."""
    if bits not in SCHEMES:
        raise ValueError(f"bits must be 8 (int8) or 4 (NF4 or int4), not {bits}.")
    scheme = SCHEMES[bits][0] if scheme is None else scheme
    if group_size is None and bits == 4:
        group_size = GROUP_SIZE
    if scheme not in SCHEMES[bits]:
        raise ValueError(f"{bits}-bit quantization is one of {SCHEMES[bits]}, not {scheme!r}.")
    if group_size is not None and group_size < 1:
        raise ValueError(f"group_size must be at least 1, not {group_size}.")
    if scheme == "int4" and group_size % 2:
        raise ValueError(f"int4 group_size must be even, not {group_size}.")
    return scheme, group_size


def quantize(
    model,
    bits: int = 8,
    *,
    scheme: str | None = None,
    group_size: int | None = None,
    targets=None,
    calibration: Int[Array, "batch seq"] | None = None,
    progress: bool = True,
    embeddings: bool = False,
):
    """A new model whose linear layers are quantized:

    - `bits=8`: int8 codes with a scale per output channel, or per `group_size` inputs
        when one is given ([`eqdel.Int8Linear`][]);
    - `bits=4` (`scheme="nf4"`, the default): NF4 codes with a scale per `group_size`
        inputs ([`eqdel.NF4Linear`][]);
    - `bits=4, scheme="int4"`: 4-bit integer codes with a scale and an offset per
        `group_size` inputs ([`eqdel.Int4Linear`][]), as asymmetric GPTQ checkpoints and
        llama.cpp's Q4_1 blocks hold them.

    Norms and biases stay as they are, and so do the embeddings unless `embeddings`.

    Weights round to the nearest code unless `calibration` tokens are given: then every
    layer's codes are chosen by GPTQ (Frantar et al., 2022), which rounds one input at a
    time, the most active first, and moves each rounding error onto the inputs not yet
    rounded so that the layer's outputs on the calibration activations change least. The
    activations come from one pass of the float model (not layer by layer over the
    quantized one).

    Scales are fixed before rounding. NF4 block scales are fitted: each is the fraction
    of its block's absolute maximum (from 1 down to ½) that rounds the block with the
    least squared error, weighting each input by its calibration activations' mean square
    when there are any. int4 blocks span their smallest to their largest weight. int8
    scales are each output channel's (or block's) absolute maximum.

    **Arguments:**

    - `model`: any eqdel model.
    - `bits`: `8` or `4`.
    - `scheme`: for 4 bits, `"nf4"` (default) or `"int4"`.
    - `group_size`: the block of inputs per scale (even for int4); by default 64 for
        4 bits and, for int8, none (a scale per output channel). A layer whose inputs
        it does not divide gets a last, smaller block with its own scale (and a warning
        says so).
    - `targets`: field names of the linear layers to quantize; by default every `Linear`
        but the language-model head (`lm_head`).
    - `calibration`: `[batch, seq]` token ids for GPTQ; text like the model's use.
    - `progress`: show a progress bar over GPTQ's layers.
    - `embeddings`: also quantize the token embeddings, rounded to nearest, as an
        [`eqdel.Int8Embedding`][] with a scale per 32 entries of each row (llama.cpp's
        Q8_0); a language-model head tied to them reads the codes too. With
        `targets=[]`, only the embeddings.

    **Returns:**

    The quantized model; [`eqdel.dequantize`][] undoes it (to rounding).

    **Raises:**

    `ValueError` for other `bits` or schemes, a `group_size` below 1 (or odd, for int4),
    no matching layer, or a model already quantized.
    """
    scheme, group_size = checked_request(bits, scheme, group_size)
    if module_paths(model, lambda _, m: isinstance(m, (*QUANTIZED, Int8Embedding))):
        raise ValueError("The model is already quantized; dequantize it first.")

    def wanted(name, module):
        if not isinstance(module, Linear):
            return False
        return name != "lm_head" if targets is None else name in set(targets)

    paths = module_paths(model, wanted)
    if paths:
        model = quantize_linears(model, paths, scheme, group_size, calibration, progress)
    elif not (embeddings and targets is not None):
        raise ValueError(f"No linear layer to quantize (targets={targets}).")
    return with_int8_embeddings(model) if embeddings else model


def with_int8_embeddings(model, group_size: int = EMBEDDING_GROUP):
    """`model` with its token embeddings rounded to an `Int8Embedding`."""
    table = Int8Embedding(model.get_input_embeddings(), group_size)
    return eqx.tree_at(lambda m: m.get_input_embeddings(), model, table)


def quantize_linears(
    model, paths, scheme: str, group_size: int | None, calibration, progress: bool
):
    """`model` with the linear layers at `paths` quantized (see `quantize`)."""
    layers = [get_path(model, p) for p in paths]
    if group_size is not None:
        for n_in in sorted({layer.weight.shape[-2] for layer in layers}):
            if n_in % group_size == 0:
                continue
            warnings.warn(
                f"layers with {n_in} inputs: groups of {group_size} leave a last group of "
                f"{n_in % group_size} inputs, with its own scale.",
                stacklevel=3,
            )
    if calibration is None:
        scales = [_fixed_scales(layer.weight, scheme, group_size, None)[0] for layer in layers]
    else:
        grams = input_grams(model, paths, calibration)
        layers, scales = _gptq_rounded(layers, grams, scheme, group_size, progress)
    replaced = [_built(layer, scheme, group_size, s) for layer, s in zip(layers, scales)]
    return eqx.tree_at(lambda m: [get_path(m, p) for p in paths], model, replaced)


def _dequantized_embedding(table: Int8Embedding) -> Embedding:
    """The float `Embedding` an `Int8Embedding` stands for."""
    vocab, embed = table.codes.shape
    plain = eqx.filter_eval_shape(lambda: Embedding(vocab, embed, key=jax.random.key(0)))
    return eqx.tree_at(lambda m: m.weight, plain, table.weight(table.dtype))


def dequantize(model):
    """A new model with every quantized linear layer back as a float `Linear` (holding
    the dequantised weights), and quantized embeddings back as an `Embedding`.

    **Raises:**

    `ValueError` when nothing is quantized.
    """
    paths = module_paths(model, lambda _, m: isinstance(m, (*QUANTIZED, Int8Embedding)))
    if not paths:
        raise ValueError("The model has no quantized layers.")

    def plain(module):
        if isinstance(module, Int8Embedding):
            return _dequantized_embedding(module)
        return dequantized_linear(module)

    replaced = [plain(get_path(model, p)) for p in paths]
    return eqx.tree_at(lambda m: [get_path(m, p) for p in paths], model, replaced)


QUANT_METHOD = "eqdel"
"""The `quant_method` eqdel writes in `config.json`'s `quantization_config`."""


_SCHEME_OF = {Int8Linear: "int8", NF4Linear: "nf4", Int4Linear: "int4"}


def quantization_config(model) -> dict | None:
    """What `config.json` records of a quantized model, so that
    [`eqdel.from_pretrained`][] can quantize its skeleton the same way; `None` for a
    float model.

    **Raises:**

    `ValueError` for a model mixing schemes or group sizes.
    """
    paths = module_paths(model, lambda _, m: isinstance(m, QUANTIZED))
    tables = module_paths(model, lambda _, m: isinstance(m, Int8Embedding))
    if not paths and not tables:
        return None
    layers = [get_path(model, p) for p in paths]
    kinds = {(_SCHEME_OF[type(q)], getattr(q, "group_size", None)) for q in layers}
    if len(kinds) > 1:
        raise ValueError(f"The model mixes quantizations {sorted(kinds, key=str)}; save one kind.")
    ((scheme, group_size),) = kinds or {("int8", None)}
    config = dict(
        quant_method=QUANT_METHOD,
        bits=8 if scheme == "int8" else 4,
        scheme=scheme,
        group_size=group_size,
        modules=sorted({p[-1] for p in paths}),
    )
    if tables:
        config["embedding_group_size"] = get_path(model, tables[0]).group_size
    return config
