"""EasyDeL-style `(regex, PartitionSpec)` rules over leaf paths."""

import re
from collections.abc import Sequence

import equinox as eqx
import jax
from jax.sharding import PartitionSpec


def leaf_path(path, sep: str = "/") -> str:
    """A `sep`-joined path such as `model/layers/0/self_attn/q_proj/weight`."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    return sep.join(parts)


def match_partition_rules(rules: Sequence[tuple[str, PartitionSpec]], tree):
    """Give every array leaf the `PartitionSpec` of the first rule whose regex matches its
    `/`-joined path (`re.search`), as EasyDeL's `get_partition_rules` tables do.

    **Arguments:**

    - `rules`: `(regex, PartitionSpec)` pairs, tried in order. End the list with
        `(".*", PartitionSpec())` to replicate everything else.
    - `tree`: any pytree.

    **Returns:**

    A pytree of the same structure whose array leaves are `PartitionSpec`s.

    **Raises:**

    `ValueError` naming the leaf when no rule matches it, or when the matched spec has more
    entries than the leaf has dimensions.
    """
    compiled = [(re.compile(pattern), spec) for pattern, spec in rules]

    def pick(path, leaf):
        if not eqx.is_array(leaf):
            return leaf
        name = leaf_path(path)
        for pattern, spec in compiled:
            if pattern.search(name):
                if len(spec) > leaf.ndim:
                    raise ValueError(
                        f"{name}: rule {pattern.pattern!r} gives {spec}, which has "
                        f"{len(spec)} entries, but the leaf has shape {leaf.shape}."
                    )
                return spec
        raise ValueError(
            f"{name} (shape {leaf.shape}) matches no partition rule; add a rule for it or "
            "a final ('.*', PartitionSpec()) to replicate the rest."
        )

    return jax.tree_util.tree_map_with_path(pick, tree)
