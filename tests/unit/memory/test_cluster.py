"""``python -m lightning_vitscale plan`` on a named cluster: the predicted images/s of DDP + AMP O1, the plan and the
recipe, marked as a prediction, from the planner's whole-step model (``memory/cluster.py``)."""

from __future__ import annotations

import re

import pytest

from lightning_vitscale.__main__ import main
from lightning_vitscale.cli.plan import _cluster


def test_the_plan_cli_predicts_a_named_cluster_and_says_it_is_a_prediction(capsys):
    """One H200 at 85% of its memory, ViT-H/14 at batch 32, as GPU run 3 measured it: DDP + AMP O1's largest batch
    there was 296 (118.8 GiB), at 369.0 images/s. Mutation: leaving out DDP's buckets and autocast's copy
    (``DDP_EXTRA_BYTES = 0``) gives batch 303."""
    code = main(["plan", "--config", "examples/configs/classification_vit_h.yaml", "--model",
                 "examples.classification:ViTClassifier", "--init-args", "num_classes=1000", "--cluster",
                 "1xh200-141gb", "--memory-fraction", "0.85"])
    out = capsys.readouterr().out
    assert code == 0 and "predicted throughput on 1 x h200-141gb (a PREDICTION" in out and "measured: " in out
    rows = {m.group(1): (int(m.group(2)), float(m.group(3).replace(",", ""))) for m in re.finditer(
        r"^\| ([^|]+?) \| (\d+) \| ([\d,.]+) \|", out, re.MULTILINE)}
    batch, images = rows["DDP + AMP O1, its largest batch"]
    assert 288 <= batch <= 300 and images == pytest.approx(369.0, rel=0.15)
    assert rows["DDP + AMP O1, the planned batch"][0] == rows["VitScaleStrategy(), the plan above"][0] == 32
    assert "the recipe, memory-first (every block checkpointed), its largest batch" in rows


def test_cluster_names():
    assert _cluster("8xa100-40gb") == (1, 8, "a100-40gb") and _cluster("16x8xH100-80GB") == (16, 8, "h100-80gb")
    for wrong in ("a100-40gb", "8xa100", "x8xa100-40gb"):
        with pytest.raises(SystemExit, match=r"\[NODESx\]DEVICESxGPU"):
            _cluster(wrong)


def test_the_planner_counts_only_the_per_process_memory_fraction(monkeypatch: pytest.MonkeyPatch):
    """A process capped by ``torch.cuda.set_per_process_memory_fraction`` (the GPU run's 40 GB table on an H200)
    plans for its share: every budget comes from ``device_memory``. Mutation: the total alone gives 80 GiB."""
    from types import SimpleNamespace

    import torch

    from lightning_vitscale._utils import GIB
    from lightning_vitscale.memory import device_memory

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.5)
    assert device_memory(torch.device("cuda")) == 40 * GIB
