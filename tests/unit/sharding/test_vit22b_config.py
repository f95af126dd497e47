"""The ViT-22B-sized example config (issue 34 item 5): 64 nodes x 8 GPUs, tensor parallelism 4 inside each node.

Checked without GPUs: the model is the size its name says, the strategy the config names takes its options, every
block gets the automatic plan (12 of 48 heads per rank, the packed qkv per-rank), and the global batch is 4096.
"""

from pathlib import Path

import torch
import yaml

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.discovery.tensor_plan import plan_block

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "examples/configs/classification_vit_22b_tp4.yaml"


def test_vit22b_config_splits_every_block_over_four_gpus_at_a_global_batch_of_4096() -> None:
    from examples.classification import ViTClassifier

    config = yaml.safe_load(CONFIG.read_text())
    trainer, strategy_spec = config["trainer"], config["trainer"]["strategy"]
    assert strategy_spec["class_path"] == "lightning_vitscale.VitScaleStrategy"
    strategy = VitScaleStrategy(**strategy_spec["init_args"])
    tp = strategy.config.sharding.tensor_parallel
    assert tp == 4 and strategy.init_settings.mode == "meta"
    module = ViTClassifier(**config["model"], num_classes=1000, in_chans=3, img_size=224)
    with torch.device("meta"):
        module.configure_model()
    params = sum(p.numel() for p in module.parameters())
    assert 21.0e9 < params < 22.5e9, params
    blocks = [(n, m) for n, m in module.named_modules() if type(m).__name__ == "Block"]
    assert len(blocks) == 48
    plan = plan_block(*blocks[0], tp, None)
    assert any(role == "packed_colwise" for role in plan.styles.values()), plan.styles
    assert set(plan.attributes.values()) == {12}, plan.attributes  # 48 heads / 4
    world = trainer["num_nodes"] * trainer["devices"]
    assert world == 512 and config["data"]["init_args"]["batch_size"] * world // tp == 4096
