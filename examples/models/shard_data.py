"""DataModules that stream tar shards (classification and DINO pretraining); the digits written once as shards.

``--data=ShardImageDataModule --data.root=URL`` (a folder or an fsspec URL holding ``{train,val}-*.tar`` and
``index.json``, see ``shard_writer.py``); without ``root`` the digits are written once under the examples' cache
and streamed from there (offline). Which rank and worker reads which samples, the shuffle buffer and the resumable
position: ``shards.py``.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torchvision import transforms as T
from torchvision.transforms import v2

from examples.models.datamodules import image_transforms, normalisation
from examples.models.loading import trainer_loader_settings
from examples.models.multicrop import MultiCrop
from examples.models.shard_writer import IMAGE_EXTS, label, read_index, write_digits
from examples.models.shards import Remainder, ShardLoader, ShardStream
from examples.models.written_data import cache_root, write_once


def digits_transform(img_size: int) -> Callable:
    """The stored ``15 * v`` back to ``DigitsDataModule``'s ``v / 8 - 1``, then upsampled (bilinear) to ``img_size``."""
    return T.Compose([T.ToTensor(), T.Normalize((8 / 17,), (8 / 17,)), T.Resize(img_size, antialias=False)])


class DecodeImage:
    """A raw sample (``{"__key__", "png"/"jpg"/..., "cls"}``) -> ``(transform(image), label)``."""

    def __init__(self, mode: str, transform: Callable) -> None:
        self.mode, self.transform = mode, transform

    def __call__(self, sample: dict[str, Any]) -> tuple[Any, int]:
        from PIL import Image

        ext = next((e for e in IMAGE_EXTS if e in sample), None)
        if ext is None:
            raise ValueError(f"sample {sample['__key__']} of {sample['__url__']} has no {'/'.join(IMAGE_EXTS)} image")
        with Image.open(io.BytesIO(sample[ext])) as image:
            return self.transform(image.convert(self.mode)), label(sample)


class ShardImageDataModule(pl.LightningDataModule):
    """Classification data streamed from tar shards; ``root=None`` streams the digits (written once, offline).

    Args:
        root: folder or fsspec URL with ``{train,val}-*.tar`` + ``index.json``; ``None``: the built-in digits.
        img_size: model input size (16 for the digits, 224 otherwise by default).
        shuffle_buffer: samples each loader worker holds to shuffle its shards' stream (0: file order).
        remainder: ``"pad"`` (every rank reads ``ceil(N / ranks)``, the epoch's first samples again) or ``"drop"``.
        seed: seeds the shards' order and the shuffle buffers (with the epoch): every run streams alike.
    """

    def __init__(
        self, root: str | None = None, img_size: int | None = None, batch_size: int = 32,
        num_workers: int | None = None, shuffle_buffer: int = 1000, remainder: Remainder = "pad", seed: int = 0,
        cache_dir: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.builtin = root is None
        self.root = str(cache_root(cache_dir, "digits-shards", {"split_seed": 0})) if root is None else root
        if self.builtin:
            self.num_classes, self.in_chans = 10, 1
        else:
            index = read_index(self.root)  # known before setup so the CLI can link them into the model
            self.num_classes, self.in_chans = len(index.classes), index.channels
        self.img_size = img_size or (16 if self.builtin else 224)
        self.batch_size, self.num_workers, self.shuffle_buffer = batch_size, num_workers, shuffle_buffer
        self.remainder, self.seed = remainder, seed
        self._train_loader: ShardLoader | None = None
        self._train_position: dict[str, Any] | None = None

    def prepare_data(self) -> None:
        if self.builtin:
            write_once(Path(self.root), write_digits)

    def setup(self, stage: str | None = None) -> None:
        self.prepare_data()  # for callers that skip prepare_data (another rank may have written it: no-op then)
        self.index = read_index(self.root)

    def decoder(self, train: bool) -> Callable[[dict[str, Any]], Any]:
        """The sample decoder of the training (augmented) or evaluation stream."""
        mode = "L" if self.in_chans == 1 else "RGB"
        if self.builtin:
            return DecodeImage(mode, digits_transform(self.img_size))
        return DecodeImage(mode, image_transforms(self.img_size, self.in_chans)[0 if train else 1])

    def _current_epoch(self) -> int:
        return self.trainer.current_epoch if self.trainer is not None else 0

    def _loader(self, split: str, decode: Callable, train: bool) -> ShardLoader:
        settings = trainer_loader_settings(self.trainer, in_memory=False, num_workers=self.num_workers)
        dp = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self.trainer is not None else None
        urls, counts = self.index.split(split)
        stream = ShardStream(
            urls, counts, decode, rank=(dp or {}).get("rank", 0), world=(dp or {}).get("num_replicas", 1),
            batch_size=self.batch_size, workers=settings.num_workers, shuffle=train,
            shuffle_buffer=self.shuffle_buffer, seed=self.seed, remainder=self.remainder,
        )  # fmt: skip
        epoch = self._current_epoch if train and self.trainer is not None else None
        return ShardLoader(stream, num_workers=settings.num_workers, pin_memory=settings.pin_memory, epoch=epoch)

    def train_dataloader(self) -> ShardLoader:
        self._train_loader = self._loader("train", self.decoder(train=True), train=True)
        self._apply_position()
        return self._train_loader

    def state_dict(self) -> dict[str, Any]:
        """The training stream's position (epoch, batches, samples), saved in every checkpoint.

        The loader offers it to Lightning's stateful-loader hook too, but Lightning skips that hook when
        ``configure_optimizers`` reads ``trainer.estimated_stepping_batches`` (as the examples' cosine schedule
        does): the loader is then built before the checkpoint is restored. The datamodule's state is always restored.
        """
        return {"train_stream": self._train_loader.state_dict()} if self._train_loader is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._train_position = state_dict.get("train_stream")
        self._apply_position()

    def _apply_position(self) -> None:
        """Hand a restored position to the training loader (built before or after the restore); the loader's
        iterator reads it when the epoch's first batch is fetched."""
        if self._train_loader is not None and self._train_position is not None:
            self._train_loader.load_state_dict(self._train_position)
            self._train_position = None

    def val_dataloader(self) -> Any:
        return self._loader("val", self.decoder(train=False), train=False)


class _Crops:
    """``(image, label)`` -> ``(crops, label)``: a picklable multi-crop decoder for the loader workers."""

    def __init__(self, decode: DecodeImage, crops: MultiCrop) -> None:
        self.decode, self.crops = decode, crops

    def __call__(self, sample: dict[str, Any]) -> tuple[list[Tensor], int]:
        image, label = self.decode(sample)
        return self.crops(image), label


class ShardMultiCropDataModule(ShardImageDataModule):
    """DINO's multi-crop batches streamed from tar shards; validation: the training split un-augmented (the k-NN
    bank), then the validation split. ``root=None``: the digits (16 px global, 8 px local crops, no flips)."""

    def __init__(
        self, root: str | None = None, n_global: int = 2, n_local: int = 4, local_size: int | None = None,
        img_size: int | None = None, batch_size: int = 16, num_workers: int | None = None,
        shuffle_buffer: int = 1000, remainder: Remainder = "pad", seed: int = 0, cache_dir: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(root, img_size, batch_size, num_workers, shuffle_buffer, remainder, seed, cache_dir)
        self.n_global, self.n_local = n_global, n_local
        self.local_size = local_size or (8 if self.builtin else 96)

    def decoder(self, train: bool) -> Callable[[dict[str, Any]], Any]:
        if not train:
            return super().decoder(train)
        if self.builtin:  # as DigitsMultiCropDataModule: crops of the 16 px digit
            sizes = (self.img_size, self.local_size, self.n_global, self.n_local)
            crops = MultiCrop(*sizes, (0.5, 1.0), (0.2, 0.5), False)
            return _Crops(DecodeImage("L", digits_transform(self.img_size)), crops)
        to_tensor = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(*normalisation(self.in_chans))]
        crops = MultiCrop(
            self.img_size, self.local_size, self.n_global, self.n_local, (0.4, 1.0), (0.05, 0.4), True,
            v2.Compose(to_tensor),
        )  # fmt: skip
        return _Crops(DecodeImage("L" if self.in_chans == 1 else "RGB", v2.Identity()), crops)

    def val_dataloader(self) -> Any:
        plain = self.decoder(train=False)
        return [self._loader("train", plain, train=False), self._loader("val", plain, train=False)]
