"""ShardedEMA in one process: the schedule, the arithmetic on whole tensors (the DDP path), buffers, low-precision
master weights, option errors, and the example CLI flag. The sharded path runs in tests/distributed/test_ema.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_vitscale import ShardedEMA
from lightning_vitscale.averaging.settings import EMAPolicy
from lightning_vitscale.averaging.shards import EmaShards

pytestmark = pytest.mark.timeout(120)


def test_schedule_follows_lightning_ema_weight_averaging():
    policy = EMAPolicy(update_every_n_steps=3, update_starting_at_step=4)
    assert [i for i in range(12) if policy.should_update(i)] == [6, 9]
    assert [i for i in range(4) if EMAPolicy().should_update(i)] == [0, 1, 2, 3]


def test_first_update_copies_then_decay_or_warm_up():
    assert EMAPolicy(decay=0.99).decay_at(0) == 0.0
    assert EMAPolicy(decay=0.99).decay_at(5) == 0.99
    warm = EMAPolicy(decay=0.99, warmup=True)
    assert warm.decay_at(1) == pytest.approx(2 / 11) and warm.decay_at(10) == pytest.approx(11 / 20)
    assert warm.decay_at(10_000) == 0.99


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"decay": 1.5}, "`decay` must be in [0, 1]"),
        ({"update_every_n_steps": 0}, "`update_every_n_steps` must be >= 1"),
        ({"evaluate": "average"}, "`evaluate` must be one of"),
        ({"buffers": "keep"}, "`buffers` must be one of"),
    ],
)
def test_bad_options_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ShardedEMA(**kwargs)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def step(module: nn.Module) -> None:
    module.train()
    module(torch.randn(16, 4)).sum().backward()
    with torch.no_grad():
        for p in module.parameters():
            p -= 0.1 * p.grad
            p.grad = None


def test_whole_tensor_ema_matches_the_formula_with_buffers_averaged_or_copied():
    net = model()
    averaged, copied = EmaShards(net, average_buffers=True), EmaShards(net, average_buffers=False)
    expected = {k: v.detach().clone().float() for k, v in net.state_dict().items()}
    for shards in (averaged, copied):
        shards.update(0.0)
    for _ in range(3):
        step(net)
        for shards in (averaged, copied):
            shards.update(0.75)
        expected = {k: 0.75 * expected[k] + 0.25 * v.float() if v.is_floating_point() else v.clone()
                    for k, v in net.state_dict().items()}
    state = net.state_dict()
    got, got_copied = averaged.state_dict(), copied.state_dict()
    assert got.keys() == expected.keys()  # parameters and persistent buffers, keyed like the state dict
    for key, value in expected.items():
        torch.testing.assert_close(got[key].to(value.dtype), value, rtol=1e-6, atol=1e-6)
    assert torch.equal(got_copied["1.running_mean"], state["1.running_mean"])  # "copy" follows the model
    assert not torch.equal(got["1.running_mean"], state["1.running_mean"])
    assert got["1.num_batches_tracked"].dtype == torch.int64 and int(got["1.num_batches_tracked"]) == 3


def test_low_precision_weights_accumulate_into_an_fp32_average():
    net = nn.Linear(64, 64).to(torch.bfloat16)
    shards = EmaShards(net)
    start = {n: p.detach().float().clone() for n, p in net.named_parameters()}
    with torch.no_grad():
        net.weight.add_(1e-3)  # below bf16's resolution around 1: a bf16 average could not hold it
    shards.update(0.5)
    assert all(t.dtype == torch.float32 for t in shards.tensors())
    expected = 0.5 * start["weight"] + 0.5 * net.weight.detach().float()
    torch.testing.assert_close(shards.state_dict()["weight"], expected, rtol=0, atol=1e-7)


def test_swapped_in_runs_on_the_average_and_restores_the_weights():
    net = model()
    shards = EmaShards(net)
    step(net)
    raw = {k: v.clone() for k, v in net.state_dict().items()}
    with shards.swapped_in():
        assert all(torch.equal(net.state_dict()[k], v.to(raw[k].dtype)) for k, v in shards.state_dict().items())
    assert all(torch.equal(net.state_dict()[k], v) for k, v in raw.items())


def test_classification_example_turns_it_on_from_the_command_line(monkeypatch):
    from examples.classification import ViTClassifier
    from examples.models.cli import run_cli
    from examples.models.datamodules import DigitsDataModule

    monkeypatch.setattr("sys.argv", ["classification.py"])
    args = ["--trainer.callbacks+=lightning_vitscale.ShardedEMA", "--trainer.callbacks.decay=0.99",
            "--trainer.callbacks.warmup=true", "--trainer.accelerator=cpu", "--trainer.devices=1",
            "--trainer.logger=false"]
    cli = run_cli(ViTClassifier, DigitsDataModule, "classification", ("num_classes", "in_chans", "img_size"), 1,
                  args=args, run=False)
    emas = [c for c in cli.trainer.callbacks if isinstance(c, ShardedEMA)]
    assert len(emas) == 1 and emas[0].policy.decay == 0.99 and emas[0].policy.warmup
