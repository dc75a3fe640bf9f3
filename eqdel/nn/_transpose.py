"""A matrix transpose that XLA's CPU backend writes out instead of folding into the
product that reads it."""

import jax.numpy as jnp
from jaxtyping import Array, Float


def largest_divisor(n: int, largest: int) -> int:
    """The largest divisor of `n` up to `largest`."""
    return max(d for d in range(1, min(n, largest) + 1) if n % d == 0)


def tiled_transpose(matrix: Float[Array, "m n"]) -> Float[Array, "n m"]:
    """`matrix.T`, written as a transpose of tiles of up to 64 by 64 entries.

    XLA's CPU backend folds a plain `.T` into the product or copy that reads it; a
    transpose of tiles it writes out, tile by tile. That is faster for the two uses
    here: a Cholesky factor, which LAPACK writes column by column (30 factors of 1,536
    inputs: 0.52 s instead of 1.10 s with the factorisation), and a 16-bit weight
    gradient, whose product runs on the CPU's matrix units only with the tokens as the
    left operand's last dimension (see `eqdel.nn.matmul`).
    """
    m, n = matrix.shape
    row_tile, column_tile = largest_divisor(m, 64), largest_divisor(n, 64)
    tiles = matrix.reshape(m // row_tile, row_tile, n // column_tile, column_tile)
    return jnp.transpose(tiles, (2, 3, 0, 1)).reshape(n, m)
