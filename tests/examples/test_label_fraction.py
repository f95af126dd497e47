"""``--data.label_fraction``: the digits' training split cut to a class-stratified, seed-fixed share of its labels
(the fine-tuning table's 10%), validation untouched.

Mutations seen failing: the subset drawn with the global RNG (``torch.randperm`` without the generator: two ranks
seeded apart get different subsets); one fraction of the whole split instead of per class (counts off by class);
the fraction applied to the validation split too; the range check removed.
"""

from __future__ import annotations

import pytest
import torch

from examples.classification import main
from examples.models.datamodules import DigitsDataModule


def digits(global_seed: int = 0, **kwargs) -> DigitsDataModule:
    torch.manual_seed(global_seed)  # what differs between ranks and runs: must not change the subset
    data = DigitsDataModule(**kwargs)
    data.setup("fit")
    return data


def rows(x: torch.Tensor) -> set[tuple[float, ...]]:
    return {tuple(r.flatten().tolist()) for r in x}


def test_a_tenth_of_each_class_the_same_for_a_seed_validation_untouched() -> None:
    full, tenth = digits(), digits(label_fraction=0.1)
    (x_full, y_full), (x, y) = full.train_set.tensors, tenth.train_set.tensors  # type: ignore[union-attr]
    per_class = torch.bincount(y_full, minlength=10)
    assert torch.bincount(y, minlength=10).tolist() == [max(1, round(0.1 * int(n))) for n in per_class]
    assert rows(x) <= rows(x_full) and len(rows(x)) == len(x)  # drawn from the training split, no repeats
    for a, b in zip(tenth.val_set.tensors, full.val_set.tensors, strict=True):  # type: ignore[union-attr]
        assert torch.equal(a, b)
    again = digits(global_seed=1, label_fraction=0.1)  # another rank / run: another global RNG state
    assert all(torch.equal(a, b) for a, b in zip(again.train_set.tensors, tenth.train_set.tensors, strict=True))  # type: ignore[union-attr]
    other = digits(label_fraction=0.1, seed=1).train_set.tensors[0]  # type: ignore[union-attr]
    assert rows(other) != rows(x)
    all_labels = digits(label_fraction=1.0).train_set.tensors  # type: ignore[union-attr]
    assert all(torch.equal(a, b) for a, b in zip(all_labels, full.train_set.tensors, strict=True))  # type: ignore[union-attr]


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_a_fraction_outside_zero_to_one_names_the_option(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"--data.label_fraction=.* must be in \(0, 1\]"):
        DigitsDataModule(label_fraction=fraction)


def test_the_option_through_the_classification_cli() -> None:
    cli = main(["--trainer.accelerator=cpu", "--data.label_fraction=0.1", "--trainer.logger=false"], run=False)
    assert isinstance(cli.datamodule, DigitsDataModule) and cli.datamodule.label_fraction == 0.1
