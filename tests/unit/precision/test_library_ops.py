"""Ops that fail on O2's bf16 where DDP's AMP computes them in fp32 (torchvision's ``nms`` and ``roi_align``, a DETR
matcher's ``cdist``, a loss with an fp32 class weight) run as under autocast, and a step gets its batch as under DDP's
AMP: a torchvision detector trains under ``bf16-mixed`` as under plain AMP O1 (before: ``"nms_kernel" not implemented
for 'BFloat16'``, then ``target boxes must of float type, instead got torch.bfloat16``)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.precision.library_ops import as_under_autocast, found_ops
from tests.helpers.models import boxes

torchvision = pytest.importorskip("torchvision")
ops = torchvision.ops

BOXES = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0], [20.0, 20.0, 30.0, 30.0]])
SCORES = torch.tensor([0.9, 0.8, 0.7])


def test_torchvision_s_autocast_ops_are_found_for_the_devices_it_registered_them_for():
    found = {(getattr(op.owner, "__name__", ""), op.name): op.devices for op in found_ops()}
    assert {"cpu", "cuda"} <= found[("torch.ops.torchvision", "nms")]
    assert "cpu" in found[("torch.ops.torchvision", "roi_align")] and "cpu" not in found[("torch.ops.torchvision",
                                                                                           "roi_pool")]
    assert not any(owner.startswith("torch.ops.aten") for owner, _ in found)  # torch's ops: a few, by name
    assert ("torch", "cdist") in found and ("torch", "softmax") not in found  # O2 computes softmax in bf16


@pytest.fixture(scope="module")
def fp32_only_op():
    """A user's own op with an fp32-only kernel and an autocast rule (``torch.library.register_autocast``), as a
    library outside torchvision registers one."""

    @torch.library.custom_op("vitscale_test::fp32_only", mutates_args=())
    def fp32_only(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise RuntimeError(f"fp32_only got {x.dtype}")
        return x * 2

    torch.library.register_autocast("vitscale_test::fp32_only", "cpu", torch.float32)
    return fp32_only


def test_any_library_s_op_with_an_autocast_rule_is_found_and_run_by_it(fp32_only_op):
    """Found in the dispatcher, not from a list of torchvision's names; reached as libraries call their ops, through
    ``torch.ops`` (the op object held by name is not swapped: it computes as under O2 alone)."""
    found = {(getattr(op.owner, "__name__", ""), op.name): op.devices for op in found_ops()}
    assert found[("torch.ops.vitscale_test", "fp32_only")] == {"cpu"}
    x = torch.ones(2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="fp32_only got torch.bfloat16"):
        torch.ops.vitscale_test.fp32_only(x)
    with as_under_autocast(found_ops()):
        assert torch.equal(torch.ops.vitscale_test.fp32_only(x), torch.full((2,), 2.0))
        with pytest.raises(RuntimeError, match="fp32_only got torch.bfloat16"):
            fp32_only_op(x)


def test_torch_s_functions_without_a_bf16_kernel_compute_as_under_autocast():
    """A DETR-style matcher's box distances on the model's bf16 boxes (HF DETR, Conditional and Deformable DETR,
    YOLOS: ``"cdist" not implemented for 'BFloat16'`` before); a global filter's FFT."""
    boxes = torch.rand(6, 4, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.rand(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = torch.cdist(boxes, targets, p=1), torch.fft.rfft2(boxes)
    with pytest.raises(NotImplementedError):
        torch.cdist(boxes, targets.bfloat16(), p=1)
    with as_under_autocast(found_ops()):
        distances, spectrum = torch.cdist(boxes, targets, p=1), torch.fft.rfft2(boxes)
        assert torch.equal(distances, expected[0]) and torch.equal(spectrum, expected[1])
        distances.sum().backward()
        assert boxes.grad is not None and boxes.grad.dtype == torch.bfloat16
        assert torch.softmax(boxes, -1).dtype == torch.bfloat16  # not on the list: O2's bf16


def test_a_loss_mixing_bf16_logits_with_an_fp32_class_weight_computes_as_under_autocast():
    """HF DETR's and YOLOS's loss builds its class weight (an fp32 buffer) in the step, beside bf16 logits: O2 alone
    refuses it (``expected scalar type BFloat16 but found Float``). A loss on bf16 alone computes in fp32 too, as
    autocast computes it (a model's own loss in its forward, where the step's autocast is off)."""
    logits = torch.randn(6, 3, dtype=torch.bfloat16)
    labels, weight = torch.tensor([0, 1, 2, 0, 1, 2]), torch.tensor([1.0, 1.0, 0.1])
    with pytest.raises(RuntimeError, match="expected scalar type"):
        torch.nn.functional.cross_entropy(logits, labels, weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = torch.nn.CrossEntropyLoss(weight=weight)(logits, labels)
    with as_under_autocast(found_ops()):
        assert torch.equal(torch.nn.CrossEntropyLoss(weight=weight)(logits, labels), expected)
        alone = torch.nn.functional.cross_entropy(logits, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert alone.dtype == torch.float32 and torch.equal(alone, torch.nn.functional.cross_entropy(logits, labels))


def test_inside_the_body_nms_and_roi_align_take_bf16_as_under_autocast_and_the_packets_come_back():
    packets = torch.ops.torchvision.nms, torch.ops.torchvision.roi_align
    with pytest.raises(RuntimeError, match="not implemented for 'BFloat16'"):
        ops.nms(BOXES.bfloat16(), SCORES.bfloat16(), 0.5)  # O2 without the body: the host has no bf16 kernel
    features = torch.randn(1, 4, 16, 16, dtype=torch.bfloat16, requires_grad=True)
    rois = torch.tensor([[0.0, 1.0, 2.0, 9.0, 12.0]])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # DDP's AMP
        expected = ops.roi_align(features, rois.bfloat16(), 3, sampling_ratio=2)
    with as_under_autocast(found_ops()):
        with as_under_autocast(found_ops()):  # nested: one caller, not two
            assert torch.ops.torchvision.nms.function is packets[0]
        assert ops.nms(BOXES.bfloat16(), SCORES.bfloat16(), 0.5).tolist() == [0, 2]
        pooled = ops.roi_align(features, rois, 3, sampling_ratio=2)  # fp32 boxes beside bf16 features, as autocast
        assert pooled.dtype == torch.bfloat16 and torch.equal(pooled, expected)
        pooled.float().sum().backward()
        assert features.grad is not None and features.grad.dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="not implemented for 'BFloat16'"):  # no host autocast kernel: as DDP
            ops.roi_pool(features, rois.bfloat16(), 3)
        assert torch.ops.torchvision.nms.default is packets[0].default  # overloads reached through the caller
    assert (torch.ops.torchvision.nms, torch.ops.torchvision.roi_align) == packets
    with pytest.raises(KeyError), as_under_autocast(found_ops()):
        raise KeyError("a failing step")
    assert (torch.ops.torchvision.nms, torch.ops.torchvision.roi_align) == packets


SIZE = 64


class Detector(L.LightningModule):
    """torchvision's smallest Faster R-CNN, as a user writes its step: the model takes the targets."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.detector = self.build()
        self.losses: list[float] = []
        self.dtypes: list[tuple[torch.dtype, torch.dtype]] = []
        self.detected: list[int] = []

    def build(self) -> torch.nn.Module:
        return torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
            weights=None, weights_backbone=None, num_classes=3, min_size=SIZE, max_size=SIZE)

    def training_step(self, batch, batch_idx):
        images, targets = batch
        self.dtypes.append((images[0].dtype, targets[0]["boxes"].dtype))
        loss = self.loss(images, targets)
        self.losses.append(loss.item())
        return loss

    def loss(self, images, targets):
        return sum(self.detector(images, targets).values())

    def validation_step(self, batch, batch_idx):  # eval mode: the detections, through batched NMS
        images, _ = batch
        self.detected.append(sum(len(found["boxes"]) for found in self.detector(images)))

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01)


class Detr(Detector):
    """HF's DETR: its loss matches boxes with ``torch.cdist`` and weighs classes with an fp32 buffer it builds in the
    step, beside bf16 logits (``"cdist" not implemented for 'BFloat16'``, then ``expected scalar type BFloat16 but
    found Float`` before)."""

    def build(self) -> torch.nn.Module:
        transformers = pytest.importorskip("transformers")
        backbone = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[16, 24, 32, 48], depths=[1, 1, 1, 1],
                                             out_features=["stage4"])
        config = transformers.DetrConfig(
            use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone, d_model=32,
            encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=6, num_labels=3)
        return transformers.DetrForObjectDetection(config)

    def loss(self, images, targets):
        labels = [{"class_labels": t["labels"], "boxes": _centred(t["boxes"] / SIZE)} for t in targets]
        return self.detector(pixel_values=torch.stack(images), labels=labels).loss

    def validation_step(self, batch, batch_idx):
        images, _ = batch
        self.detected.append(int(self.detector(pixel_values=torch.stack(images)).pred_boxes.shape[1]))


def _centred(b: torch.Tensor) -> torch.Tensor:
    return torch.stack([(b[:, 0] + b[:, 2]) / 2, (b[:, 1] + b[:, 3]) / 2, b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]], 1)


def fit(strategy, model_class: type[Detector] = Detector) -> Detector:
    model = model_class()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=2,
                        limit_val_batches=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    collate = lambda samples: ([image for image, _ in samples], [target for _, target in samples])  # noqa: E731
    loader = DataLoader(boxes(8, SIZE), batch_size=4, collate_fn=collate)
    trainer.fit(model, loader, loader)
    return model


@pytest.mark.parametrize("model_class", [Detector, Detr], ids=["faster_rcnn", "hf_detr"])
def test_a_detector_trains_under_bf16_mixed_as_under_plain_amp(model_class):
    """Faster R-CNN: its RPN hands ``nms`` bf16 boxes (run in fp32, as autocast runs it) and its ROI heads refuse
    bf16 target boxes (the batch keeps its dtypes). DETR: ``cdist`` and a class-weighted loss. The planner's run of
    the step does the same, so the plan is measured (before, on real values it met the same errors and fell back).
    Mutations seen failing: no ``forward_context`` (the nms error), the batch cast in ``convert_input`` or by the
    outer unit's FSDP2 policy (the targets' error), the planner's step without ``as_under_autocast`` (the fallback);
    for DETR, ``cdist`` or ``cross_entropy`` left off the lists."""
    amp = fit("auto", model_class)
    strategy = VitScaleStrategy(activation_checkpointing=False)
    recipe = fit(strategy, model_class)
    assert "through training_step, with real values" in strategy.plan.summary()
    assert recipe.dtypes == amp.dtypes == [(torch.float32, torch.float32)] * 2
    assert len(recipe.detected) == len(amp.detected) == 1  # validated after the last step, NMS in eval too
    assert len(recipe.losses) == 2
    assert max(abs(a - b) / abs(b) for a, b in zip(recipe.losses, amp.losses)) < 0.02  # bf16 rounding apart
