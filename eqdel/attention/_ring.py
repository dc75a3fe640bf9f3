"""Ring attention: the sequence sharded over a mesh axis, key/value blocks passed round
the ring with `ppermute` while each device folds them into an online softmax."""

import jax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from ._chunked import block_scores, online_softmax_init, online_softmax_step
from ._masks import AttentionMask


def ring_mesh_size(axis_name: str) -> int:
    """The size of `axis_name` in the mesh set with `jax.set_mesh` (1 when there is no
    such mesh or axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis_name not in mesh.axis_names:
        return 1
    return mesh.shape[axis_name]


def ring_attention(
    query: Float[Array, "batch q_len heads head_dim"],
    key: Float[Array, "batch kv_len kv_heads head_dim"],
    value: Float[Array, "batch kv_len kv_heads head_dim"],
    mask: AttentionMask,
    *,
    scale: float,
    soft_cap: float | None = None,
    axis_name: str = "sp",
) -> Float[Array, "batch q_len heads head_dim"]:
    """Sequence-parallel attention over the `axis_name` axis of the mesh set with
    `jax.set_mesh`: each device keeps its slice of the queries and passes its slice of
    keys and values round the ring, one hop per step, folding each into an online
    softmax; no device ever holds the whole sequence. The other mesh axes stay under
    the compiler's automatic sharding. Each step is rematerialised in the backward pass.
    Equals [`eqdel.attention.vanilla_attention`][].

    **Arguments:**

    - `query`, `key`, `value`, `mask`, `scale`, `soft_cap`: as for
        [`eqdel.attention.chunked_attention`][].
    - `axis_name`: the mesh axis the sequence is split over.

    **Returns:**

    The attention output, in `query`'s dtype.

    **Raises:**

    `ValueError` when no mesh with `axis_name` is set, or a length does not divide by
    its size.
    """
    size = ring_mesh_size(axis_name)
    if size == 1 and axis_name not in jax.sharding.get_abstract_mesh().axis_names:
        raise ValueError(
            f"ring attention needs a mesh with a {axis_name!r} axis set with jax.set_mesh "
            "(e.g. `with jax.set_mesh(cfg.mesh()):`)."
        )
    q_len, kv_len = query.shape[1], key.shape[1]
    if q_len % size or kv_len % size:
        raise ValueError(
            f"ring attention over {axis_name!r} (size {size}) needs query and key lengths "
            f"that divide by {size}; got {q_len} and {kv_len}."
        )
    batch, _, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    group = heads // kv_heads
    ring = [(i, (i + 1) % size) for i in range(size)]

    def local(q, k, v, qi, ki, kv, window):
        q = q.reshape(batch, -1, kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

        @jax.checkpoint
        def hop(carry, _):
            stats, k, v, ki, kv = carry
            scores = block_scores(q, k, qi, ki, kv, window, scale, soft_cap)[0]
            stats = online_softmax_step(stats, scores, v)
            k, v, ki, kv = (jax.lax.ppermute(x, axis_name, ring) for x in (k, v, ki, kv))
            return (stats, k, v, ki, kv), None

        init = (online_softmax_init(q), k, v, ki, kv)
        ((_, row_sum, acc), *_), _ = jax.lax.scan(hop, init, None, length=size)
        out = (acc / row_sum[..., None]).astype(query.dtype)
        return out.transpose(0, 3, 1, 2, 4).reshape(batch, -1, heads, head_dim)

    sequence = P(None, axis_name)
    return jax.shard_map(
        local,
        in_specs=(sequence, sequence, sequence, sequence, sequence, sequence, P()),
        out_specs=sequence,
        axis_names={axis_name},
    )(
        query,
        key,
        value,
        mask.query_index,
        mask.key_index,
        mask.key_valid,
        mask.sliding_window,
    )
