"""Attention kernels behind one signature."""

from ._masks import attention_mask as attention_mask
from ._vanilla import vanilla_attention as vanilla_attention
