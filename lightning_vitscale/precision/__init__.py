"""Which dtype where: the Lightning precision plugin (BF16 "O2"), its dtype policy, fp32 normalization layers
kept outside the low-precision units, input casts, the sharded fp16 loss scaler, clipping across shards, the
non-finite step guard and the optimizer step on local shards.

May import ``discovery`` (which modules are norms), ``distributed``, ``_utils`` and ``_compat``.
"""

from lightning_vitscale.precision.casting import cast_floating_inputs
from lightning_vitscale.precision.clipping import grad_norm, lightning_grad_norm_named
from lightning_vitscale.precision.fp32_fix import note_fp32_fix
from lightning_vitscale.precision.nonfinite import NonFiniteGuard, NonFiniteTrainingError
from lightning_vitscale.precision.norms import ReplicatedNorms
from lightning_vitscale.precision.optimizer_probe import UnshardableOptimizerError, refuse_unshardable
from lightning_vitscale.precision.plugin import VitScalePrecision, to_vitscale_precision
from lightning_vitscale.precision.settings import SUPPORTED_FLAGS, PrecisionFlag, PrecisionPolicy, resolve_flag
from lightning_vitscale.precision.step_autocast import layers_compute_as_o2

__all__ = [
    "SUPPORTED_FLAGS",
    "NonFiniteGuard",
    "NonFiniteTrainingError",
    "PrecisionFlag",
    "PrecisionPolicy",
    "ReplicatedNorms",
    "UnshardableOptimizerError",
    "VitScalePrecision",
    "cast_floating_inputs",
    "grad_norm",
    "layers_compute_as_o2",
    "lightning_grad_norm_named",
    "note_fp32_fix",
    "refuse_unshardable",
    "resolve_flag",
    "to_vitscale_precision",
]
