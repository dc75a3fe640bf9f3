"""Pure train steps: `step(state, batch) -> (state, metrics)` built on optax."""

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.experimental import checkify
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from jaxtyping import Array, Int, PRNGKeyArray

from .._placement import on_one_device
from ._adamw import AdamW, float32_norm


class NonFiniteError(FloatingPointError):
    """A train step met a non-finite loss or gradient. `state` is the unchanged state
    (the input's buffers were donated, so it is the one to keep using)."""

    def __init__(self, message: str, state: "TrainState"):
        super().__init__(message)
        self.state = state


class TrainState(eqx.Module):
    """Everything a training run carries from step to step.

    **Fields:**

    - `step`: number of updates applied.
    - `model`: the model (trainable and frozen parts).
    - `opt_state`: the optax state, over the trainable arrays only.
    - `key`: randomness for the next step.
    """

    step: Int[Array, ""]
    model: eqx.Module
    opt_state: optax.OptState
    key: PRNGKeyArray


def _trainable_spec(model, trainable):
    """A pytree of bools: which array leaves are trained."""
    if trainable is None:
        return jax.tree.map(eqx.is_inexact_array, model)
    if callable(trainable) and not isinstance(trainable, eqx.Module):
        return jax.tree.map(lambda x: eqx.is_inexact_array(x) and bool(trainable(x)), model)
    return trainable


def _cast_floating(x, dtype):
    if eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(dtype)
    return x


def init_train_state(
    model, optimizer: optax.GradientTransformation | AdamW, key: PRNGKeyArray, *, trainable=None
) -> TrainState:
    """A fresh [`eqdel.train.TrainState`][].

    **Arguments:**

    - `model`: the model to train.
    - `optimizer`: any optax transformation.
    - `key`: randomness for the run.
    - `trainable`: which leaves to train: `None` (every inexact array), a pytree of bools
        with the model's structure (as `equinox.partition` takes), or a function of a leaf.
        The optimizer state holds only trainable leaves.
    """
    params = eqx.filter(model, _trainable_spec(model, trainable))
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32
        opt_state = optimizer.init(params)
    return _committed(TrainState(jnp.zeros((), jnp.int32), model, opt_state, key))


def _committed(state: TrainState) -> TrainState:
    """`state` with the arrays that JAX has not placed yet (the counters `jnp` makes, a
    fresh key) placed where the train step puts its outputs, when the model is placed:
    on its device, or replicated over its mesh. Otherwise the step's second call, whose
    inputs are all placed (the first call's outputs), compiles the step again. A state
    with nothing placed is left as it is: JAX compiles its step once."""
    concrete = [x for x in jax.tree.leaves(state) if _concrete(x)]
    placed = next((x.sharding for x in concrete if x.committed), None)
    if isinstance(placed, NamedSharding):
        target = NamedSharding(placed.mesh, PartitionSpec())
    elif placed is not None and len(placed.device_set) == 1:
        target = SingleDeviceSharding(next(iter(placed.device_set)))
    else:
        return state

    def place(x):
        return jax.device_put(x, target) if _concrete(x) and not x.committed else x

    return jax.tree.map(place, state)


def _concrete(x) -> bool:
    """Whether `x` is an array with values (not a tracer, as under `filter_eval_shape`)."""
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def make_train_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation | AdamW,
    *,
    grad_accum_steps: int = 1,
    trainable=None,
    skip_nonfinite: bool = False,
    compute_dtype=None,
    donate: bool = True,
):
    """Build a jitted, pure train step.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch) -> (loss_sum, token_count)`, e.g.
        [`eqdel.train.causal_lm_loss`][]. The step minimises `loss_sum / token_count`.
    - `optimizer`: any optax transformation (chain `optax.clip_by_global_norm` for
        clipping; schedules work as usual). An [`eqdel.train.AdamW`][] takes its step
        in one pass over each parameter (`AdamW.apply`), in place on CPU with eqdel's
        kernels.
    - `grad_accum_steps`: split each batch on its leading axis into this many
        micro-batches, run them in a `lax.scan` and apply one update: the result equals
        the update from the whole batch at once.
    - `trainable`: as in [`eqdel.train.init_train_state`][] (use the same value).
    - `skip_nonfinite`: on a non-finite loss or gradient, keep the state unchanged and
        report it in the metrics (`finite`); otherwise raise
        [`eqdel.train.NonFiniteError`][] naming the step, carrying the unchanged state.
        Checking costs one host sync per step; skipping costs none.
    - `compute_dtype`: run the forward and backward passes with the floating-point
        parameters cast to this dtype (e.g. `jnp.bfloat16`), keeping the stored
        parameters, gradients and optimizer state in their own dtype (mixed precision).
        Losses are still reduced in float32.
    - `donate`: donate the input state's trainable arrays and optimizer state to the
        output (frozen arrays and the batch are never donated).

    **Returns:**

    `step(state, batch) -> (state, metrics)` with metrics `loss`, `grad_norm`, `tokens`
    and `finite`.
    """
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be at least 1, not {grad_accum_steps}.")

    def micro_batches(batch):
        def split(x):
            if x.shape[0] % grad_accum_steps:
                raise ValueError(
                    f"batch size {x.shape[0]} is not a multiple of grad_accum_steps "
                    f"{grad_accum_steps}."
                )
            return x.reshape(grad_accum_steps, x.shape[0] // grad_accum_steps, *x.shape[1:])

        return jax.tree.map(split, batch)

    def step(frozen_and_batch, state: TrainState, *, single_device: bool):
        frozen, batch = frozen_and_batch
        params = state.model

        def loss_and_count(params, micro):
            model = eqx.combine(params, frozen)
            if compute_dtype is not None:
                model = jax.tree.map(lambda x: _cast_floating(x, compute_dtype), model)
            return loss_fn(model, micro)

        grad_fn = eqx.filter_value_and_grad(loss_and_count, has_aux=True)

        def accumulate(carry, micro):
            loss_sum, count, grads = carry
            (micro_loss, micro_count), micro_grads = grad_fn(params, micro)
            grads = jax.tree.map(jnp.add, grads, micro_grads)
            return (loss_sum + micro_loss, count + micro_count, grads), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros)
        (loss_sum, count, grads), _ = jax.lax.scan(accumulate, init, micro_batches(batch))
        scale = 1.0 / jnp.maximum(count, 1.0)
        loss = loss_sum * scale
        if isinstance(optimizer, AdamW):  # scales the gradient in its own pass
            grad_norm = float32_norm(grads) * scale
        else:
            grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
            grad_norm = float32_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if not skip_nonfinite:
            checkify.check(
                finite,
                "non-finite loss ({loss}) or gradient norm ({norm}) at step {step}; the "
                "state was not updated",
                loss=loss,
                norm=grad_norm,
                step=state.step,
            )
        if isinstance(optimizer, AdamW):
            new_params, opt_state = optimizer.apply(
                grads,
                state.opt_state,
                params,
                grad_scale=scale,
                grad_norm=grad_norm,
                finite=finite,
                single_device=single_device,
            )
        else:
            with jax.numpy_dtype_promotion("standard"):
                updates, opt_state = optimizer.update(grads, state.opt_state, params)
            new_params = eqx.apply_updates(params, updates)
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            new_params = jax.tree.map(keep, new_params, params)
            opt_state = jax.tree.map(keep, opt_state, state.opt_state)
        key, _ = jax.random.split(state.key)
        new_state = TrainState(
            state.step + finite.astype(jnp.int32),
            eqx.combine(new_params, frozen),
            opt_state,
            key,
        )
        metrics = dict(loss=loss, grad_norm=grad_norm, tokens=count, finite=finite)
        return new_state, metrics

    # The frozen part and the batch go first and are never donated: the frozen part is
    # shared with the caller's model (a LoRA base, frozen embeddings), and the caller may
    # reuse the batch.
    donation = "all-except-first" if donate else "none"

    @functools.cache
    def checked(single_device: bool):
        return eqx.filter_jit(
            checkify.checkify(functools.partial(step, single_device=single_device)),
            donate=donation,
        )

    def run(state: TrainState, batch):
        params, frozen = eqx.partition(state.model, _trainable_spec(state.model, trainable))
        error, (state, metrics) = checked(on_one_device(params))(
            (frozen, batch), eqx.tree_at(lambda s: s.model, state, params)
        )
        message = None if skip_nonfinite else error.get()
        if message is not None:
            raise NonFiniteError(message, state)
        return state, metrics

    return run
