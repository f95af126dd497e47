"""``.numpy()`` of a DTensor (``np.asarray(t)`` and TensorBoard's ``add_histogram`` call it): the value, as under
DDP, where this rank holds it whole; where it is sharded over ranks, an error at once that names the fix.

Torch refuses ``.numpy()`` of every tensor subclass (".numpy() is not supported for tensor subclasses."), so the DDP
habit of logging weight and gradient histograms (``self.logger.experiment.add_histogram(name, p, step)`` in
``on_after_backward``, ``on_before_optimizer_step`` or at an epoch's end) failed under this strategy on every setup,
one device included, where each DTensor holds the whole value. A sharded value would have to be gathered, and the
habit reads on rank 0 alone (a logger's experiment is a no-op on the other ranks), where a gather would wait for
ranks that never come: so it is refused without communicating, naming ``p.full_tensor()`` made on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_vitscale._compat import dtensor_local, keep_storages_shared_with_numpy, read_dtensor_arrays
from lightning_vitscale.distributed.scalar_reads import whole_here


class ShardedArrayReadError(RuntimeError):
    """``.numpy()`` of a tensor sharded over ranks: its values lie on every rank; nothing was gathered."""


def read_whole_arrays(device: torch.device) -> None:
    """``.numpy()`` of a DTensor whole on this rank gives its values; of a sharded one, :class:`ShardedArrayReadError`.
    On a CPU ``device``, a step's own ``.numpy()`` of a gathered parameter no longer breaks its reshard (the guard
    costs a check per parameter per reshard: only where NumPy can share a parameter's memory). Process-wide, once."""
    read_dtensor_arrays(_numpy)
    if device.type == "cpu":
        keep_storages_shared_with_numpy()


def _numpy(tensor: DTensor, force: bool) -> Any:
    if tensor.requires_grad and not force:  # torch's own rule for a plain tensor, as under DDP
        raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
    if whole_here(tensor):
        return dtensor_local(tensor).detach().numpy(force=force)
    raise ShardedArrayReadError(
        f"`.numpy()` of a sharded tensor (a DTensor of shape {tuple(tensor.shape)}, {tensor.placements} over"
        f" {tensor.device_mesh.size()} ranks: a parameter or gradient, or a value computed from one; TensorBoard's"
        " `add_histogram` and `np.asarray` call it): its values lie on every rank, and a read on one rank alone (a"
        " logger's experiment runs on rank 0 only) cannot gather them, so nothing was sent. Gather it on every rank"
        " first: `p.full_tensor()` (a collective; e.g. `self.logger.experiment.add_histogram(name, p.full_tensor(),"
        " step)` in a hook every rank runs), or `p.to_local()` for this rank's part alone."
    )
