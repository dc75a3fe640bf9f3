"""Projections that read the same input, made one matrix product."""

import jax

from ._attention import Attention
from ._mlp import GatedMLP

_FUSABLE = (Attention, GatedMLP)


def fuse_projections(tree):
    """Every attention block's query, key and value projections, and every gated MLP's
    gate and up projections, made one `Linear` each (see `Attention.fused` and
    `GatedMLP.fused`).

    A one-token decode step is a chain of matrix-vector products, each paying a fixed
    cost on top of the bytes it reads; fused, a Llama layer runs four products instead
    of seven. The outputs are the same.

    **Arguments:**

    - `tree`: any pytree holding [`eqdel.nn.Attention`][] or [`eqdel.nn.GatedMLP`][]
        modules (a model, a layer).

    **Returns:**

    The tree with those modules fused; projections that are quantized or carry LoRA
    adapters are left as they are.
    """
    return jax.tree.map(
        lambda m: m.fused() if isinstance(m, _FUSABLE) else m,
        tree,
        is_leaf=lambda m: isinstance(m, _FUSABLE),
    )
