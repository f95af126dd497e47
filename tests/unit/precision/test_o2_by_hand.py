"""``precision="bf16-mixed"`` on one device (the compute-copies path) against the recipe's O2 written out by hand
(``tests/helpers/o2_reference.py``); two ranks (FSDP2 units): tests/distributed/test_precision.py."""

from __future__ import annotations

import lightning as L

from lightning_vitscale import VitScaleStrategy
from tests.helpers.o2_reference import compare_with_o2_by_hand


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, strategy=VitScaleStrategy(), logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, **kwargs)


def test_bf16_mixed_on_one_device_is_o2_by_hand_bit_for_bit():
    """Losses and every parameter and saved buffer after three AdamW steps. Mutations seen failing: norms left in
    bf16, a saved fp32 buffer's owner without autocast (its output left in fp32), unsaved buffers kept in fp32."""
    facts = compare_with_o2_by_hand(_trainer, "bf16-mixed")
    assert facts["losses"] == facts["by_hand"] and len(facts["losses"]) == 3, facts
    assert facts["different"] == [] and facts["compared"] >= 20, facts
