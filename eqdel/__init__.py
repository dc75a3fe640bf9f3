"""eqdel: large language models in JAX as immutable Equinox modules, sharded by the
semantic axes every array declares."""

from . import axes as axes, evaluate as evaluate, models as models, nn as nn, train as train
from ._cache import KVCache as KVCache, KVLayer as KVLayer
from ._chat import ChatTemplate as ChatTemplate, load_chat_template as load_chat_template
from ._explain import explain_sharding as explain_sharding
from ._field import field as field
from ._finetune import (
    FinetuneOptions as FinetuneOptions,
    FinetuneResult as FinetuneResult,
    finetune as finetune,
)
from ._generation import generate as generate, stream_generate as stream_generate
from ._generation_config import GenerationConfig as GenerationConfig
from ._lora import (
    LoRALinear as LoRALinear,
    apply_lora as apply_lora,
    load_lora as load_lora,
    lora_filter as lora_filter,
    merge_lora as merge_lora,
    save_lora as save_lora,
)
from ._partition_rules import match_partition_rules as match_partition_rules
from ._placement import constrain as constrain, partition_specs as partition_specs, shard as shard
from ._quant import (
    Int4Linear as Int4Linear,
    Int8Embedding as Int8Embedding,
    Int8Linear as Int8Linear,
    NF4Linear as NF4Linear,
    dequantize as dequantize,
    quantize as quantize,
)
from ._sharding_config import ShardingConfig as ShardingConfig
from ._smollm2 import smollm2_gguf as smollm2_gguf
from ._tokenizer import load_tokenizer as load_tokenizer
from ._version import __version__ as __version__
from .checkpoint import from_pretrained as from_pretrained, save_pretrained as save_pretrained
