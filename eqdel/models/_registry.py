"""Hugging Face `model_type` → eqdel model class."""

from ._llama import LlamaConfig, LlamaForCausalLM

MODEL_TYPES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}
"""Every supported Hugging Face `model_type` and the class that implements it."""

_CONFIGS = {LlamaForCausalLM: LlamaConfig}


def config_class(model_type: str):
    """The config class for `model_type`.

    **Raises:**

    `ValueError` listing the known model types.
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"Unknown model_type {model_type!r}; eqdel supports {sorted(MODEL_TYPES)}."
        )
    return _CONFIGS[MODEL_TYPES[model_type]]
