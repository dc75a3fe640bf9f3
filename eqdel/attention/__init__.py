"""Attention kernels behind one signature."""

from ._chunked import chunked_attention as chunked_attention
from ._dispatch import (
    ATTENTION_MECHANISMS as ATTENTION_MECHANISMS,
    CHUNKED_FROM_LENGTH as CHUNKED_FROM_LENGTH,
    attention as attention,
    select_mechanism as select_mechanism,
)
from ._masks import AttentionMask as AttentionMask, attention_mask as attention_mask
from ._ring import ring_attention as ring_attention
from ._vanilla import (
    ALIGNED_QUERY_BLOCKS as ALIGNED_QUERY_BLOCKS,
    vanilla_attention as vanilla_attention,
)
