"""Tiny random-weight transformers models as the numerical reference."""

import numpy as np
import torch
import transformers

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attn_implementation="eager",
)

CONFIGS = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "gemma": transformers.GemmaConfig,
    "gemma2": transformers.Gemma2Config,
    "phi3": transformers.Phi3Config,
    "mixtral": transformers.MixtralConfig,
}


def make_hf_model(model_type: str = "llama", seed: int = 0, **overrides):
    """A transformers causal LM with random weights (biases randomised too)."""
    torch.manual_seed(seed)
    config = CONFIGS[model_type](**{**TINY, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model


def hf_logits(model, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        out = model(
            torch.tensor(ids),
            attention_mask=None if mask is None else torch.tensor(mask),
        )
    return out.logits.numpy()


def random_ids(batch: int, seq: int, vocab: int = TINY["vocab_size"], seed: int = 0):
    return np.random.RandomState(seed).randint(0, vocab, (batch, seq))
