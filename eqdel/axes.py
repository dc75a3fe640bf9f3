"""Semantic axis names, runtime modes and the dynamic sharding presets.

Every array in eqdel names what each of its dimensions *means* (batch, sequence length,
embedding, heads, ...). A [`eqdel.ShardingConfig`][] turns those names into mesh axes through
its rule tables. Parallelism tokens (`FSDP`, `TP`, ...) name a
mesh axis directly and bypass the tables, so the presets below work unchanged.
"""

from typing import ClassVar, Literal, NamedTuple

import numpy as np

__all__ = [
    "EMPTY",
    "BATCH",
    "LENGTH",
    "KV_LENGTH",
    "QUERY_LENGTH",
    "EMBED",
    "HEAD",
    "KV_HEAD",
    "HEAD_DIM",
    "KV_HEAD_DIM",
    "MLP_INTERMEDIATE",
    "VOCAB",
    "EXPERT",
    "EXPERT_GATE",
    "BIAS_HEAD_SEQ",
    "BIAS_KV_SEQ",
    "LAYERS",
    "SEMANTIC_AXES",
    "DATA_PARALLEL",
    "FULLY_SHARDED_DATA_PARALLEL",
    "TENSOR_PARALLEL",
    "EXPERT_PARALLEL",
    "SEQUENCE_PARALLEL",
    "DP",
    "FSDP",
    "TP",
    "EP",
    "SP",
    "PARALLELISM_TOKENS",
    "MODE_TRAIN",
    "MODE_PREFILL",
    "MODE_DECODE",
    "MODE_INSERT",
    "GENERATION_MODES",
    "RUNTIME_MODES",
    "RuntimeMode",
    "DynamicShardingAxes",
    "HiddenStateSharding",
    "AttnQSharding",
    "AttnKVSharding",
    "RowWise",
    "SRowWise",
    "ColumnWise",
    "SColumnWise",
    "Replicated",
    "ExpertColumnWise",
    "ExpertRowWise",
    "ExpertColumnWiseAlt",
    "ExpertRowWiseAlt",
    "UnifiedExpertColumnWise",
    "UnifiedExpertRowWise",
    "ExpertActivations",
    "ExpertActivationsAlt",
    "NOT_GIVEN",
    "NotGiven",
    "DEFAULT_MASK_VALUE",
]

# Semantic axes: what a dimension means.
EMPTY = "_"
"""A dimension that is never sharded."""
BATCH = "__BATCH__"
"""Examples in a batch."""
LENGTH = "__LENGTH__"
"""Token positions of a sequence (hidden states, logits)."""
KV_LENGTH = "__KV_LENGTH__"
"""Key/value positions: the cache length, or the keys' sequence in attention."""
QUERY_LENGTH = "__QUERY_LENGTH__"
"""Query positions in attention; one token in decode mode."""
EMBED = "__EMBED__"
"""The model (hidden) width."""
HEAD = "__HEAD__"
"""Attention query heads."""
KV_HEAD = "__KV_HEAD__"
"""Attention key/value heads (fewer than query heads under GQA)."""
HEAD_DIM = "__HEAD_DIM__"
"""The width of one query head."""
KV_HEAD_DIM = "__KV_HEAD_DIM__"
"""The width of one key/value head."""
MLP_INTERMEDIATE = "__MLP_INTERMEDIATE__"
"""The MLP's hidden width (`intermediate_size`)."""
VOCAB = "__VOCAB__"
"""Vocabulary entries (embedding rows, logits)."""
EXPERT = "__EXPERT__"
"""Experts of a mixture-of-experts layer."""
EXPERT_GATE = "__EXPERT_GATE__"
"""The router's per-expert scores."""
BIAS_HEAD_SEQ = "__BIAS_HEAD_SEQ__"
"""The query dimension of an attention bias."""
BIAS_KV_SEQ = "__BIAS_KV_SEQ__"
"""The key dimension of an attention bias."""
LAYERS = "__LAYERS__"
"""The leading dimension of layers stacked for scan-over-layers."""

SEMANTIC_AXES = frozenset(
    {
        BATCH,
        LENGTH,
        KV_LENGTH,
        QUERY_LENGTH,
        EMBED,
        HEAD,
        KV_HEAD,
        HEAD_DIM,
        KV_HEAD_DIM,
        MLP_INTERMEDIATE,
        VOCAB,
        EXPERT,
        EXPERT_GATE,
        BIAS_HEAD_SEQ,
        BIAS_KV_SEQ,
        LAYERS,
    }
)
"""Every semantic axis above."""

# Parallelism tokens: name a mesh axis directly.
DATA_PARALLEL = "__DATA_PARALLEL__"
"""The `dp` mesh axis, named directly."""
FULLY_SHARDED_DATA_PARALLEL = "__FULLY_SHARDED_DATA_PARALLEL__"
"""The `fsdp` mesh axis, named directly."""
TENSOR_PARALLEL = "__TENSOR_PARALLEL__"
"""The `tp` mesh axis, named directly."""
EXPERT_PARALLEL = "__EXPERT_PARALLEL__"
"""The `ep` mesh axis, named directly."""
SEQUENCE_PARALLEL = "__SEQUENCE_PARALLEL__"
"""The `sp` mesh axis, named directly."""
DP = DATA_PARALLEL
"""Short for [`eqdel.axes.DATA_PARALLEL`][]."""
FSDP = FULLY_SHARDED_DATA_PARALLEL
"""Short for [`eqdel.axes.FULLY_SHARDED_DATA_PARALLEL`][]."""
TP = TENSOR_PARALLEL
"""Short for [`eqdel.axes.TENSOR_PARALLEL`][]."""
EP = EXPERT_PARALLEL
"""Short for [`eqdel.axes.EXPERT_PARALLEL`][]."""
SP = SEQUENCE_PARALLEL
"""Short for [`eqdel.axes.SEQUENCE_PARALLEL`][]."""

PARALLELISM_TOKENS = {DP: "dp", FSDP: "fsdp", TP: "tp", EP: "ep", SP: "sp"}
"""Each parallelism token and the mesh axis name it stands for."""

# Runtime modes.
MODE_DECODE = "__autoregressive__"
"""One new token per step against a KV cache: query length is not sharded."""
MODE_PREFILL = "__prefill__"
"""A prompt run once to fill the cache: sharded like training."""
MODE_TRAIN = "__train__"
"""Whole sequences, forward and backward."""
MODE_INSERT = "__insert__"
"""A few tokens written into an existing cache: sharded like decode."""
GENERATION_MODES = frozenset({MODE_DECODE, MODE_INSERT})
"""Modes in which the query length is one token (or a handful) against a cache."""
RUNTIME_MODES = frozenset({MODE_DECODE, MODE_PREFILL, MODE_TRAIN, MODE_INSERT})
"""Every runtime mode."""
RuntimeMode = Literal["__autoregressive__", "__prefill__", "__train__", "__insert__"]
"""The type of a runtime mode."""


class DynamicShardingAxes(NamedTuple):
    """Semantic axes together with the runtime mode they are resolved in.

    `axes` has one entry per array dimension: a semantic axis, a parallelism token, a list
    of those (sharded over all of them), `EMPTY` or `None`. `mode` is a runtime mode, or an
    integer dimension index: the mode is then decode when that dimension has size 1, and
    train otherwise.

    The presets below are subclasses whose `axes` and `mode` are class attributes, so they
    are used as classes: `cfg.resolve(axes.HiddenStateSharding, shape=x.shape)`.
    """

    axes: tuple
    mode: str | int


class HiddenStateSharding(DynamicShardingAxes):
    """Hidden states `[batch, query_length, embed]`."""

    axes: ClassVar = (BATCH, QUERY_LENGTH, EMBED)
    mode: ClassVar = 1


class AttnQSharding(DynamicShardingAxes):
    """Attention queries `[batch, query_length, heads, head_dim]`."""

    axes: ClassVar = (BATCH, QUERY_LENGTH, HEAD, HEAD_DIM)
    mode: ClassVar = 1


class AttnKVSharding(DynamicShardingAxes):
    """Attention keys/values `[batch, kv_length, kv_heads, kv_head_dim]`."""

    axes: ClassVar = (BATCH, KV_LENGTH, KV_HEAD, KV_HEAD_DIM)
    mode: ClassVar = 1


class RowWise(DynamicShardingAxes):
    """A `[in, out]` weight with its input on tp and its output on (fsdp, sp)."""

    axes: ClassVar = (TP, (FSDP, SP))
    mode: ClassVar = MODE_TRAIN


class SRowWise(DynamicShardingAxes):
    """A vector sharded on tp."""

    axes: ClassVar = (TP,)
    mode: ClassVar = MODE_TRAIN


class ColumnWise(DynamicShardingAxes):
    """A `[in, out]` weight with its input on (fsdp, sp) and its output on tp."""

    axes: ClassVar = ((FSDP, SP), TP)
    mode: ClassVar = MODE_TRAIN


class SColumnWise(DynamicShardingAxes):
    """A vector sharded on (fsdp, sp)."""

    axes: ClassVar = ((FSDP, SP),)
    mode: ClassVar = MODE_TRAIN


class Replicated(DynamicShardingAxes):
    """A vector kept whole on every device."""

    axes: ClassVar = (EMPTY,)
    mode: ClassVar = MODE_TRAIN


class ExpertColumnWise(DynamicShardingAxes):
    """Expert weights `[experts, hidden, intermediate]` on (ep, fsdp, tp)."""

    axes: ClassVar = (EP, FSDP, TP)
    mode: ClassVar = MODE_TRAIN


class ExpertRowWise(DynamicShardingAxes):
    """Expert weights `[experts, intermediate, hidden]` on (ep, tp, fsdp)."""

    axes: ClassVar = (EP, TP, FSDP)
    mode: ClassVar = MODE_TRAIN


class ExpertColumnWiseAlt(DynamicShardingAxes):
    """As `ExpertColumnWise`, with the hidden dimension on (fsdp, sp)."""

    axes: ClassVar = (EP, (FSDP, SP), TP)
    mode: ClassVar = MODE_TRAIN


class ExpertRowWiseAlt(DynamicShardingAxes):
    """As `ExpertRowWise`, with the hidden dimension on (fsdp, sp)."""

    axes: ClassVar = (EP, TP, (FSDP, SP))
    mode: ClassVar = MODE_TRAIN


class UnifiedExpertColumnWise(DynamicShardingAxes):
    """Expert weights `[experts, hidden, intermediate]`, experts on (fsdp, sp, ep)."""

    axes: ClassVar = ((FSDP, SP, EP), EMPTY, TP)
    mode: ClassVar = MODE_TRAIN


class UnifiedExpertRowWise(DynamicShardingAxes):
    """Expert weights `[experts, intermediate, hidden]`, experts on (fsdp, sp, ep)."""

    axes: ClassVar = ((FSDP, SP, EP), TP, EMPTY)
    mode: ClassVar = MODE_TRAIN


class ExpertActivations(DynamicShardingAxes):
    """Routed activations `[batch, length, experts, hidden]` on (dp, sp, ep, tp)."""

    axes: ClassVar = (DP, SP, EP, TP)
    mode: ClassVar = MODE_TRAIN


class ExpertActivationsAlt(DynamicShardingAxes):
    """Activations `[batch, length, hidden]` on (dp, sp, (tp, fsdp))."""

    axes: ClassVar = (DP, SP, (TP, FSDP))
    mode: ClassVar = MODE_TRAIN


class NotGiven:
    """Type of the [`eqdel.axes.NOT_GIVEN`][] sentinel: an argument that was not passed,
    as distinct from one passed as `None`."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NOT_GIVEN"

    def __bool__(self) -> bool:
        return False


NOT_GIVEN = NotGiven()
"""The value of an argument that was not passed."""

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
"""A large negative logit for masked attention positions, finite so that fully masked rows
stay NaN-free."""
