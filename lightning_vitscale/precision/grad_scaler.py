"""fp16 loss scaling for sharded gradients; every rank agrees on whether a step is skipped."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_vitscale._compat import amp_unscale_and_check
from lightning_vitscale.distributed.mesh import all_reduce_over


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for DTensor gradients.

    Unscales each rank's local shards, then takes the max of "found inf/nan" across the mesh: a rank whose
    shard overflowed must make every rank skip the step and lower the scale, or the replicas drift apart.
    """

    def _unscale_grads_(  # type: ignore[override]
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        mesh = None
        for param_group in optimizer.param_groups:
            for param in param_group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients; keep master weights in fp32 (16-mixed).")
                if isinstance(grad, DTensor):
                    mesh = grad.device_mesh
                    grad = grad.to_local()
                groups[(grad.device, grad.dtype)].append(grad)
        found_per_device: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (device, _), grads in groups.items():
                found = found_per_device.setdefault(device, found_inf.to(device).clone())
                amp_unscale_and_check(grads, found, inv_scale.to(device))
            if mesh is not None and mesh.size() > 1:  # every mesh dimension: 1-D and hybrid meshes alike
                for found in found_per_device.values():
                    all_reduce_over(found, mesh, op=dist.ReduceOp.MAX)
        return found_per_device
