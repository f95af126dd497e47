"""Every private torch/Lightning import and version gate lives here, so upgrades touch one file."""

from __future__ import annotations

import torch
from lightning.fabric.strategies.model_parallel import _load_checkpoint as lightning_load_sharded_checkpoint
from lightning.fabric.utilities.distributed import _destroy_dist_connection as destroy_process_group_safely
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.model_parallel import ModelParallelStrategy
from packaging.version import Version
from torch.distributed.tensor import DTensor

TORCH_VERSION = Version(torch.__version__.split("+")[0])
TORCH_GE_2_6 = TORCH_VERSION >= Version("2.6")

if TORCH_GE_2_6:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
else:  # pragma: no cover - pyproject requires torch>=2.6; kept to give a clear message on old installs
    raise ImportError(
        "lightning-vitscale needs torch>=2.6 for FSDP2 (`torch.distributed.fsdp.fully_shard`);"
        f" found {torch.__version__}. Upgrade torch: `pip install -U 'torch>=2.6'`."
    )

# Reading a whole DCP checkpoint into one process with no process group, as `dcp_to_torch_save` does
# (the public `dcp.load` fills a copy of the state dict, so the populated keys would be lost).
import torch._dynamo as dynamo  # noqa: E402  (config for regional compilation lives in kernels.py)
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device  # noqa: E402
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner  # noqa: E402
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as dcp_load_into  # noqa: E402
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase  # noqa: E402
from torch.nn.modules.instancenorm import _InstanceNorm as InstanceNormBase  # noqa: E402
from torch.optim.optimizer import _get_fused_kernels_supported_devices as fused_kernel_devices  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402

SubprocessScriptLauncher = _SubprocessScriptLauncher


def set_lightning_device(module: torch.nn.Module, device: torch.device) -> None:
    """What ``LightningModule.device`` reports: Lightning's device mixin keeps it in ``_device``, updated only by
    ``module.to(...)``, which a strategy that shards instead of moving never calls."""
    module._device = device  # type: ignore[assignment]

__all__ = [
    "destroy_process_group_safely",
    "EmptyStateDictLoadPlanner",
    "dcp_load_into",
    "dynamo",
    "optimizers_to_device",
    "BatchNormBase",
    "InstanceNormBase",
    "tree_map",
    "fused_kernel_devices",
    "SubprocessScriptLauncher",
    "lightning_load_sharded_checkpoint",
    "DTensor",
    "FSDPModule",
    "METADATA_FILENAME",
    "MixedPrecisionPolicy",
    "ModelParallelStrategy",
    "TORCH_VERSION",
    "fully_shard",
    "set_lightning_device",
]

METADATA_FILENAME = _METADATA_FILENAME
