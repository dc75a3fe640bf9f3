"""AdamW in one pass over each parameter.

`optax.adamw` is a chain of transformations, and XLA's CPU backend runs it as several
loops over each parameter, its gradient and its moments, plus a copy of both moments
(the loop that writes the new parameter reads the old moments, which the others
overwrite in place). [`eqdel.train.AdamW`][] is the same update as one elementwise
function of a parameter, its gradient and its moments. It is an optax transformation
for any training loop; [`eqdel.train.make_train_step`][] calls its `apply` instead,
which returns the new parameters and state directly and, with eqdel's CPU kernels
(`EQDEL_CPU_KERNELS=1`) on a single device, runs a kernel that reads each array once and
writes the parameter and moments in place.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int

from ..nn import _few_rows

_KERNELS = {np.dtype(jnp.float32): "eqdel_adamw_f32", np.dtype(jnp.bfloat16): "eqdel_adamw_bf16"}


class AdamWState(NamedTuple):
    """[`eqdel.train.AdamW`][]'s state: the number of steps taken and the moments, in the
    parameters' dtype."""

    count: Int[Array, ""]
    mu: optax.Updates
    nu: optax.Updates


class _Scalars(NamedTuple):
    """One step's scalars, in the order the kernel reads them (`adamw.cc`)."""

    learning_rate: Float[Array, ""]
    b1: float
    b2: float
    one_minus_b1: float  # in float64 first, as optax computes it
    one_minus_b2: float
    eps: float
    eps_root: float
    weight_decay: float
    correction1: Float[Array, ""]
    correction2: Float[Array, ""]
    grad_scale: Float[Array, ""]
    apply: Float[Array, ""]


@dataclasses.dataclass(frozen=True)
class AdamW:
    """AdamW with optional clipping by global norm: the update of `optax.adamw(learning_rate,
    b1, b2, eps, eps_root, weight_decay)`, after `optax.clip_by_global_norm(max_grad_norm)`
    when that is given, computed in float32 whatever the parameters' dtype, with the
    moments stored in the parameters' dtype (as `optax.adamw` stores them by default).

    **Arguments:**

    - `learning_rate`: a float or an optax schedule of the step count.
    - `b1`, `b2`: the moments' decay rates.
    - `eps`, `eps_root`: added to the second moment's square root, and under it.
    - `weight_decay`: decoupled weight decay, applied to every trained parameter.
    - `max_grad_norm`: clip the gradient to this global norm (`None`: no clipping).
    """

    learning_rate: float | optax.Schedule
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    eps_root: float = 0.0
    weight_decay: float = 1e-4
    max_grad_norm: float | None = None

    def init(self, params: optax.Params) -> AdamWState:
        def zeros():  # one tree per moment: a train step donates both
            return jax.tree.map(jnp.zeros_like, params)

        return AdamWState(jnp.zeros((), jnp.int32), zeros(), zeros())

    def update(
        self, updates: optax.Updates, state: AdamWState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, AdamWState]:
        """optax's interface: the updates to add to `params`, and the next state."""
        if params is None:
            raise ValueError("AdamW.update needs the parameters (for the weight decay).")
        norm = float32_norm(updates) if self.max_grad_norm is not None else None
        scalars = self._scalars(state.count, norm, jnp.float32(1), jnp.bool_(True))
        step = lambda p, g, m, v: _step(scalars, p, g, m, v)  # noqa: E731
        steps, mu, nu = _unzip3(params, jax.tree.map(step, params, updates, state.mu, state.nu))
        steps = jax.tree.map(lambda s, p: s.astype(p.dtype), steps, params)
        return steps, AdamWState(optax.safe_increment(state.count), mu, nu)

    def apply(
        self,
        grads: optax.Updates,
        state: AdamWState,
        params: optax.Params,
        *,
        grad_scale: Float[Array, ""],
        grad_norm: Float[Array, ""],
        finite: Bool[Array, ""],
        single_device: bool,
    ) -> tuple[optax.Params, AdamWState]:
        """One step, returning the new parameters directly: one pass over each parameter.

        **Arguments:**

        - `grads`: the gradient, up to `grad_scale` (e.g. of a sum of token losses).
        - `state`, `params`: the current state and trained parameters.
        - `grad_scale`: what the gradient is multiplied by first (e.g. one over the
            token count).
        - `grad_norm`: the scaled gradient's global norm (for clipping).
        - `finite`: whether to take the step; if not, the parameters and state come back
            unchanged.
        - `single_device`: whether every array lies on one device; eqdel's CPU kernel
            runs only then (on a mesh, XLA would gather each array to every device).

        **Returns:**

        The new parameters and state.
        """
        scalars = self._scalars(state.count, grad_norm, grad_scale, finite)
        in_place = single_device and _few_rows.available()
        packed = jnp.stack([jnp.asarray(x, jnp.float32) for x in scalars]) if in_place else None

        def leaf(p, g, m, v):
            target = _KERNELS.get(np.dtype(p.dtype))
            if in_place and target is not None and p.dtype == g.dtype == m.dtype == v.dtype:
                return _kernel(target, packed, p, g, m, v)
            step, m_new, v_new = _step(scalars, p, g, m, v)
            p_new = (p.astype(jnp.float32) + step).astype(p.dtype)
            pairs = ((p_new, p), (m_new, m), (v_new, v))
            return tuple(jnp.where(finite, new, old) for new, old in pairs)

        new_params, mu, nu = _unzip3(params, jax.tree.map(leaf, params, grads, state.mu, state.nu))
        count = jnp.where(finite, optax.safe_increment(state.count), state.count)
        return new_params, AdamWState(count, mu, nu)

    def _scalars(self, count, grad_norm, grad_scale, finite) -> _Scalars:
        rate = self.learning_rate
        if callable(rate):
            with jax.numpy_dtype_promotion("standard"):  # optax's schedules mix dtypes
                rate = rate(count)
        if self.max_grad_norm is not None:
            grad_norm = jnp.asarray(grad_norm, jnp.float32)
            clip = jnp.where(grad_norm < self.max_grad_norm, 1.0, self.max_grad_norm / grad_norm)
            grad_scale = grad_scale * clip
        steps = optax.safe_increment(count).astype(jnp.float32)
        return _Scalars(
            learning_rate=jnp.asarray(rate, jnp.float32),
            b1=self.b1,
            b2=self.b2,
            one_minus_b1=1 - self.b1,
            one_minus_b2=1 - self.b2,
            eps=self.eps,
            eps_root=self.eps_root,
            weight_decay=self.weight_decay,
            correction1=1 - jnp.float32(self.b1) ** steps,
            correction2=1 - jnp.float32(self.b2) ** steps,
            grad_scale=jnp.asarray(grad_scale, jnp.float32),
            apply=jnp.asarray(finite, jnp.float32),
        )


def float32_norm(tree) -> Float[Array, ""]:
    """The global norm of `tree`'s arrays, summed in float32 whatever their dtype."""
    squares = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)]
    return jnp.sqrt(sum(squares, jnp.float32(0)))


def _step(s: _Scalars, p, g, m, v):
    """The float32 step to add to `p`, and the new moments in their own dtype."""
    f32 = jnp.float32
    grad = g.astype(f32) * s.grad_scale
    m_new = (s.one_minus_b1 * grad + s.b1 * m.astype(f32)).astype(m.dtype)
    v_new = (s.one_minus_b2 * (grad * grad) + s.b2 * v.astype(f32)).astype(v.dtype)
    m_hat = m_new.astype(f32) / s.correction1
    v_hat = v_new.astype(f32) / s.correction2
    update = m_hat / (jnp.sqrt(v_hat + s.eps_root) + s.eps) + s.weight_decay * p.astype(f32)
    return -s.learning_rate * update, m_new, v_new


def _kernel(target: str, scalars: Float[Array, " 12"], p, g, m, v):
    """`adamw.cc`'s step, given `_Scalars` as one float32 vector: the parameter and
    moments written in place."""
    result = jax.ShapeDtypeStruct(p.shape, p.dtype)
    call = jax.ffi.ffi_call(
        target,
        (result, result, result),
        input_output_aliases={1: 0, 3: 1, 4: 2},
        vmap_method="sequential",
    )
    return tuple(call(scalars, p, g, m, v))


def _unzip3(like, tree):
    """`tree`, with `like`'s structure and a triple at each leaf, as three trees."""
    return jax.tree.transpose(jax.tree.structure(like), jax.tree.structure((0, 0, 0)), tree)
