"""Model families, each registered under its Hugging Face `model_type`."""

from ._causal_lm import CausalLM as CausalLM
from ._gemma import Gemma2DecoderLayer as Gemma2DecoderLayer, GemmaConfig as GemmaConfig
from ._gpt2 import GPT2Config as GPT2Config, GPT2LMHeadModel as GPT2LMHeadModel
from ._llama import (
    LlamaConfig as LlamaConfig,
    LlamaDecoderLayer as LlamaDecoderLayer,
    LlamaForCausalLM as LlamaForCausalLM,
    LlamaModel as LlamaModel,
)
from ._mixtral import (
    MixtralConfig as MixtralConfig,
    MixtralDecoderLayer as MixtralDecoderLayer,
    load_balancing_loss as load_balancing_loss,
)
from ._outputs import CausalLMOutput as CausalLMOutput
from ._registry import MODEL_TYPES as MODEL_TYPES, config_class as config_class
