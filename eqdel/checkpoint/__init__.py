"""Hugging Face checkpoints (config.json + safetensors) in and out; GGUF files in."""

from ._errors import CheckpointError as CheckpointError
from ._ggml_blocks import KEPT_TYPES as KEPT_TYPES
from ._gguf import (
    GGUF_ARCHITECTURES as GGUF_ARCHITECTURES,
    GGUF_TENSOR_TYPES as GGUF_TENSOR_TYPES,
    GGUFCheckpoint as GGUFCheckpoint,
)
from ._layout import HFTensor as HFTensor, hf_layout as hf_layout
from ._load import from_pretrained as from_pretrained
from ._save import save_pretrained as save_pretrained
