"""Every error the checkpoint package raises, in one module; each message names the path and the fix."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model; the message names the path and what is wrong."""


class AsyncSaveError(CheckpointError):
    """A background save failed; the checkpoint it was writing was not committed."""


class StateDictGatherError(RuntimeError):
    """Gathering a sharded model's ``state_dict()`` (or its ``copy.deepcopy``) failed, most often because not every
    rank called it."""
