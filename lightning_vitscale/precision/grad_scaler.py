"""fp16 loss scaling for sharded gradients; every rank agrees on whether a step is skipped."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_vitscale._compat import amp_unscale_and_check, dtensor_local
from lightning_vitscale.distributed.mesh import all_reduce_over


def local_groups(grads: Iterable[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """The gradients' local shards grouped by device and dtype, as fused multi-tensor ops take them; a complex one as
    the real view of its parts (the fused check has no complex kernel; unscaled in place through the view)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        local = dtensor_local(grad)
        local = torch.view_as_real(local) if local.is_complex() else local
        groups[(local.device, local.dtype)].append(local)
    return groups


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for DTensor gradients: unscales local shards, then the max of "found inf/nan" over
    the mesh (one rank's overflow skips the step everywhere, or the replicas drift apart)."""

    def _unscale_grads_(  # type: ignore[override]
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not allow_fp16 and any(grad.dtype == torch.float16 for grad in grads):
            raise ValueError("Attempting to unscale FP16 gradients; keep master weights in fp32 (16-mixed).")
        mesh = next((grad.device_mesh for grad in grads if isinstance(grad, DTensor)), None)
        found_per_device: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (device, _), group in local_groups(grads).items():
                found = found_per_device.setdefault(device, found_inf.to(device).clone())
                amp_unscale_and_check(group, found, inv_scale.to(device))
            if mesh is not None and mesh.size() > 1:  # every mesh dimension: 1-D and hybrid meshes alike
                for found in found_per_device.values():
                    all_reduce_over(found, mesh, op=dist.ReduceOp.MAX)
        return found_per_device
