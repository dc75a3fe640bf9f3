"""A model of your own: a small causal LM with parallel attention + MLP blocks and a
learned per-channel residual gate, written as an Equinox module from `eqdel.nn` layers.

Its one new parameter declares its axes with `eqdel.field`; shapes are checked by
jaxtyping + beartype; `eqdel.shard` places it on a (1, 2, 2, 2) mesh of simulated CPU
devices with no sharding code in the model, and it trains with `make_train_step`.

    python examples/custom_model.py --steps 20
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from beartype import beartype  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, jaxtyped  # noqa: E402

import eqdel  # noqa: E402
from eqdel import axes, nn  # noqa: E402
from eqdel.attention import AttentionMask  # noqa: E402
from eqdel.train import chunked_cross_entropy, init_train_state, make_train_step  # noqa: E402


class ParallelBlock(eqx.Module):
    """`x + gate * (attention(norm(x)) + mlp(norm(x)))`, as in GPT-J, with a learned
    per-channel gate."""

    norm: nn.RMSNorm
    attention: nn.Attention
    mlp: nn.GatedMLP
    gate: Float[Array, " embed"] = eqdel.field(axes=(axes.EMBED,))

    def __init__(self, hidden: int, heads: int, kv_heads: int, *, key: PRNGKeyArray):
        attention_key, mlp_key = jax.random.split(key)
        self.norm = nn.RMSNorm(hidden)
        self.attention = nn.Attention(
            hidden, heads, kv_heads, hidden // heads, mechanism="vanilla", key=attention_key
        )
        self.mlp = nn.GatedMLP(hidden, 4 * hidden, key=mlp_key)
        self.gate = jnp.ones(hidden)

    @jaxtyped(typechecker=beartype)
    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        cos: Float[Array, "batch seq rotary"],
        sin: Float[Array, "batch seq rotary"],
        mask: AttentionMask,
    ) -> Float[Array, "batch seq embed"]:
        h = self.norm(x)
        attended, _ = self.attention(h, cos, sin, mask)
        return x + self.gate * (attended + self.mlp(h))


class ParallelLM(eqx.Module):
    """Token embeddings, a stack of [`ParallelBlock`][]s and a language-model head."""

    embed: nn.Embedding
    blocks: list[ParallelBlock]
    norm: nn.RMSNorm
    rotary: nn.RotaryEmbedding
    head: nn.Linear

    def __init__(self, vocab: int, hidden: int, depth: int, *, key: PRNGKeyArray):
        embed_key, head_key, *block_keys = jax.random.split(key, depth + 2)
        heads = 4
        self.embed = nn.Embedding(vocab, hidden, key=embed_key)
        self.blocks = [ParallelBlock(hidden, heads, 2, key=k) for k in block_keys]
        self.norm = nn.RMSNorm(hidden)
        self.rotary = nn.RotaryEmbedding(hidden // heads)
        self.head = nn.Linear(hidden, vocab, axes=(axes.EMBED, axes.VOCAB), key=head_key)

    @jaxtyped(typechecker=beartype)
    def hidden_states(
        self, ids: Int[Array, "batch seq"], valid: Bool[Array, "batch seq"]
    ) -> Float[Array, "batch seq embed"]:
        positions = jnp.maximum(jnp.cumsum(valid, axis=-1) - 1, 0)
        index = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        mask = AttentionMask(index, index, valid)
        cos, sin = self.rotary(positions)
        x = self.embed(ids)
        for block in self.blocks:
            # Inside `cfg.activate()`: hidden states on the activation rules' spec.
            x = eqdel.constrain(block(x, cos, sin, mask), (axes.BATCH, axes.LENGTH, axes.EMBED))
        return self.norm(x)

    def __call__(self, ids: Int[Array, "batch seq"]) -> Float[Array, "batch seq vocab"]:
        return self.head(self.hidden_states(ids, jnp.ones(ids.shape, bool)))


def next_token_loss(model: ParallelLM, batch: dict) -> tuple[Array, Array]:
    """`(loss_sum, token_count)` of next-token prediction, as `make_train_step` wants."""
    ids, valid = batch["input_ids"], batch["attention_mask"].astype(bool)
    hidden = model.hidden_states(ids, valid)
    weights = valid[:, 1:].astype(jnp.float32)
    loss_sum = chunked_cross_entropy(
        model.head,
        hidden[:, :-1].reshape(-1, hidden.shape[-1]),
        ids[:, 1:].reshape(-1),
        weights.reshape(-1),
    )
    return loss_sum, jnp.sum(weights)


def main(steps: int) -> None:
    model = ParallelLM(vocab=64, hidden=64, depth=2, key=jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (8, 32), 0, 64)

    try:
        model(ids[0])  # one sequence without its batch dimension
    except Exception as error:  # jaxtyping's TypeCheckError names the argument and shapes
        print(f"shape check caught: {type(error).__name__}")

    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    sharded = eqdel.shard(model, cfg)
    print(eqdel.explain_sharding(sharded, cfg))
    gate_spec = sharded.blocks[0].gate.sharding.spec
    print(f"the new gate parameter went to {gate_spec}")
    difference = jnp.max(jnp.abs(jax.jit(ParallelLM.__call__)(sharded, ids) - model(ids)))
    print(f"max |sharded - single device| logits = {float(difference):.2e}")

    optimizer = optax.adamw(3e-3)
    state = eqdel.shard(init_train_state(sharded, optimizer, jax.random.key(2)), cfg)
    step = make_train_step(next_token_loss, optimizer)
    pattern = jnp.tile(jnp.arange(16), (8, 2))  # a sequence worth learning
    batch_spec = cfg.resolve((axes.BATCH, axes.LENGTH), shape=pattern.shape)  # (dp, fsdp), sp
    batch = jax.device_put(
        {"input_ids": pattern, "attention_mask": jnp.ones_like(pattern)},
        NamedSharding(cfg.mesh(), batch_spec),
    )
    losses = []
    with cfg.activate():
        for _ in range(steps):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps} steps")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    main(parser.parse_args().steps)
