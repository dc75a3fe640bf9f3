"""Errors raised while reading or writing checkpoints."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""
