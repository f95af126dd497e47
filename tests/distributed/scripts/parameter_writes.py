"""Rank script: a momentum encoder updated by user code (``tests/helpers/momentum.py``) under DDP and under
``VitScaleStrategy()`` / ``priority="memory"`` on 2 ranks; per scenario ``<update>-<where>/<strategy>`` this rank's
losses and the teacher's whole parameters after 4 steps."""

from __future__ import annotations

import warnings

from lightning_vitscale import VitScaleStrategy
from tests.helpers.momentum import fit_momentum, teacher_state
from tests.helpers.scenarios import run_scenarios

warnings.filterwarnings("ignore")
CASES = [("lightly", "start"), ("dino", "between"), ("dino", "end"), ("lightly", "batch_end")]
STRATEGIES = {"ddp": lambda: "ddp", "default": VitScaleStrategy, "memory": lambda: VitScaleStrategy(priority="memory")}


def scenario(update: str, where: str, strategy: str) -> dict:
    model = fit_momentum(STRATEGIES[strategy](), update, where, devices=2)
    return {"losses": model.losses,
            "teacher": {name: value.flatten().tolist() for name, value in teacher_state(model).items()}}


if __name__ == "__main__":
    run_scenarios({f"{update}-{where}/{strategy}": (lambda u=update, w=where, s=strategy: scenario(u, w, s))
                   for update, where in CASES for strategy in STRATEGIES})
