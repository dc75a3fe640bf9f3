"""Layers: each an `equinox.Module` whose arrays declare their semantic axes."""

from ._activations import ACTIVATIONS as ACTIVATIONS, activation as activation
from ._attention import Attention as Attention
from ._embedding import Embedding as Embedding
from ._fuse import fuse_projections as fuse_projections
from ._linear import Linear as Linear, activation_dtype as activation_dtype
from ._mlp import GatedMLP as GatedMLP
from ._moe import ExpertLinear as ExpertLinear, Experts as Experts, SparseMoE as SparseMoE
from ._norm import LayerNorm as LayerNorm, RMSNorm as RMSNorm
from ._rotary import (
    ROPE_TYPES as ROPE_TYPES,
    RotaryEmbedding as RotaryEmbedding,
    apply_rotary as apply_rotary,
)
from ._stacked import (
    REMAT_POLICIES as REMAT_POLICIES,
    run_layers as run_layers,
    stack_layers as stack_layers,
    unstack_layers as unstack_layers,
)
