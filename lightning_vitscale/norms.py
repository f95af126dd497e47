"""Mechanism: normalization layers kept in fp32 inside a low-precision model, at one extra collective per step.

FAIR's finding: bf16 trains ViTs with fp32 hyper-parameters only if normalization layers stay in fp32. The usual
fix (one FSDP unit per norm) triples the all-gathers. Instead, norm parameters leave the bf16 FSDP units and
become fp32 DTensors *replicated* on every rank (they are tiny): optimizers, clipping and DCP see DTensors like
every other parameter; a forward pre-hook hands the module its local fp32 tensor and fp32 inputs, a post-hook
casts the output back; one coalesced all-reduce per backward averages their gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_vitscale._compat import DTensor, tree_map
from lightning_vitscale.mesh import all_reduce_over, replicated_placements

_PARAMS = "_vitscale_fp32_params"
_OUT_DTYPE = "_vitscale_out_dtype"


def _floating_input_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.dtype
    return None


class ReplicatedNorms:
    """fp32 norm layers held outside the FSDP units; owns their hooks and their gradient reduction."""

    def __init__(self, modules: list[nn.Module], mesh: DeviceMesh, dtype: torch.dtype = torch.float32) -> None:
        self.mesh, self.dtype = mesh, dtype
        self._to_norm_dtype = _caster(dtype)  # built once: the hooks run on every norm call
        self.params: list[nn.Parameter] = []
        for module in modules:
            self._convert(module)

    def _convert(self, module: nn.Module) -> None:
        originals = {}
        for name, param in list(module.named_parameters(recurse=False)):
            local = param.detach().to(self.dtype)
            replicated = nn.Parameter(
                DTensor.from_local(local, self.mesh, replicated_placements(self.mesh), run_check=False),
                requires_grad=param.requires_grad,
            )
            module.register_parameter(name, replicated)
            originals[name] = replicated
            self.params.append(replicated)
        setattr(module, _PARAMS, originals)
        module.register_forward_pre_hook(self._enter, with_kwargs=True)
        module.register_forward_hook(self._leave, with_kwargs=True)

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
        # The module's own forward runs on plain local fp32 tensors; to_local() is differentiable, so the
        # gradient lands on the replicated DTensor parameter (its local part; reduce_grads() averages it).
        for name, param in getattr(module, _PARAMS).items():
            module._parameters[name] = param.to_local()
        setattr(module, _OUT_DTYPE, _floating_input_dtype(args, kwargs))
        return tree_map(self._to_norm_dtype, args), tree_map(self._to_norm_dtype, kwargs)

    def _leave(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        module._parameters.update(getattr(module, _PARAMS))
        out_dtype = getattr(module, _OUT_DTYPE)
        return tree_map(_caster(out_dtype), output) if out_dtype is not None else output

    def ignored(self) -> set[nn.Parameter]:
        return set(self.params)

    @torch.no_grad()
    def reduce_grads(self) -> int:
        """Average the norm gradients over every rank of the mesh, one coalesced collective per mesh dimension
        (a hybrid mesh: within the node, then across nodes); returns how many collectives ran."""
        grads = [p.grad.to_local() for p in self.params if p.grad is not None]
        if not grads or self.mesh.size() == 1:
            return 0
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
        all_reduce_over(flat, self.mesh)  # SUM: gloo has no AVG
        flat.div_(self.mesh.size())
        for grad, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(chunk.view_as(grad))
        return sum(1 for dim in range(self.mesh.ndim) if self.mesh.size(dim) > 1)


def _caster(dtype: torch.dtype | None):
    def cast(value: Any) -> Any:
        if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    return cast
