"""Functional training: losses, train states and pure train steps."""

from ._adamw import AdamW as AdamW, AdamWState as AdamWState
from ._checkpoint import (
    latest_train_step as latest_train_step,
    restore_train_state as restore_train_state,
    save_train_state as save_train_state,
)
from ._data import (
    batches as batches,
    pack as pack,
    read_texts as read_texts,
    tokenize as tokenize,
)
from ._loss import (
    IGNORE_INDEX as IGNORE_INDEX,
    causal_lm_loss as causal_lm_loss,
    chunked_cross_entropy as chunked_cross_entropy,
)
from ._step import (
    NonFiniteError as NonFiniteError,
    TrainState as TrainState,
    init_train_state as init_train_state,
    make_train_step as make_train_step,
)
