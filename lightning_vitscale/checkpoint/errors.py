"""The error every checkpoint path raises for a checkpoint it cannot load, naming the path and the fix."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model; the message names the path and what is wrong."""
