"""`eqdel.train.AdamW`: the update of optax's clipped AdamW, as an optax transformation
and in a train step, in XLA and in eqdel's CPU kernel (in place, float32 and bfloat16)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hf_reference import random_ids
from tiny import TINY_LLAMA

import eqdel
from eqdel.models import LlamaForCausalLM
from eqdel.nn import _few_rows
from eqdel.train import AdamW, causal_lm_loss, init_train_state, make_train_step

SCHEDULE = optax.linear_schedule(1e-2, 1e-3, 10)

needs_kernels = pytest.mark.skipif(
    not _few_rows.available(),
    reason="eqdel's CPU kernels are opt-in (EQDEL_CPU_KERNELS=1) and need a C++ compiler",
)


def _reference(max_grad_norm):
    adamw = optax.adamw(SCHEDULE, weight_decay=0.01)
    if max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)


def _params(getkey, dtype=jnp.float32):
    return {
        "matrix": jax.random.normal(getkey(), (300, 77)).astype(dtype),
        "pair": (jax.random.normal(getkey(), (5,)).astype(dtype), None),
    }


def _gradient(getkey, params, scale):
    return jax.tree.map(lambda p: scale * jax.random.normal(getkey(), p.shape, p.dtype), params)


def _assert_trees_close(a, b, **tolerance):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        np.testing.assert_allclose(x, y, **tolerance)


@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_update_equals_optax_clipped_adamw(max_grad_norm, getkey):
    ours = AdamW(SCHEDULE, weight_decay=0.01, max_grad_norm=max_grad_norm)
    theirs = _reference(max_grad_norm)
    params = ours_params = theirs_params = _params(getkey)
    ours_state, theirs_state = ours.init(params), theirs.init(params)
    for i in range(5):
        grads = _gradient(getkey, params, 0.1 * (i + 1))
        updates, ours_state = ours.update(grads, ours_state, ours_params)
        ours_params = optax.apply_updates(ours_params, updates)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes floats and int32
            updates, theirs_state = theirs.update(grads, theirs_state, theirs_params)
        theirs_params = optax.apply_updates(theirs_params, updates)
    assert int(ours_state.count) == 5
    _assert_trees_close(ours_params, theirs_params, rtol=1e-6, atol=1e-7)


def test_update_needs_the_parameters():
    optimizer = AdamW(1e-3)
    params = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match="needs the parameters"):
        optimizer.update(params, optimizer.init(params))


def _train(optimizer, model, data, **options):
    step = make_train_step(causal_lm_loss, optimizer, **options)
    model = jax.tree.map(jnp.copy, model)  # the step donates the state's arrays
    state = init_train_state(model, optimizer, jax.random.key(1))
    losses = []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def test_train_steps_equal_optax_clipped_adamw(getkey):
    """The step hands `AdamW` the gradient of the summed loss and its scale, with
    gradient accumulation too."""
    model = LlamaForCausalLM(TINY_LLAMA, key=getkey())
    data = [{"input_ids": jnp.asarray(random_ids(4, 8, vocab=64, seed=s))} for s in range(3)]
    ours, ours_losses = _train(
        AdamW(SCHEDULE, weight_decay=0.01, max_grad_norm=1.0), model, data, grad_accum_steps=2
    )
    theirs, theirs_losses = _train(_reference(1.0), model, data, grad_accum_steps=2)
    np.testing.assert_allclose(ours_losses, theirs_losses, rtol=1e-6)
    assert int(ours.step) == int(ours.opt_state.count) == 3
    _assert_trees_close(ours.model, theirs.model, rtol=1e-5, atol=1e-6)


def _apply(optimizer, grads, state, params, *, kernels, finite=True, donate=True):
    """`optimizer.apply`, jitted, with the gradient halved first."""
    apply = jax.jit(
        optimizer.apply, static_argnames="single_device", donate_argnums=(1, 2) if donate else ()
    )
    return apply(
        grads,
        state,
        params,
        grad_scale=jnp.float32(0.5),
        grad_norm=optax.tree.norm(grads) * 0.5,
        finite=jnp.bool_(finite),
        single_device=kernels,
    )


def _skipped_step_keeps(optimizer_state, params, grads):
    after, state = _apply(
        AdamW(1e-2), grads, optimizer_state, params, kernels=True, finite=False, donate=False
    )
    _assert_trees_close(after, params, rtol=0, atol=0)
    _assert_trees_close(state, optimizer_state, rtol=0, atol=0)


def test_a_non_finite_step_leaves_parameters_and_state(getkey):
    params = _params(getkey)
    grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)
    state = AdamW(1e-2).init(params)
    _skipped_step_keeps(state._replace(mu=_gradient(getkey, params, 0.1)), params, grads)


@needs_kernels
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernel_takes_the_step_of_xla(dtype, getkey):
    """In place (the parameters and moments donated) and not, clipped, for three steps;
    bfloat16 within a unit in the last place, where rounding the same float32 value
    computed in another order can differ."""
    optimizer = AdamW(SCHEDULE, weight_decay=0.01, max_grad_norm=1.0)
    params = _params(getkey, dtype)
    assert "eqdel_adamw" in str(
        jax.make_jaxpr(lambda g, s, p: _apply(optimizer, g, s, p, kernels=True))(
            params, optimizer.init(params), params
        )
    )
    in_kernel, in_xla = [(jax.tree.map(jnp.copy, params), optimizer.init(params)) for _ in "ab"]
    for i in range(3):
        grads = _gradient(getkey, params, 2.0 * (i + 1))
        in_kernel = _apply(optimizer, grads, in_kernel[1], in_kernel[0], kernels=True)
        in_xla = _apply(optimizer, grads, in_xla[1], in_xla[0], kernels=False)
    tolerance = dict(rtol=1e-6, atol=1e-7) if dtype == jnp.float32 else dict(rtol=2**-7, atol=0)
    _assert_trees_close(in_kernel, in_xla, **tolerance)


@needs_kernels
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernel_keeps_everything_on_a_non_finite_step(dtype, getkey):
    params = _params(getkey, dtype)
    grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), params)
    state = AdamW(1e-2).init(params)
    _skipped_step_keeps(state._replace(nu=_gradient(getkey, params, 0.1)), params, grads)


def test_on_a_mesh_the_moments_follow_their_parameters(getkey):
    """Sharded, the step takes XLA's path (the kernel would gather every array), keeps
    each moment sharded as its parameter and gives the single-device losses."""
    model = LlamaForCausalLM(TINY_LLAMA, key=getkey())
    optimizer = AdamW(1e-2, max_grad_norm=1.0)
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    data = [{"input_ids": jnp.asarray(random_ids(4, 8, vocab=64, seed=s))} for s in range(2)]
    _, single_losses = _train(optimizer, model, data)
    step = make_train_step(causal_lm_loss, optimizer)
    state = eqdel.shard(init_train_state(model, optimizer, jax.random.key(1)), cfg)
    losses = []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, single_losses, rtol=1e-5)
    params = jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array))
    for moment in (state.opt_state.mu, state.opt_state.nu):
        for m, p in zip(jax.tree.leaves(moment), params, strict=True):
            assert m.sharding == p.sharding
    assert any(not p.sharding.is_fully_replicated for p in params)
