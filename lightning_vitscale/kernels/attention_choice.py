"""``attention="auto"`` over the first training steps: record the real SDPA shapes, time the kernels, agree, route."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_vitscale.kernels.attention import AttentionRouter, describe_choice, measure


def auto_attention_step(
    router: AttentionRouter | None,
    step: Callable[[], Any],
    mean_over_ranks: Callable[[torch.Tensor], torch.Tensor],
    decided: Callable[[str], None],
) -> Any:
    """Run one training ``step``; on the first (eager: recording is plain Python), record the blocks' SDPA shapes;
    before the second, decide, the timings averaged over ranks (``mean_over_ranks``) so every rank routes alike.
    ``decided`` receives the summary line."""
    if router is None or router.decided:
        return step()
    if not router.recorded:
        with router.record(), torch.compiler.set_stance("force_eager"):
            return step()
    line = decide_attention(router, mean_over_ranks)
    decided(line)
    rank_zero_info(f"VitScaleStrategy attention: {line}")
    return step()


def decide_attention(router: AttentionRouter, mean_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> str:
    """Route to the fastest kernel on the recorded shapes, timings averaged over ranks; ties keep SDPA."""
    local = measure(router.calls, list(router.candidates))
    averaged = mean_over_ranks(torch.tensor(list(local.values()), dtype=torch.float64))
    totals = {name: float(ms) for name, ms in zip(local, averaged.tolist())}
    choice = min(totals, key=totals.__getitem__)
    router.decide(choice)
    return describe_choice(choice, totals, router.calls)
