"""The tiny model config the training tests share."""

from eqdel.models import LlamaConfig

TINY_LLAMA = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
