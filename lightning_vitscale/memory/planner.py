"""Will this model, at this batch size, fit on these devices, and what should be turned on? ``plan_memory``
measures it on fake tensors (any size, no device), predicts each rank's peak and picks per block checkpointing,
reshard and blocks per unit: the least predicted step time that fits (:mod:`.plan_search`); CPU offload only when
nothing else fits; and the largest per-rank batch that fits.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from lightning_vitscale._compat import tree_leaves
from lightning_vitscale._utils import human_bytes
from lightning_vitscale.discovery import ModuleSelector
from lightning_vitscale.discovery.blocks import Named, find_holding_units
from lightning_vitscale.discovery.calls import Calls, recording
from lightning_vitscale.discovery.tensor_plan import TensorPlanSelector
from lightning_vitscale.discovery.unit_runs import UnitRuns
from lightning_vitscale.memory.activations import ModeOf, StepCall, measure_activations
from lightning_vitscale.memory.budget import DEFAULT_FRACTION, parse_memory, resolve_budget
from lightning_vitscale.memory.fake_modes import RealValues
from lightning_vitscale.memory.low_precision_failures import measure_keeping_fp32
from lightning_vitscale.memory.memory_plan import Candidate, MemoryPlan
from lightning_vitscale.memory.plan_search import BlockPlan, Modes, SearchSpace, search
from lightning_vitscale.memory.step_cost import GPU_RATES, DeviceRates, traffic_per_dimension
from lightning_vitscale.memory.step_inputs import (
    OPTIMIZER_STATES,
    ModelLayout,
    StepInputs,
    StepSettings,
    TrainingLoop,
    collective_copies,
)
from lightning_vitscale.memory.step_model import predict_step
from lightning_vitscale.memory.tensor_split import split_twin
from lightning_vitscale.memory.twin import fresh_caches
from lightning_vitscale.precision import PrecisionPolicy, resolve_flag


def model_parts(
    model: nn.Module, blocks: ModuleSelector | None, precision: PrecisionPolicy, called: Collection[str] | None = None,
    fed: Mapping[str, str] | None = None, listed: Sequence[str] = (),
) -> tuple[Named, list[nn.Module]]:
    """The blocks the strategy would shard (in ``listed``'s call order) and the norms it would keep in fp32, as
    parallelize finds them."""
    found = [pair for _, parts in find_holding_units(model, blocks, called, fed, listed) for pair in parts]
    norms = [m for _, m in precision.separate_norm_modules(model)]
    return found, norms


def plan_memory(
    model: nn.Module, example_input: Any, *, batch_size: int | None = None, world_size: int = 1,
    device_memory: str | int | float = "a100-80gb", precision: str = "bf16-mixed", optimizer: str = "adamw",
    memory_fraction: int | float = DEFAULT_FRACTION, blocks: ModuleSelector | None = None, tensor_parallel: int = 1,
    tensor_plan: TensorPlanSelector | None = None,
) -> MemoryPlan:
    """Plan one rank's memory for ``model`` (real or on the meta device) fed ``example_input`` per step.

    Args:
        model: the network the strategy will shard (e.g. a LightningModule after ``configure_model``).
        example_input: one (data-parallel) rank's input batch; meta tensors are fine.
        batch_size: per-rank batch planned for; ``None``: dim 0 of the first input tensor.
        world_size: all ranks (devices x nodes).
        device_memory: bytes (int), GiB (float/str) or a named GPU (``"a100-40gb"``, ...).
        optimizer: one of ``OPTIMIZER_STATES`` (``"adamw"``, ``"sgd"``, ...).
        memory_fraction: what the strategy's ``memory_budget`` takes.
        blocks, tensor_parallel, tensor_plan: the strategy's (under ``tensor_parallel=k`` each block is planned as
            one tensor-parallel rank's share, :mod:`.tensor_split`).

    Example::

        with torch.device("meta"):
            net = VisionTransformer.from_size("vit-h14", 224, 3, 1000)
        plan = plan_memory(net, torch.empty(32, 3, 224, 224, device="meta"), world_size=8, device_memory="a100-40gb")
        print(plan.summary())
    """
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be an int >= 1; got {tensor_parallel!r}.")
    if world_size < 1 or world_size % tensor_parallel:
        raise ValueError(f"tensor_parallel={tensor_parallel} does not divide world_size={world_size}: each block is"
                         " split over tensor_parallel consecutive ranks. Choose a divisor of the world size.")
    data_parallel = world_size // tensor_parallel
    inputs = step_inputs(model, example_input, batch_size=batch_size, world_size=data_parallel, precision=precision,
                         optimizer=optimizer, blocks=blocks, tensor_parallel=tensor_parallel, tensor_plan=tensor_plan)
    device_bytes = parse_memory(device_memory)
    planned_batch = batch_size or batch_size_of(example_input)
    budget = resolve_budget(memory_fraction, device_bytes, "memory_fraction")
    return choose(inputs, budget, device_bytes, precision, planned_batch, per_unit=None)


def step_inputs(
    model: nn.Module, example_input: Any, *, batch_size: int | None = None, world_size: int = 1,
    precision: str = "bf16-mixed", optimizer: str = "adamw", blocks: ModuleSelector | None = None,
    device: torch.device | str | None = None, loop: TrainingLoop | None = None, call: StepCall | None = None,
    mode_of: ModeOf | None = None, tensor_parallel: int = 1, tensor_plan: TensorPlanSelector | None = None,
    calls: Calls | None = None, values: RealValues | None = None, measured_batch: int | None = None,
    order: Sequence[str] | None = None,
) -> StepInputs:
    """Measure ``model`` on fake tensors for :func:`predict_step` (see :func:`plan_memory`; ``world_size``: one
    FSDP shard group; ``device``: where the step runs, ``None``: a GPU). ``calls``: filled with what the step called,
    even when it raises; a block it never called is measured as the modules of it that ran. The blocks are listed
    in the order the step calls them, as setup lists them from the same calls (``order``: in this order instead: the
    units setup made before any step, or ``()``, model order, where ranks may skip blocks). ``values``: the fake
    tensors carry these real ones (:func:`.measure_activations`); ``measured_batch``: the samples in
    ``example_input`` where its first tensor's first dimension is not (a list of images)."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} is not known; choose one of {', '.join(OPTIMIZER_STATES)}.")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}.")
    policy = resolve_flag(precision)
    record = calls if calls is not None else Calls()
    record.clear()
    measured_batch = measured_batch or batch_size_of(example_input)
    if values is not None and tensor_parallel > 1:
        raise ValueError("real values are carried for one whole model, not one tensor-parallel rank's share")

    def measure(called: Collection[str] | None = None, fed: Mapping[str, str] | None = None,
                policy: PrecisionPolicy = policy, listed: Sequence[str] = order or ()) -> StepInputs:
        twin, (found, norms), log = model, model_parts(model, blocks, policy, called, fed, listed), None
        if tensor_parallel > 1:  # one tensor-parallel rank's share
            twin, found, log = split_twin(model, found, tensor_parallel, tensor_plan)
            norms = model_parts(twin, None, policy)[1]
        with recording(twin, record, found), fresh_caches(twin):
            batch_dtype = policy.compute if policy.compute == policy.master else None  # as the plugin's convert_input
            profile = measure_activations(twin, found, example_input, policy.compute, norms, call, mode_of, log, values,
                                          batch_dtype)
        record.order = [found[index][0] for index in profile.order]
        record.without_gradient = profile.without_gradient
        return StepInputs(
            layout=ModelLayout.of(twin, [b for _, b in found], norms),
            profile=profile,
            world=world_size,
            master=policy.master,
            compute=policy.compute,
            reduce=policy.reduce,
            optimizer=optimizer,
            batch_scale=(batch_size or measured_batch) / measured_batch,
            collective_copies=collective_copies(device),
            loop=loop or TrainingLoop(),
            tensor=None if log is None else log.split([b.resent for b in profile.blocks]),
        )

    structure = [name for name, _ in model_parts(model, blocks, policy, listed=order or ())[0]]
    inputs = measure_keeping_fp32(lambda kept: measure(policy=kept), record, model, policy, structure)
    # Blocks never called (what of them ran) or called out of model order, modules run side by side taken for blocks
    # (MoE experts), or run in the step's own fp32 region (kept in fp32, `keeping_fp32`): measured again as setup will
    # find them from this run; once more where its order places blocks the first run did not list (parts of one).
    kept, called, fed = policy.keeping_fp32(record.in_fp32), set(record.called), dict(record.fed)
    for again in (kept is not policy, False):  # the set of blocks from the first run (LayerDrop's varies by run)
        listed = record.order if order is None else order
        found = [name for name, _ in model_parts(model, blocks, policy, called, fed, listed)[0]]
        if again or found != [b.name for b in inputs.profile.blocks]:
            inputs = measure(called, fed, kept, listed)
    return replace(inputs, runs=unit_runs(model, blocks, record, [b.name for b in inputs.profile.blocks], order))


def unit_runs(
    model: nn.Module, blocks: ModuleSelector | None, calls: Calls, names: list[str], order: Sequence[str] | None = None
) -> UnitRuns | None:
    """Which of the measured blocks (``names``) may share a unit, as setup finds them from the same ``calls``
    (``sharding.parallelize``; ``order``: as :func:`step_inputs`'): ``None`` where its blocks would not be these."""
    called = calls.called if calls.called and not calls.error else None
    listed = (calls.order if order is None else order) if called is not None else ()
    units = find_holding_units(model, blocks, called, calls.fed if called is not None else None, listed)
    runs = UnitRuns.of(units, called is not None, calls.order if called is not None else ())
    return runs if list(runs.names) == names else None


def batch_size_of(example_input: Any) -> int:
    first = next((t for t in tree_leaves(example_input) if isinstance(t, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        raise ValueError("example_input needs a tensor with a batch dimension first, e.g. torch.empty(8, 3, 224, 224).")
    return int(first.shape[0])


def choose(
    inputs: StepInputs, budget: int, device_bytes: int, precision: str, batch_size: int, offload: bool | None = None,
    rates: DeviceRates = GPU_RATES, reshard: bool | None = None, per_unit: int | None = 1, modes: Modes | None = None,
) -> MemoryPlan:
    """The plan for ``budget`` (:mod:`.plan_search`). ``offload``: ``None`` recommends CPU offload where nothing
    else fits, ``True`` / ``False`` say it is on / off; ``reshard``, ``per_unit`` and ``modes`` pin (``None``:
    chosen; pinned modes need be the only ones measured: then the every-block-full column and batch are not known)."""
    n = len(inputs.profile.blocks)
    on = bool(offload)
    space = SearchSpace(inputs, budget, rates, on, reshard, per_unit, modes)
    blocks = search(space)
    if not space.fits(blocks) and offload is None:  # offload is recommended only when nothing else fits
        space = replace(space, offload=True)
        blocks = search(space)
    settings = blocks.settings(space.offload)
    k = blocks.per_unit
    every = StepSettings(frozenset(range(n)), offload=on, blocks_per_unit=k)
    none = StepSettings(offload=on, blocks_per_unit=k)
    chosen = Candidate(settings, predict_step(inputs, settings))
    fits = chosen.breakdown.peak <= budget
    full_measured = all("full" in block.modes for block in inputs.profile.blocks)
    notes = []
    if settings.offload:
        host = predict_step(inputs, replace(settings, offload=False)).params  # what the device would hold
        states = OPTIMIZER_STATES[inputs.optimizer]
        notes.append(f"offload keeps {human_bytes(host * (2 + states))} of parameters, gradients and optimizer state"
                     " per rank in host memory (times the ranks per node)")
    tp = inputs.tensor.ranks if inputs.tensor is not None else 1
    return MemoryPlan(
        world_size=inputs.world * inputs.replicas * tp,
        precision=precision,
        batch_size=batch_size,
        budget=budget,
        device_memory=device_bytes,
        num_blocks=n,
        num_params=inputs.layout.num_params,
        chosen=chosen,
        all_checkpointed=Candidate(every, predict_step(inputs, every)) if full_measured else None,
        none_checkpointed=Candidate(none, predict_step(inputs, none)),
        fits=fits,
        max_batch=largest_batch(inputs, budget, batch_size, settings.offload) if full_measured else None,
        reason=_reason(blocks, n, fits, settings.offload, on),
        notes=notes,
        blocks=blocks,
        extra_seconds=space.seconds(blocks),
        tensor_parallel=tp,
        traffic=traffic_per_dimension(inputs, settings),
        inputs=inputs,
    )


def _reason(blocks: BlockPlan, n: int, fits: bool, offloaded: bool, offload_on: bool) -> str:
    if not fits:
        return "does not fit even with every block checkpointed" + (" and CPU offload" if offloaded else "")
    if offloaded and not offload_on:
        return "does not fit even with every block checkpointed: CPU offload of the sharded state"
    if n and not any(blocks.modes) and not blocks.resharded:
        return "everything fits: no checkpointing, blocks stay gathered for backward"
    return "the least predicted extra step time that fits the budget"


def largest_batch(inputs: StepInputs, budget: int, batch_size: int, offload: bool = False,
                  settings: StepSettings | None = None, extra: int = 0) -> int:
    """Largest per-rank batch whose peak plus ``extra`` bytes fits ``budget`` (``settings``: every block full)."""
    per_sample = inputs.batch_scale / batch_size
    chosen = settings or StepSettings(frozenset(range(len(inputs.profile.blocks))), offload=offload)

    def fits(b: int) -> bool:
        return predict_step(replace(inputs, batch_scale=per_sample * b), chosen).peak + extra <= budget

    if not fits(1):
        return 0
    hi = 1
    while fits(hi * 2) and hi < 2**20:
        hi *= 2
    lo, hi = hi, hi * 2
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
