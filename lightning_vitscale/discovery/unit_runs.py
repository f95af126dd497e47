"""Which consecutive blocks may share one FSDP unit (:class:`UnitRuns`): setup groups the blocks by them, and the
planner predicts the same units from them (it predicted runs of ``blocks_per_unit`` where setup also ended a unit at
a break in the measured call order: HF UperNet, planned as one unit, was made as five)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class UnitRuns:
    """Per block (``names``, in model order): ``unit_of``, its discovered unit (the modules of a container never
    called itself share one, never split), and ``sharing``, a key consecutive blocks must share to join one unit
    (:func:`sharing_keys`)."""

    names: tuple[str, ...]
    unit_of: tuple[int, ...]
    sharing: tuple[str, ...]
    _spans: dict[tuple[int, bool], tuple[range, ...]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, units: Sequence[tuple[str, Sequence[tuple[str, object]]]], measured: bool,
           order: Sequence[str] = ()) -> UnitRuns:
        """``units``: discovery's (each unit's name and its blocks); ``measured``, ``order``: :func:`sharing_keys`'s."""
        names = tuple(name for _, members in units for name, _ in members)
        unit_of = tuple(index for index, (_, members) in enumerate(units) for _ in members)
        return cls(names, unit_of, tuple(sharing_keys(units, measured, order)))

    def spans(self, per_unit: int, sharing: bool = True) -> tuple[range, ...]:
        """The block indices of each unit of at most ``per_unit`` blocks (more only to keep a discovered unit
        whole); ``sharing=False``: the keys ignored (one rank keeping every block: setup joins them all)."""
        key = (per_unit, sharing)
        if key not in self._spans:  # the planner's search asks thousands of times, a few sizes
            keys = self.sharing if sharing else None
            self._spans[key] = tuple(spans_of(len(self.names), per_unit, self.unit_of, keys))
        return self._spans[key]


def spans_of(
    n: int, per_unit: int, unit_of: Sequence[int] | None = None, sharing: Sequence[str] | None = None
) -> list[range]:
    """Runs of ``per_unit`` consecutive blocks of ``n``, one FSDP unit each (consecutive: FSDP2 gathers a list-unit
    at its first forward and reduce-scatters after its last backward); never splitting a discovered unit
    (``unit_of[i]``: block ``i``'s), never joining blocks of different ``sharing`` keys."""
    unit_of = range(n) if unit_of is None else unit_of
    found: list[range] = []
    start = 0
    for i in range(1, n + 1):
        if i < n and unit_of[i] == unit_of[i - 1]:
            continue
        if i < n and i - start < per_unit and (sharing is None or sharing[i] == sharing[i - 1]):
            continue
        found.append(range(start, i))
        start = i
    return found


def sharing_keys(
    units: Sequence[tuple[str, Sequence[tuple[str, object]]]], measured: bool, order: Sequence[str] = ()
) -> list[str]:
    """Per block, a key that consecutive blocks must share to join one FSDP unit: a list-unit gathers at its first
    member's forward and reduces after its last member's backward, so its members must run as one stretch. Where a
    step was measured at setup, ``order`` (the blocks it called, in order) says which do: two neighbours share a key
    where every call of the first is followed by one of the second and every call of the second follows one of the
    first (Swin's stages, CLIP's two towers, a backbone run on two crop sizes). HF Mask2Former's last pixel-decoder
    projection runs once, its mask MLP's first layer once per decoder layer, later: grouped, the step failed on
    resharded weights. A block the measured step did not call joins its neighbours' run. Where no step was measured
    (its calls unknown), the container each unit sits in."""
    names = [name for _, members in units for name, _ in members]
    if not measured:
        return [f"in {unit.rpartition('.')[0]}" for unit, members in units for _ in members]
    if not order:
        return [""] * len(names)
    after: dict[str, set[str | None]] = {}
    before: dict[str, set[str | None]] = {}
    for earlier, later in zip([None, *order], [*order, None]):
        if earlier is not None:
            after.setdefault(earlier, set()).add(later)
        if later is not None:
            before.setdefault(later, set()).add(earlier)
    keys, run, previous = [], 0, None
    for name in names:
        if name in before:  # called; one the measured step skipped (LayerDrop's draw) is stood in for in place
            if previous is not None and not (after[previous] == {name} and before[name] == {previous}):
                run += 1
            previous = name
        keys.append(f"run {run}")
    return keys


def in_call_order(members: Sequence[Sequence[str]], order: Sequence[str]) -> list[int]:
    """The units (``members``: each unit's block names) in the order a measured step first called them (``order``:
    the blocks it called, in order), as indices. Discovery lists them so (:func:`~.blocks.find_holding_units`): the
    blocks that run back to back may then share an FSDP unit though they sit in two containers (HF PoolFormer's patch
    embeddings and layers, one stage after the other; a stack run in reverse), and the planner's block order is the
    step's. Prefetch follows it too: in model order it would gather ahead a unit that already ran and hold it
    gathered until its next use (the whole model, for a reversed stack). A unit the step did not call keeps its
    place after the unit before it in model order (a block LayerDrop skipped at the measurement still runs later)."""
    first: dict[str, int] = {}
    for index, name in enumerate(order):
        first.setdefault(name, index)
    keys: list[tuple[int, int]] = []  # (the call it follows, 0 for a called unit or its model position after it)
    for position, names in enumerate(members):
        called = [first[name] for name in names if name in first]
        keys.append((min(called), 0) if called else (keys[-1][0] if keys else -1, position + 1))
    return sorted(range(len(members)), key=lambda index: keys[index])
