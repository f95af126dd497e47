"""Every unit gets its starting values as the pipeline shards it, never the whole model at once.

Three cases, decided once per model (``path``):

- ``"built"``: the model existed before setup (built in ``__init__``, the DDP habit). Every rank holds a copy;
  each unit, as it is sharded, receives rank 0's values (DDP's broadcast, one unit at a time, onto the device).
- ``"exact"``: ``configure_model()`` ran for real on rank 0 only (``creation.py``); the other ranks' units are
  meta until sharded, then get storage for their shards only and receive them from rank 0, which drops its full
  copy of the unit right after. Peak: rank 0's one copy; the others, their shards plus one tensor in flight.
- ``"meta"``: every rank built on meta; each shard replays the init the model's code recorded, with a seed per
  tensor and shard, so shards differ and replicas agree. What cannot be replayed is named in a warning.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_vitscale._utils import local_tensor
from lightning_vitscale.init.creation import Creation, PeakRss
from lightning_vitscale.init.replay import Recipe, replay, tensor_seed
from lightning_vitscale.init.scatter import materialize_meta, scatter_from

_INIT_METHODS = ("reset_parameters", "_reset_parameters")  # torch's MultiheadAttention only has the private one
Slot = tuple[nn.Module, str, str, str, bool]  # owner, "param" | "buffer", attribute, qualified name, was meta


class InitialWeights:
    """Starting values for a model that is being sharded unit by unit (see the module docstring)."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, device: torch.device, creation: Creation | None) -> None:
        self.mesh, self.device = mesh, device
        meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        self.path = creation.path if creation is not None else ("meta" if meta else "built")
        self.recipes: dict[str, Recipe | None] = creation.recipes if creation is not None else {}
        self.peak = creation.peak if creation is not None and creation.peak is not None else PeakRss()
        self.names = {id(m): name for name, m in model.named_modules()}
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.base_seed = self._shared_seed() if self.path == "meta" else 0
        self.not_reproduced: dict[str, str] = {}  # name -> what was done instead
        self._done: set[int] = set()

    def _shared_seed(self) -> int:
        seed = [torch.initial_seed()]
        if self.mesh.size() > 1:
            group = self.mesh.get_group() if self.mesh.ndim == 1 else None  # a data-parallel slice: its group
            dist.broadcast_object_list(seed, src=int(self.mesh.mesh.flatten()[0]), group=group)
        return int(seed[0])

    def _slots(self, root: nn.Module, recurse: bool = True) -> list[Slot]:
        """Plain parameters and the buffers of ``root``, outside units sharded before it, in a fixed order."""
        found: list[Slot] = []

        def visit(module: nn.Module) -> None:
            prefix = self.names.get(id(module), "")
            for kind, tensors in (("param", module._parameters), ("buffer", module._buffers)):
                for attr, tensor in tensors.items():
                    if tensor is None or isinstance(tensor, DTensor) or id(tensor) in self._done:
                        continue
                    found.append((module, kind, attr, f"{prefix}.{attr}" if prefix else attr, tensor.is_meta))
            for child in module.children() if recurse else ():
                if not isinstance(child, FSDPModule):
                    visit(child)

        visit(root)
        return found

    def prepare(self, modules: list[nn.Module]) -> None:
        """Values and device for modules kept outside the FSDP units (fp32 norms), before they are converted."""
        for module in modules:
            slots = self._slots(module, recurse=False)
            full = self._full(slots)
            for owner, kind, attr, _, _ in slots:
                tensor = getattr(owner, attr)
                if not tensor.is_meta and tensor.device != self.device:
                    moved = tensor.detach().to(self.device)
                    if kind == "param":
                        torch.utils.swap_tensors(tensor, nn.Parameter(moved, requires_grad=tensor.requires_grad))
                    else:
                        owner._buffers[attr] = moved
            materialize_meta(module, self.device, recurse=False)
            self._fill(slots, full)

    @contextmanager
    def unit(self, unit: nn.Module) -> Iterator[None]:
        """Wrap the ``fully_shard`` of one unit: values are taken before and delivered to the shards after."""
        slots = self._slots(unit)
        full = self._full(slots)
        yield
        materialize_meta(unit, self.device)
        self._fill(slots, full)

    def _full(self, slots: list[Slot]) -> list[torch.Tensor | None]:
        """The source rank's full tensors of a unit, held until its shards are delivered (one unit at a time)."""
        if self.rank != int(self.mesh.mesh.flatten()[0]):
            return [None] * len(slots)
        return [None if was_meta else getattr(owner, attr).detach() for owner, _, attr, _, was_meta in slots]

    @torch.no_grad()
    def _fill(self, slots: list[Slot], full: list[torch.Tensor | None]) -> None:
        forked = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=forked):
            owners_to_reset: dict[int, nn.Module] = {}
            for (owner, _, attr, name, was_meta), source in zip(slots, full):
                tensor = getattr(owner, attr)
                self._done.add(id(tensor))
                if self.path == "meta" and was_meta:  # else real on every rank (built before setup): rank 0's
                    self._replay(owner, name, tensor, owners_to_reset)
                else:
                    scatter_from(source, tensor, self.mesh)
            for owner in owners_to_reset.values():
                self._reset(owner)
        full.clear()

    def _replay(self, owner: nn.Module, name: str, tensor: torch.Tensor, owners: dict[int, nn.Module]) -> None:
        recipe = self.recipes.get(name)
        local = local_tensor(tensor)
        if recipe is not None and recipe.initialised:
            replay(local, recipe, tensor_seed(self.base_seed, name, _shard_index(tensor)))
            return
        local.zero_()  # never uninitialised memory, whatever happens next
        reason = recipe.broken if recipe is not None and recipe.broken else "no init call set its values"
        if any(callable(getattr(owner, m, None)) for m in _INIT_METHODS):
            owners[id(owner)] = owner
            if self.recipes:  # without any recording (built on meta outside configure_model) this is the init
                self.not_reproduced[name] = f"{reason}; re-initialised by {type(owner).__name__}.reset_parameters()"
        else:
            self.not_reproduced[name] = f"{reason}; zero-filled"

    def _reset(self, owner: nn.Module) -> None:
        torch.manual_seed(tensor_seed(self.base_seed, self.names.get(id(owner), ""), self.rank))
        next(getattr(owner, m) for m in _INIT_METHODS if callable(getattr(owner, m, None)))()

    def finish(self) -> tuple[str, int, float]:
        """Warn about what could not be reproduced; returns (path, peak host bytes, seconds) for the summary."""
        if self.not_reproduced:
            shown = "; ".join(f"{name} ({what})" for name, what in list(self.not_reproduced.items())[:8])
            more = f" ... and {len(self.not_reproduced) - 8} more" if len(self.not_reproduced) > 8 else ""
            rank_zero_warn(
                f"VitScaleStrategy built {len(self.not_reproduced)} tensor(s) on the meta device whose init could not"
                f" be reproduced on the shards: {shown}{more}. Initialise them with `nn.init` functions or"
                " elementwise in-place ops on the whole tensor (or use init='exact' if one copy fits in memory)."
            )
        peak, seconds = self.peak.stop()
        return self.path, peak, seconds


def _shard_index(tensor: torch.Tensor) -> int:
    """Which piece of the tensor this rank holds: replicas share index 0, so they draw identical values."""
    if not isinstance(tensor, DTensor) or all(p.is_replicate() for p in tensor.placements):
        return 0
    return tensor.device_mesh.get_rank()
