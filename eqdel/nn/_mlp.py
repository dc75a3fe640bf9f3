"""The gated feed-forward block of Llama-style models."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .. import axes as ax
from ._activations import activation
from ._linear import Linear, concatenated


class GatedMLP(eqx.Module):
    """`down(act(gate(x)) * up(x))`."""

    gate_proj: Linear | None
    up_proj: Linear | None
    gate_up_proj: Linear | None
    down_proj: Linear
    hidden_act: str = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str = "silu",
        *,
        use_bias: bool = False,
        fused: bool = False,
        dtype=jnp.float32,
        initializer_range: float = 0.02,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `hidden_size`, `intermediate_size`: model and feed-forward widths.
        - `hidden_act`: a Hugging Face activation name (`silu`, `gelu`,
            `gelu_pytorch_tanh`, ...).
        - `use_bias`: biases on all three projections.
        - `fused`: one `gate_up_proj` whose output is the gate then the up projection
            (as Phi-3 stores them) instead of two.
        - `dtype`, `initializer_range`: parameter dtype and initialisation scale.
        - `key`: a `jax.random` key.
        """
        activation(hidden_act)
        k_gate, k_up, k_down = jax.random.split(key, 3)
        common = dict(use_bias=use_bias, dtype=dtype, initializer_range=initializer_range)
        into = (ax.EMBED, ax.MLP_INTERMEDIATE)
        if fused:
            self.gate_proj = self.up_proj = None
            self.gate_up_proj = Linear(
                hidden_size, 2 * intermediate_size, axes=into, key=k_gate, **common
            )
        else:
            self.gate_up_proj = None
            self.gate_proj = Linear(
                hidden_size, intermediate_size, axes=into, key=k_gate, **common
            )
            self.up_proj = Linear(hidden_size, intermediate_size, axes=into, key=k_up, **common)
        self.down_proj = Linear(
            intermediate_size, hidden_size, axes=into[::-1], key=k_down, **common
        )
        self.hidden_act = hidden_act

    def fused(self) -> "GatedMLP":
        """This block with its gate and up projections made one `gate_up_proj`: one
        matrix product instead of two, the same outputs. Returned unchanged when they
        are already fused or are not plain `Linear`s (quantized, LoRA)."""
        projections = (self.gate_proj, self.up_proj)
        if not all(type(p) is Linear for p in projections):
            return self
        return eqx.tree_at(
            lambda m: (m.gate_proj, m.up_proj, m.gate_up_proj),
            self,
            (None, None, concatenated(projections)),
            is_leaf=lambda x: x is None,
        )

    def __call__(self, x: Float[Array, "*batch embed"]) -> Float[Array, "*batch embed"]:
        """**Arguments:**

        - `x`: inputs.

        **Returns:**

        The block's output, same shape.
        """
        act = activation(self.hidden_act)
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(act(gate) * up)
