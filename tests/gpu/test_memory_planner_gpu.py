"""The memory planner against torch.cuda.max_memory_allocated for ViT-B/L/H on one GPU (1-rank FSDP2 mesh).

Each case shards the example ViT with the strategy's pipeline in bf16-mixed, takes two steps (optimizer state
exists), resets the CUDA high-water mark and measures the third step, over what was allocated before the model.
The first H200 run (2026-11-27) measured absolute peaks, so each case counted the models earlier cases left
(tests/gpu/conftest.py now empties the allocator first); its numbers are not the planner's error.

The step runs in Lightning's order (forward, then ``zero_grad``, backward, optimizer step), the loop the planner
plans for unless told otherwise (``TrainingLoop``). Until H100 run 4 it zeroed first: ViT-H/14 batch 16 without
checkpointing then peaked without last step's gradients (2.35 GiB) and the prediction read 1.159x.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from examples.models.vit import VisionTransformer
from lightning_vitscale.kernels.optimizers import prefer_foreach
from lightning_vitscale.memory.planner import step_inputs
from lightning_vitscale.memory.step_inputs import StepSettings
from lightning_vitscale.memory.step_model import predict_step
from lightning_vitscale.precision.settings import resolve_flag
from lightning_vitscale.sharding import CheckpointingPolicy, ParallelConfig, ShardingPolicy
from lightning_vitscale.sharding.outer_unit import OuterUnit
from lightning_vitscale.sharding.parallelize import parallelize

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
TOLERANCE = 0.15


@pytest.fixture(scope="module")
def mesh():
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh("cuda", (1,), mesh_dim_names=("data_parallel",))


@pytest.mark.parametrize("per_unit", [1, 3])  # blocks per FSDP unit: the planner models both
@pytest.mark.parametrize("ac", [True, False])
@pytest.mark.parametrize(("size", "batch"), [("vit-b16", 64), ("vit-l16", 32), ("vit-h14", 16)])
def test_predicted_peak_matches_max_memory_allocated(mesh, size, batch, ac, per_unit):
    predicted, measured = _predicted_and_measured(mesh, size, batch, ac, per_unit)
    ratio = predicted / measured
    label = f"{size} batch {batch} AC {ac} {per_unit}/unit"
    assert abs(ratio - 1) <= TOLERANCE, f"{label}: predicted/measured = {ratio:.3f}"


def _predicted_and_measured(mesh, size: str, batch: int, ac: bool, per_unit: int) -> tuple[int, int]:
    """The planner's peak and the third step's, over what was allocated before the model was built. A function
    of its own: its model is gone when the assertion fails (a failed test's frames outlive it)."""
    policy = resolve_flag("bf16-mixed")
    with torch.device("meta"):
        planned = VisionTransformer.from_size(size, 224, 3, 1000)
    inputs = step_inputs(planned, torch.empty(batch, 3, 224, 224, device="meta"), precision="bf16-mixed")
    depth = len(inputs.profile.blocks)
    every = frozenset(range(depth)) if ac else frozenset()
    predicted = predict_step(inputs, StepSettings(every, blocks_per_unit=per_unit)).peak

    before = torch.cuda.memory_allocated()
    with torch.device(CUDA):
        model = VisionTransformer.from_size(size, 224, 3, 1000)
    root = OuterUnit(model)
    config = ParallelConfig(sharding=ShardingPolicy(blocks_per_unit=per_unit),
                            checkpointing=CheckpointingPolicy(blocks=ac))
    parallelize(root, model, mesh, config, policy, CUDA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    prefer_foreach([optimizer])
    x = torch.randn(batch, 3, 224, 224, device=CUDA)
    y = torch.randint(0, 1000, (batch,), device=CUDA)

    def step() -> None:  # Lightning's automatic optimization order, which the planner plans for by default
        loss = F.cross_entropy(root(x).float(), y)  # training_step: the last step's gradients are still alive
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    step()
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return predicted, torch.cuda.max_memory_allocated() - before
