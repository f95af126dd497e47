"""Two gloo ranks: DDP (eager, no checkpointing) against VitScaleStrategy with compiled blocks (inductor), with and
without activation checkpointing, on a ViT with dropout everywhere. Inductor draws from torch's generator
(``fallback_random``) so masks can match; a run whose recompute does not restore the RNG state is the negative
control. Each rank writes ``rank{r}.json``."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
import torch.distributed as dist

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.kernels import KernelPolicy
from tests.helpers.models import largest_weight_difference, train_dropout_vit

COMPILED = KernelPolicy(compile_blocks=True)  # "auto" is eager on CPU; this is its CUDA block compile


def main(out: Path) -> None:
    inductor_config.fallback_random = True
    ddp = train_dropout_vit("ddp", "cpu", devices=2)
    facts = {"ddp_losses": ddp["losses"]}
    for name, checkpointing in (("compiled_checkpointed", True), ("compiled", False)):
        run = train_dropout_vit(VitScaleStrategy(kernels=COMPILED, activation_checkpointing=checkpointing), "cpu", 2)
        facts[name] = dict(losses=run["losses"], graphs=run["graphs"], graph_breaks=run["graph_breaks"],
                           checkpointed=run["checkpointed"],
                           weight_difference=largest_weight_difference(run["weights"], ddp["weights"]))
    torch.utils.checkpoint.checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, preserve_rng_state=False)
    control = train_dropout_vit(VitScaleStrategy(kernels="eager", activation_checkpointing=True), "cpu", 2)
    facts["control_weight_difference"] = largest_weight_difference(control["weights"], ddp["weights"])
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
