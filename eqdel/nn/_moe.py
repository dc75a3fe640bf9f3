"""A sparse mixture of gated-MLP experts with a top-k router (Mixtral's block).

Tokens are grouped by expert with one sort and each group runs only through its own
expert with `jax.lax.ragged_dot`, so the cost is that of `top_k` dense MLPs, not of
every expert on every token.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .. import axes as ax
from .._field import field
from ._activations import activation
from ._linear import Linear


class ExpertLinear(eqx.Module):
    """One `[in, out]` weight per expert, stacked on a leading `EXPERT` axis (sharded on
    `ep` by the default rules). Applied with [`eqdel.nn.ExpertLinear.grouped`][]."""

    weight: Float[Array, "experts in_features out_features"] = field(
        axes=lambda self: (ax.EXPERT, *self.axes)
    )
    axes: tuple = eqx.field(static=True)

    def __init__(
        self,
        experts: int,
        in_features: int,
        out_features: int,
        *,
        axes: tuple,
        dtype=jnp.float32,
        initializer_range: float = 0.02,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `experts`: how many experts.
        - `in_features`, `out_features`: each expert's input and output sizes.
        - `axes`: the semantic axes of each expert's weight, `(input, output)`.
        - `dtype`, `initializer_range`: parameter dtype and initialisation scale.
        - `key`: a `jax.random` key.
        """
        shape = (experts, in_features, out_features)
        self.weight = initializer_range * jax.random.normal(key, shape, dtype)
        self.axes = tuple(axes)

    def grouped(
        self, x: Float[Array, "rows in_features"], group_sizes: Int[Array, " experts"]
    ) -> Float[Array, "rows out_features"]:
        """**Arguments:**

        - `x`: rows sorted by expert.
        - `group_sizes`: how many consecutive rows belong to each expert.

        **Returns:**

        Every row through its own expert's weight.
        """
        return jax.lax.ragged_dot(x, self.weight.astype(x.dtype), group_sizes)


class Experts(eqx.Module):
    """The experts' gated MLPs: `w2(act(w1(x)) * w3(x))`, Mixtral's names."""

    w1: ExpertLinear
    w2: ExpertLinear
    w3: ExpertLinear
    hidden_act: str = eqx.field(static=True)

    def __init__(
        self,
        experts: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        *,
        dtype=jnp.float32,
        initializer_range: float = 0.02,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `experts`: how many experts.
        - `hidden_size`, `intermediate_size`: model and per-expert feed-forward widths.
        - `hidden_act`: a Hugging Face activation name.
        - `dtype`, `initializer_range`: parameter dtype and initialisation scale.
        - `key`: a `jax.random` key.
        """
        k1, k2, k3 = jax.random.split(key, 3)
        into = (ax.EMBED, ax.MLP_INTERMEDIATE)
        common = dict(dtype=dtype, initializer_range=initializer_range)
        self.w1 = ExpertLinear(
            experts, hidden_size, intermediate_size, axes=into, key=k1, **common
        )
        self.w2 = ExpertLinear(
            experts, intermediate_size, hidden_size, axes=into[::-1], key=k2, **common
        )
        self.w3 = ExpertLinear(
            experts, hidden_size, intermediate_size, axes=into, key=k3, **common
        )
        activation(hidden_act)
        self.hidden_act = hidden_act

    def __call__(
        self, x: Float[Array, "rows embed"], group_sizes: Int[Array, " experts"]
    ) -> Float[Array, "rows embed"]:
        """**Arguments:**

        - `x`: rows sorted by expert.
        - `group_sizes`: how many consecutive rows belong to each expert.

        **Returns:**

        Every row through its own expert's MLP.
        """
        act = activation(self.hidden_act)
        hidden = act(self.w1.grouped(x, group_sizes)) * self.w3.grouped(x, group_sizes)
        return self.w2.grouped(hidden, group_sizes)


class SparseMoE(eqx.Module):
    """Route each token to its `top_k` experts by a softmax router, renormalise their
    probabilities over the chosen experts and sum the experts' outputs so weighted."""

    gate: Linear
    experts: Experts
    top_k: int = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        hidden_act: str = "silu",
        *,
        dtype=jnp.float32,
        initializer_range: float = 0.02,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `hidden_size`, `intermediate_size`: model and per-expert feed-forward widths.
        - `num_experts`, `top_k`: experts, and how many each token uses.
        - `hidden_act`: the experts' activation.
        - `dtype`, `initializer_range`: parameter dtype and initialisation scale.
        - `key`: a `jax.random` key.
        """
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and {num_experts} experts, not {top_k}.")
        k_gate, k_experts = jax.random.split(key)
        self.gate = Linear(
            hidden_size,
            num_experts,
            axes=(ax.EMBED, ax.EXPERT_GATE),
            dtype=dtype,
            initializer_range=initializer_range,
            key=k_gate,
        )
        self.experts = Experts(
            num_experts,
            hidden_size,
            intermediate_size,
            hidden_act,
            dtype=dtype,
            initializer_range=initializer_range,
            key=k_experts,
        )
        self.top_k = top_k

    def __call__(
        self, x: Float[Array, "batch seq embed"]
    ) -> tuple[Float[Array, "batch seq embed"], Float[Array, "batch seq experts"]]:
        """**Arguments:**

        - `x`: hidden states.

        **Returns:**

        `(output, router_logits)`; the logits feed
        [`eqdel.models.load_balancing_loss`][].
        """
        batch, seq, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        logits = self.gate(tokens)
        num_experts = logits.shape[-1]
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, chosen = jax.lax.top_k(probs, self.top_k)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        # Sort the (token, choice) pairs by expert so that each expert's rows are together.
        flat = chosen.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token_of_row = order // self.top_k
        group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
        rows = self.experts(tokens[token_of_row], group_sizes)
        rows = rows * weights.reshape(-1)[order][:, None].astype(rows.dtype)
        out = jnp.zeros_like(tokens).at[token_of_row].add(rows)
        return out.reshape(batch, seq, hidden), logits.reshape(batch, seq, num_experts)
