"""A LightningModule whose checkpoint hooks do what DDP users do in them: ``on_save_checkpoint`` stores state of its
own (a step counter, a plain tensor queue) and ``on_load_checkpoint`` restores it, then edits
``checkpoint["state_dict"]`` before Lightning loads it: an entry replaced (``"edit"``: the head's bias reset), or
removed with ``strict_loading = False`` (``"remove"``: fine-tuning with a fresh head)."""

from __future__ import annotations

import torch

from tests.helpers.tiny_vit_module import TinyViTModule


class CheckpointHooks(TinyViTModule):
    def __init__(self, edit: str) -> None:
        super().__init__()
        self.edit = edit  # "none", "edit" or "remove"
        self.strict_loading = edit != "remove"
        self.counter, self.queue = 0, torch.zeros(3)
        self.state_dict_keys: int | None = None

    def training_step(self, batch, batch_idx):
        self.counter += 1
        self.queue += 1
        return super().training_step(batch, batch_idx)

    def on_save_checkpoint(self, checkpoint) -> None:
        checkpoint["custom"] = {"counter": self.counter, "queue": self.queue.clone()}

    def on_load_checkpoint(self, checkpoint) -> None:
        self.counter, self.queue = checkpoint["custom"]["counter"], checkpoint["custom"]["queue"]
        state = checkpoint["state_dict"]
        self.state_dict_keys = len(state)
        if self.edit == "edit":
            state["net.head.bias"] = torch.full_like(state["net.head.bias"], 7.0)
        elif self.edit == "remove":
            del state["net.head.weight"]
