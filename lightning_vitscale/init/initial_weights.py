"""Every unit gets its starting values as the pipeline shards it, never the whole model at once.

Three cases, decided once per model (``path``):

- ``"built"``: the model existed before setup (built in ``__init__``, the DDP habit): each unit, as it is sharded,
  receives rank 0's values (DDP's broadcast, one unit at a time).
- ``"exact"``: ``configure_model()`` ran for real on rank 0 only (``creation.py``); the others' units get storage
  for their shards only, filled from rank 0, which drops the unit's full copy right after.
- ``"meta"``: every rank built on meta; each shard replays the recorded init with a seed per tensor and shard
  (shards differ, replicas agree); what cannot be replayed is named in a warning.

With tensor parallelism the blocks are split on meta tensors before they are sharded (rank 0's values wait in
:meth:`InitialWeights.hold`); on the exact path every rank then receives its own box of the (tensor x data
parallel) layout from global rank 0 (``scatter.scatter_boxes``).
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

from lightning_vitscale._compat import INIT_METHODS, buffer_slots, dtensor_local, parameter_slots
from lightning_vitscale.init.creation import Creation, PeakRss
from lightning_vitscale.init.replay import Recipe, replay, tensor_seed
from lightning_vitscale.init.scatter import gather_boxes, materialize_meta, scatter_boxes, scatter_from
from lightning_vitscale.row_layout import PACKED_ROWS, interleaved_rows

Slot = tuple[nn.Module, str, str, str, bool]  # owner, "param" | "buffer", attribute, qualified name, was meta


class InitialWeights:
    """Starting values for a model that is being sharded unit by unit (see the module docstring)."""

    def __init__(
        self, model: nn.Module, mesh: DeviceMesh, device: torch.device, creation: Creation | None,
        tensor_mesh: DeviceMesh | None = None,
    ) -> None:
        self.mesh, self.device = mesh, device
        # ``mesh`` is one data-parallel slice of the world: seeds are agreed, and values sent, over all ranks.
        self.split = tensor_mesh is not None and tensor_mesh.size() > 1
        meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        self.path = creation.path if creation is not None else ("meta" if meta else "built")
        self.recipes: dict[str, Recipe | None] = creation.recipes if creation is not None else {}
        self.peak = creation.peak if creation is not None else PeakRss()
        self.names = {id(m): name for name, m in model.named_modules()}
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.base_seed = self._shared_seed() if self.path == "meta" else 0
        self.not_reproduced: dict[str, str] = {}  # name -> what was done instead
        self._done: set[int] = set()
        self._held: dict[tuple[int, str], torch.Tensor] = {}  # (id(owner), attribute) -> rank 0's real values
        # Exact path under tensor parallelism: global rank 0 alone holds values, every rank receives its box.
        self.from_rank0 = self.split and self.path == "exact"

    def _shared_seed(self) -> int:
        seed = [torch.initial_seed()]
        if self.split:  # the data-parallel slices hold replicas of each other's shards: one seed for the world
            dist.broadcast_object_list(seed, src=0)
        elif self.mesh.size() > 1:
            group = self.mesh.get_group() if self.mesh.ndim == 1 else None  # a data-parallel slice: its group
            dist.broadcast_object_list(seed, src=int(self.mesh.mesh.flatten()[0]), group=group)
        return int(seed[0])

    def _slots(self, root: nn.Module, recurse: bool = True) -> list[Slot]:
        """Plain parameters and the buffers of ``root``, outside units sharded before it, in a fixed order."""
        found: list[Slot] = []

        def visit(module: nn.Module) -> None:
            prefix = self.names.get(id(module), "")
            for kind, tensors in (("param", parameter_slots(module)), ("buffer", buffer_slots(module))):
                for attr, tensor in tensors.items():
                    # A DTensor is already sharded with its values, unless tensor parallelism split it on meta.
                    done = isinstance(tensor, DTensor) and not tensor.is_meta
                    if tensor is None or done or id(tensor) in self._done:
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
            self._prepare(module, self._slots(module, recurse=False))

    def prepare_parameters(self, owned: list[tuple[nn.Module, str]]) -> None:
        """Values and device for single parameters kept outside the FSDP units (0-dim ones), the owner's others
        left to its unit."""
        for module, attr in owned:
            slots = [slot for slot in self._slots(module, recurse=False) if slot[1] == "param" and slot[2] == attr]
            self._prepare(module, slots, only={attr})

    def _prepare(self, module: nn.Module, slots: list[Slot], only: set[str] | None = None) -> None:
        full = self._full(slots)
        for owner, kind, attr, _, _ in slots:
            tensor = getattr(owner, attr)
            if not tensor.is_meta and tensor.device != self.device:
                moved = tensor.detach().to(self.device)
                if kind == "param":
                    torch.utils.swap_tensors(tensor, nn.Parameter(moved, requires_grad=tensor.requires_grad))
                else:
                    buffer_slots(owner)[attr] = moved
        materialize_meta(module, self.device, recurse=False, only=only)
        self._fill(slots, full)

    @torch.no_grad()
    def hold(self, modules: list[nn.Module]) -> None:
        """Before tensor parallelism splits ``modules`` on the exact path: rank 0's values leave them, kept here
        until each unit's shards are delivered (no copy: the same storage), so that every rank splits meta
        tensors alike, without communication. Parameters are swapped in place: ties and references stay valid."""
        if not self.from_rank0 or self.rank != 0:
            return
        swapped: dict[int, torch.Tensor] = {}
        for module in modules:
            for owner in module.modules():
                for attr, param in parameter_slots(owner).items():
                    if param is None or param.is_meta:
                        continue
                    if id(param) not in swapped:
                        empty = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
                        torch.utils.swap_tensors(param, empty)  # `param` is meta now, `empty` holds the values
                        swapped[id(param)] = empty.detach()
                    self._held[(id(owner), attr)] = swapped[id(param)]
                buffers = buffer_slots(owner)
                for attr, buffer in buffers.items():
                    if buffer is not None and not buffer.is_meta:
                        self._held[(id(owner), attr)] = buffer
                        buffers[attr] = torch.empty_like(buffer, device="meta")

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
        if self.rank != (0 if self.from_rank0 else int(self.mesh.mesh.flatten()[0])):
            return [None] * len(slots)
        return [
            self._held.pop((id(owner), attr), None) if was_meta else getattr(owner, attr).detach()
            for owner, _, attr, _, was_meta in slots
        ]

    @torch.no_grad()
    def _fill(self, slots: list[Slot], full: list[torch.Tensor | None]) -> None:
        forked = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=forked):
            owners_to_reset: dict[int, nn.Module] = {}
            # Every rank's box of each slot, where values come from global rank 0 alone (one collective per unit).
            boxes = gather_boxes([getattr(o, a) for o, _, a, _, _ in slots]) if self.from_rank0 and slots else None
            for index, ((owner, _, attr, name, was_meta), source) in enumerate(zip(slots, full)):
                tensor = getattr(owner, attr)
                self._done.add(id(tensor))
                if self.path == "meta" and was_meta:  # else real on every rank (built before setup): rank 0's
                    self._replay(owner, name, tensor, owners_to_reset)
                elif self.split and self.path == "built":
                    continue  # apply_tp broadcast rank 0's values before the split: fully_shard kept each rank's
                elif boxes is not None:
                    scatter_boxes(_split_order(owner, source), tensor, [mine[index] for mine in boxes])
                else:
                    scatter_from(source, tensor, self.mesh)
            for owner in owners_to_reset.values():
                self._reset(owner)
        full.clear()

    def _replay(self, owner: nn.Module, name: str, tensor: torch.Tensor, owners: dict[int, nn.Module]) -> None:
        recipe = self.recipes.get(name)
        local = dtensor_local(tensor)
        if recipe is not None and recipe.initialised:
            replay(local, recipe, tensor_seed(self.base_seed, name, _shard_index(tensor)))
            return
        local.zero_()  # never uninitialised memory, whatever happens next
        reason = recipe.broken if recipe is not None and recipe.broken else "no init call set its values"
        if any(callable(getattr(owner, m, None)) for m in INIT_METHODS):
            owners[id(owner)] = owner
            if self.recipes:  # without any recording (built on meta outside configure_model) this is the init
                self.not_reproduced[name] = f"{reason}; re-initialised by {type(owner).__name__}.reset_parameters()"
        else:
            self.not_reproduced[name] = f"{reason}; zero-filled"

    def _reset(self, owner: nn.Module) -> None:
        torch.manual_seed(tensor_seed(self.base_seed, self.names.get(id(owner), ""), self.rank))
        next(getattr(owner, m) for m in INIT_METHODS if callable(getattr(owner, m, None)))()

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
    """Which piece of the tensor this rank holds, from its coordinates along the mesh dimensions that shard it:
    replicas (ranks apart only along replicating dimensions: hybrid sharding's replicas, a tensor-parallel group
    for what it does not split) share an index, so they draw identical values; every piece has its own."""
    if not isinstance(tensor, DTensor):
        return 0
    mesh, index = tensor.device_mesh, 0
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # a rank holds a shard of a mesh it belongs to
    for dim, placement in enumerate(tensor.placements):
        if not (placement.is_replicate() or placement.is_partial()):
            index = index * mesh.size(dim) + coordinate[dim]
    return index


def _split_order(owner: nn.Module, full: torch.Tensor | None) -> torch.Tensor | None:
    """Rank 0's full values in the order the split tensor holds them: a packed projection's rows per rank
    (``PackedColwiseParallel``), everything else as it is."""
    packed = owner.__dict__.get(PACKED_ROWS)
    return interleaved_rows(full, *packed) if full is not None and packed is not None else full
