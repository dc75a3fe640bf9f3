"""Hugging Face `model_type` → eqdel model class and config class."""

from ._gemma import GemmaConfig
from ._gpt2 import GPT2Config, GPT2LMHeadModel
from ._llama import LlamaConfig, LlamaForCausalLM
from ._mixtral import MixtralConfig

_FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig),
    "mistral": (LlamaForCausalLM, LlamaConfig),
    "qwen2": (LlamaForCausalLM, LlamaConfig),
    "qwen3": (LlamaForCausalLM, LlamaConfig),
    "phi3": (LlamaForCausalLM, LlamaConfig),
    "gemma": (LlamaForCausalLM, GemmaConfig),
    "gemma2": (LlamaForCausalLM, GemmaConfig),
    "mixtral": (LlamaForCausalLM, MixtralConfig),
    "gpt2": (GPT2LMHeadModel, GPT2Config),
}

MODEL_TYPES = {model_type: model for model_type, (model, _) in _FAMILIES.items()}
"""Every supported Hugging Face `model_type` and the class that implements it."""


def config_class(model_type: str):
    """The config class for `model_type`.

    **Raises:**

    `ValueError` listing the known model types.
    """
    if model_type not in _FAMILIES:
        raise ValueError(
            f"Unknown model_type {model_type!r}; eqdel supports {sorted(MODEL_TYPES)}."
        )
    return _FAMILIES[model_type][1]
