"""Explicit broadcasting, since eqdel runs under rank-promotion errors."""

from jaxtyping import Array


def trailing(vector: Array, ndim: int) -> Array:
    """Reshape `vector` to `ndim` dimensions, its own last: ready to combine with an array
    whose trailing dimensions it matches."""
    return vector.reshape((1,) * (ndim - vector.ndim) + vector.shape)
