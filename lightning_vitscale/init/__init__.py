"""Creating big models: where ``configure_model()`` builds on each rank, rank 0's values scattered into each unit's
shards as it is sharded (DDP's weights bit for bit), or the model's own init replayed on the shards of a model
built on the meta device.

May import ``_utils`` and ``_compat`` only; the sharding pipeline calls in here unit by unit.
"""

from lightning_vitscale.init.creation import Creation, ModelCreation, host_copies
from lightning_vitscale.init.initial_weights import InitialWeights
from lightning_vitscale.init.settings import InitMode, InitSettings

__all__ = ["Creation", "InitMode", "InitSettings", "InitialWeights", "ModelCreation", "host_copies"]
