"""Instruments for numerics tests: which dtypes each op saw, and how many collectives ran."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_gather",
    "broadcast",
)


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
    """Wraps torch.distributed's collectives (FSDP2 looks them up on the module at call time)."""
    counts: Counter[str] = Counter()
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def linear_bf16_share(calls: Counter) -> float:
    linear = {k: v for k, v in calls.items() if k[0] == "linear"}
    bf16 = sum(v for k, v in linear.items() if k[1] == k[2] == str(torch.bfloat16))
    return bf16 / max(sum(linear.values()), 1)
