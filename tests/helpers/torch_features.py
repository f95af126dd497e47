"""What the installed torch lacks below the tested floor (2.14), for tests of features built on it: they skip, naming
the missing piece, on the GPU image's torch 2.11 (README: what ran where). CI runs the floor, where none skips."""

from __future__ import annotations

import inspect

import pytest
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import SelectiveCheckpointContext

# FSDP2 reduce-scatters a zero gradient for a parameter a rank did not use: `find_unused_parameters=True` needs it.
REDUCES_UNUSED_PARAMETERS = hasattr(FSDPModule, "set_reduce_scatter_unused_params")
# A selective-checkpointing policy sees each op's output: the in-place write check (memory/selective_ops.py) needs it.
POLICY_SEES_OUTPUTS = "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters

needs_unused_parameter_reduction = pytest.mark.skipif(
    not REDUCES_UNUSED_PARAMETERS, reason="this torch's FSDP2 has no set_reduce_scatter_unused_params (torch 2.14 has)"
)
needs_policy_outputs = pytest.mark.skipif(
    not POLICY_SEES_OUTPUTS, reason="this torch's SelectiveCheckpointContext has no op_output (torch 2.14 has)"
)
