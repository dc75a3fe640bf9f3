import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float

import eqdel
from eqdel import axes

MESHES = [(8, 1, 1, 1), (1, 8, 1, 1), (1, 2, 2, 2), (2, 1, 4, 1)]


class Projection(eqx.Module):
    """A linear layer whose role decides its axes."""

    weight: Float[Array, "inp out"] = eqdel.field(axes=lambda self: self.axes)
    axes: tuple = eqx.field(static=True)

    def __call__(self, x: Float[Array, "*b inp"]) -> Float[Array, "*b out"]:
        return x @ self.weight


class Block(eqx.Module):
    up: Projection
    down: Projection
    scale: Float[Array, " embed"] = eqdel.field(axes=(axes.EMBED,))

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x * self.scale[None, None, :])))


class TinyModel(eqx.Module):
    embedding: Float[Array, "vocab embed"] = eqdel.field(axes=(axes.VOCAB, axes.EMBED))
    blocks: Block
    head_bias: Float[Array, " vocab"]

    def __call__(self, ids):
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def body(x, layer):
            return eqx.combine(layer, static)(x), None

        x, _ = jax.lax.scan(body, self.embedding[ids], dynamic)
        return x @ self.embedding.T + self.head_bias[None, None, :]


def make_model(key, embed=16, mlp=32, vocab=64, layers=3):
    k_embed, k_blocks = jax.random.split(key)

    def block(key):
        k1, k2 = jax.random.split(key)
        return Block(
            Projection(
                jax.random.normal(k1, (embed, mlp)) * 0.1, (axes.EMBED, axes.MLP_INTERMEDIATE)
            ),
            Projection(
                jax.random.normal(k2, (mlp, embed)) * 0.1, (axes.MLP_INTERMEDIATE, axes.EMBED)
            ),
            jnp.ones(embed),
        )

    return TinyModel(
        jax.random.normal(k_embed, (vocab, embed)),
        eqx.filter_vmap(block)(jax.random.split(k_blocks, layers)),
        jnp.zeros(vocab),
    )


def test_stacked_leaves_gain_layers_axis(getkey):
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    specs = eqdel.partition_specs(make_model(getkey()), cfg)
    assert specs.embedding == P("tp", ("fsdp", "sp"))
    assert specs.blocks.up.weight == P(None, ("fsdp", "sp"), "tp")
    assert specs.blocks.down.weight == P(None, "tp", ("fsdp", "sp"))
    assert specs.blocks.scale == P(None, ("fsdp", "sp"))
    assert specs.head_bias == P(None)


@pytest.mark.parametrize("dims", MESHES)
def test_model_and_optimizer_state_sharded(dims, getkey):
    cfg = eqdel.ShardingConfig(axis_dims=dims)
    mesh = cfg.mesh()
    model = make_model(getkey())
    optimizer = optax.adamw(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    tree = (model, opt_state)

    sharded = eqdel.shard(tree, cfg)
    specs = eqdel.partition_specs(tree, cfg)
    for leaf, spec in zip(
        jax.tree.leaves(sharded), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    ):
        assert leaf.sharding == NamedSharding(mesh, spec)
    # The optimizer's moments follow the parameters they belong to.
    assert opt_state[0].mu.blocks.up.weight.shape == (3, 16, 32)
    assert sharded[1][0].mu.blocks.up.weight.sharding.spec == specs[0].blocks.up.weight

    ids = jnp.arange(24).reshape(4, 6) % 64

    def train_step(model, opt_state, ids):
        def loss(model):
            return jnp.mean(jax.nn.log_softmax(model(ids))[..., 0])

        value, grads = eqx.filter_value_and_grad(loss)(model)
        # optax mixes Python floats with int32 step counts, which strict promotion rejects.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(
                grads, opt_state, eqx.filter(model, eqx.is_array)
            )
        return value, eqx.apply_updates(model, updates), opt_state

    expected = train_step(model, opt_state, ids)
    got = eqx.filter_jit(train_step)(*sharded, ids)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_shard_inside_jit_constrains(getkey):
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 4, 1))
    model = make_model(getkey())

    @eqx.filter_jit
    def placed(model):
        return eqdel.shard(model, cfg)

    out = placed(model)
    assert out.embedding.sharding.spec == P("tp", "fsdp")
    np.testing.assert_array_equal(np.asarray(out.embedding), np.asarray(model.embedding))


def test_constrain_activation():
    cfg = eqdel.ShardingConfig(axis_dims=(2, 2, 2, 1))
    x = jnp.ones((4, 8, 16))  # sp has size 1, so the sequence stays whole

    @jax.jit
    def f(x):
        return eqdel.constrain(x * 2, axes.HiddenStateSharding, cfg)

    mesh = cfg.mesh()
    assert f(x).sharding.is_equivalent_to(NamedSharding(mesh, P(("dp", "fsdp"), None, "tp")), 3)
    decode = jax.jit(lambda x: eqdel.constrain(x, axes.HiddenStateSharding, cfg))(x[:, :1])
    assert decode.sharding.is_equivalent_to(NamedSharding(mesh, P(("dp", "fsdp"), None, "tp")), 3)
    assert not decode.sharding.is_equivalent_to(NamedSharding(mesh, P()), 3)


def test_declared_axes_longer_than_array_names_the_leaf():
    model = Projection(jnp.ones(4), (axes.EMBED, axes.HEAD))
    with pytest.raises(ValueError, match=r"\.weight: declares 2 axes but the array has only 1"):
        eqdel.partition_specs(model, eqdel.ShardingConfig())


def test_strict_non_divisible_leaf_names_path(getkey):
    cfg = eqdel.ShardingConfig(axis_dims=(1, 1, 8, 1), strict=True)
    model = make_model(getkey(), vocab=60)
    with pytest.raises(ValueError, match=r"\.embedding: dim 0 \(size 60\) not divisible by 8"):
        eqdel.shard(model, cfg)


def test_explain_sharding_reports_table_and_fallbacks(getkey):
    cfg = eqdel.ShardingConfig(axis_dims=(1, 1, 8, 1))
    model = make_model(getkey(), vocab=60)
    text = eqdel.explain_sharding(model, cfg)
    lines = text.splitlines()
    assert lines[0] == "mesh (dp=1, fsdp=1, tp=8, sp=1)"
    row = next(line for line in lines if line.startswith(".blocks.up.weight"))
    assert "(3, 16, 32)" in row and "(layers, embed, mlp_intermediate)" in row
    assert "'tp'" in row and "768 B" in row  # 3 * 16 * 32 * 4 bytes / 8 devices
    assert "over 5 arrays" in text
    assert ".embedding: dim 0 (size 60) not divisible by 8 = mesh axes ('tp',); replicated" in text
    assert ".head_bias" in text  # undeclared leaves are listed too, replicated


def test_match_partition_rules(getkey):
    model = make_model(getkey())
    rules = [
        (r"embedding", P("tp", "fsdp")),
        (r"blocks/up/weight", P(None, "fsdp", "tp")),
        (r".*", P()),
    ]
    specs = eqdel.match_partition_rules(rules, model)
    assert specs.embedding == P("tp", "fsdp")
    assert specs.blocks.up.weight == P(None, "fsdp", "tp")
    assert specs.blocks.down.weight == P()
    with pytest.raises(ValueError, match=r"blocks/down/weight \(shape \(3, 32, 16\)\) matches no"):
        eqdel.match_partition_rules(rules[:2], model)
    with pytest.raises(ValueError, match=r"head_bias: rule '.\*' gives"):
        eqdel.match_partition_rules([(r".*", P("tp", None))], model)
