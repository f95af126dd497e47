"""Instruments for numerics tests: which dtypes each op saw, and how many collectives ran."""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all_single",  # CPU ranks' reduce-scatter (sharding/cpu_overlap.py: gloo's own is an all-reduce)
    "all_reduce",
    "all_gather",
    "broadcast",
)
_FUNCTIONAL = ("all_gather", "all_reduce", "all_to_all", "reduce_scatter", "broadcast")


class DtypeRecorder(TorchFunctionMode):
    """Records (op, input dtype, weight dtype) for every F.linear and F.layer_norm call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[tuple[str, str, str]] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            self.calls[("linear", str(args[0].dtype), str(args[1].dtype))] += 1
        elif func is F.layer_norm:
            weight = args[2] if len(args) > 2 else kwargs.get("weight")
            self.calls[("layer_norm", str(args[0].dtype), str(getattr(weight, "dtype", None)))] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    """Wraps torch.distributed's collectives (FSDP2 looks them up on the module at call time) and the functional
    collectives DTensor uses (``full_tensor()``, redistribute), counted as ``functional.<name>``."""
    counts: Counter[str] = Counter()
    patched = [(dist, name, name) for name in _COLLECTIVES if hasattr(dist, name)]
    patched += [(funcol, name, f"functional.{name}") for name in dir(funcol) if name.startswith(_FUNCTIONAL)]
    originals = [(module, name, getattr(module, name)) for module, name, _ in patched]

    def wrap(label, fn):
        def counted(*args, **kwargs):
            counts[label] += 1
            return fn(*args, **kwargs)

        return counted

    for (module, name, label), (_, _, fn) in zip(patched, originals):
        setattr(module, name, wrap(label, fn))
    try:
        yield counts
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)


def linear_bf16_share(calls: Counter) -> float:
    linear = {k: v for k, v in calls.items() if k[0] == "linear"}
    bf16 = sum(v for k, v in linear.items() if k[1] == k[2] == str(torch.bfloat16))
    return bf16 / max(sum(linear.values()), 1)


class TrafficRecorder:
    """Bytes this rank sends in the collectives really issued, split by whether the group spans nodes.

    Wraps ``torch.distributed``'s collective functions (FSDP2 looks them up at call time) and the functional
    all-reduce DTensor's redistributions call (tensor parallelism's all-reduces of activations: ``funcol`` is
    looked up at call time too), and reads the tensors and the process group of each call; ``by_group`` holds
    the bytes per group (its global ranks), so that a 2-D mesh's traffic is counted per mesh dimension. Each call
    counts as a ring over its group (all-gather / reduce-scatter:
    ``B (n - 1) / n`` of the unsharded buffer, all-reduce twice that), the convention the strategy's plan states.
    """

    _SIZES = {  # collective -> (argument holding the unsharded buffer, ring factor)
        "all_gather_single": ("output_tensor", 1.0),
        "all_gather_into_tensor": ("output_tensor", 1.0),
        "reduce_scatter_single": ("input", 1.0),
        "reduce_scatter_tensor": ("input", 1.0),
        "all_to_all_single": ("input", 1.0),  # CPU ranks' reduce-scatter: each rank sends (n - 1) / n of its input
        "all_reduce": ("tensor", 2.0),
    }

    def __init__(self, ranks_per_node: int) -> None:
        self.per_node = ranks_per_node
        self.intra = self.inter = 0.0
        self.calls: Counter[str] = Counter()
        self.by_group: Counter[tuple[int, ...]] = Counter()

    def _count(self, name: str, fn, args: tuple, kwargs: dict) -> None:
        bound = inspect.signature(fn).bind(*args, **kwargs).arguments
        key, factor = self._SIZES[name]
        tensor, group = bound[key], bound.get("group")
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self._add(name, ranks, factor * tensor.numel() * tensor.element_size())

    def _count_functional(self, fn, args: tuple, kwargs: dict) -> None:
        bound = inspect.signature(fn).bind(*args, **kwargs).arguments
        tensor = bound["self"]
        group = c10d._resolve_process_group(funcol._resolve_group_name(bound["group"], bound.get("tag", "")))
        self._add("functional_all_reduce", dist.get_process_group_ranks(group),
                  2.0 * tensor.numel() * tensor.element_size())

    def _add(self, name: str, ranks: list[int], buffer: float) -> None:
        n = len(ranks)
        sent = buffer * (n - 1) / n
        self.by_group[tuple(ranks)] += sent
        if len({r // self.per_node for r in ranks}) > 1:
            self.inter += sent
        else:
            self.intra += sent
        self.calls[name] += 1

    def by_dimension(self, world: int, tensor_parallel: int = 1) -> dict[str, float]:
        """The bytes of ``by_group`` summed per mesh dimension (:func:`per_dimension`)."""
        return per_dimension(self.by_group, world, tensor_parallel)

    @contextlib.contextmanager
    def recording(self) -> Iterator[TrafficRecorder]:
        originals = {name: getattr(dist, name) for name in self._SIZES if hasattr(dist, name)}

        def wrap(name, fn):
            def counted(*args, **kwargs):
                self._count(name, fn, args, kwargs)
                return fn(*args, **kwargs)

            return counted

        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        functional = funcol.all_reduce

        def functional_counted(*args, **kwargs):
            self._count_functional(functional, args, kwargs)
            return functional(*args, **kwargs)

        funcol.all_reduce = functional_counted
        try:
            yield self
        finally:
            funcol.all_reduce = functional
            for name, fn in originals.items():
                setattr(dist, name, fn)


def mesh_dimension(group: tuple[int, ...], world: int, tensor_parallel: int = 1) -> str:
    """The mesh dimension a process group runs over. Without tensor parallelism every group is data parallel (the
    world's: DDP, FSDP; its sub-groups: hybrid sharding). With ``tensor_parallel=k`` (mesh ``(world // k, k)``, TP
    innermost) TP's groups are ``k`` consecutive ranks and the data-parallel ones stride ``k``; anything else (the
    world's, e.g. a scalar all-reduce outside the mesh) is named ``"world"``."""
    if tensor_parallel == 1:
        return "data_parallel"
    if len(group) == tensor_parallel and group == tuple(range(group[0], group[0] + tensor_parallel)):
        return "tensor_parallel"
    if len(group) == world // tensor_parallel and all(b - a == tensor_parallel for a, b in zip(group, group[1:])):
        return "data_parallel"
    return "world"


def per_dimension(
    by_group: Mapping[tuple[int, ...], float], world: int, tensor_parallel: int = 1
) -> dict[str, float]:
    """Bytes sent per process group (``TrafficRecorder.by_group``) summed per mesh dimension
    (:func:`mesh_dimension`)."""
    out: dict[str, float] = {}
    for group, sent in by_group.items():
        name = mesh_dimension(group, world, tensor_parallel)
        out[name] = out.get(name, 0.0) + sent
    return out
