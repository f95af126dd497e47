"""Rank script for tensor parallelism on 4 CPU ranks: ``tensor_parallel.py OUT``; ``tensor_parallel.py OUT2 SAVED``
on 2 ranks resumes the 4-rank run's sharded checkpoints (in ``SAVED``) on another world size.

For each backbone (the examples' ViT, timm's, HF ViT and DINOv2), DDP at a global batch of 8 (2 per rank), then
``VitScaleStrategy(tensor_parallel=2)`` (2 data-parallel ranks of 4 samples) and ``tensor_parallel=4`` (one of 8),
all through ``Trainer.fit`` with gradient clipping; each rank starts from its own random weights, so only rank 0's
broadcast makes them agree. Then checkpoints: HF ViT saved under TP=2 x FSDP=2 resumed under FSDP=4 (tensor_parallel=1);
the examples' ViT and timm's (packed qkv, with ShardedEMA) saved under TP=2 x FSDP=2 and resumed under FSDP=4, TP=4
and DDP, whose own checkpoints are resumed under TP=2 again. Then the examples' ViT and timm's built in
``configure_model()`` under TP=2 x FSDP=2: ``init="exact"`` (rank 0 real, the others on meta), ``init="meta"``
(every rank on meta, each rank seeded differently), and host memory during setup for a 57 MiB ViT on both paths.
The examples' ViT under ``sharding=2`` (a 3-D mesh: 2 replicas x 1-rank shard groups x 2 tensor parallel), built in
``__init__`` and in ``configure_model()`` on both paths.
Writes ``rank{r}.json``: losses, the sampler split, state bytes, the plan summary, what each resume restored.
"""

from __future__ import annotations

import copy
import ctypes
import json
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import ShardedEMA, VitScaleCheckpointIO, VitScaleStrategy, consolidated, measure_state_bytes
from lightning_vitscale._utils import strip_wrapper_prefixes
from lightning_vitscale.checkpoint.consolidate import load_consolidated
from lightning_vitscale.init.scatter import local_box
from lightning_vitscale.row_layout import model_rows, packed_rows
from tests.helpers.peak import mmap_large_allocations
from tests.helpers.state import full as full_tensor
from tests.helpers.state import snapshot

warnings.filterwarnings("ignore")
IMAGE, PATCH, CLASSES, GLOBAL_BATCH, STEPS = 8, 4, 10, 8, 10  # issue 34: 10 steps against DDP
WORLD = int(sys.argv[3]) if len(sys.argv) > 3 else 4  # ranks (devices) of this launch
SIZE = {"embed_dim": 32, "depth": 2, "num_heads": 4}


def examples_vit():
    from examples.models.vit import VisionTransformer

    return VisionTransformer(IMAGE, PATCH, 3, CLASSES, mlp_ratio=2.0, **SIZE)


def timm_vit():
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=IMAGE, patch_size=PATCH, num_classes=CLASSES, mlp_ratio=2.0, **SIZE)


def hf_config(config_class, **extra):
    return config_class(
        image_size=IMAGE, patch_size=PATCH, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **extra,
    )


def hf_vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(hf_config(ViTConfig, intermediate_size=64))


def hf_dinov2():
    from transformers import Dinov2Config, Dinov2ForImageClassification

    return Dinov2ForImageClassification(hf_config(Dinov2Config, mlp_ratio=2))


def big_vit():
    """57 MiB of parameters (8 blocks of 384 wide): setup's host memory is measured against it."""
    from examples.models.vit import VisionTransformer

    return VisionTransformer(IMAGE, PATCH, 3, CLASSES, embed_dim=384, depth=8, num_heads=6, mlp_ratio=4.0)


BACKBONES = {"examples": examples_vit, "timm": timm_vit, "hf": hf_vit, "dinov2": hf_dinov2, "big": big_vit}


class Model(L.LightningModule):
    """``in_configure_model``: the backbone is built in ``configure_model()`` instead of ``__init__``."""

    def __init__(self, backbone: str, in_configure_model: bool = False) -> None:
        super().__init__()
        self.name = backbone
        self.backbone = None if in_configure_model else BACKBONES[backbone]()
        self.losses: list[float] = []
        self.seen: list[int] = []
        self.record_initial = False
        self.record_pieces = False

    def setup(self, stage: str) -> None:
        # Memory earlier fits freed goes back to the system first, or this fit would reuse it unseen; then this
        # process's peak RSS (VmHWM) restarts from here.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        if self.record_pieces:  # each rank its own seed from here (as a per-rank augmentation seed would do)
            torch.manual_seed(100 + self.global_rank)
        self.rss_before = _status_bytes("VmRSS")

    def configure_model(self) -> None:
        """From the RNG state rank 0 builds the ``__init__`` backbone with (seed 1): on the exact path the weights
        are that backbone's; the generator then continues as before (a meta build draws nothing)."""
        if self.backbone is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1)
                self.backbone = BACKBONES[self.name]()

    def on_train_start(self) -> None:
        self.setup_growth = _status_bytes("VmHWM") - self.rss_before
        if self.name == "big":
            return
        self.restored = in_model_order(with_ema(snapshot(self, self.trainer), self.trainer), self)  # what it restored
        self.initial = self.state_dict() if self.record_initial else None  # after setup, before the first step
        self.pieces = pieces(self) if self.record_pieces else None

    def forward(self, x):
        out = self.backbone(x)
        return out if isinstance(out, torch.Tensor) else out.logits

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        self.seen.extend(index.tolist())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def data(batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = GLOBAL_BATCH * STEPS
    images, labels = torch.randn(n, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    return DataLoader(TensorDataset(images, labels, torch.arange(n)), batch_size=batch_size, shuffle=False)


# Activation checkpointing composed with the split blocks: full (the default), selective, none.
CHECKPOINTING = {"examples": True, "timm": "selective", "hf": False, "dinov2": True}


def fit(
    backbone: str, tp: int, steps: int = STEPS, ckpt: Path | None = None, precision: str = "32-true",
    init: str | None = None, sharding: str | int = "full",
) -> tuple[dict, Model, L.Trainer]:
    """``init``: the backbone is built in ``configure_model()`` with ``VitScaleStrategy(init=init)``; on the meta
    path every rank is seeded differently at setup (the shards' init must still agree where ranks hold the same
    piece)."""
    torch.manual_seed(dist.get_rank() + 1 if dist.is_initialized() else 1)  # different weights on every rank
    model = Model(backbone, in_configure_model=init is not None)
    model.record_initial = backbone == "examples" and tp == 2 and precision == "32-true" and init is None
    model.record_pieces = init == "meta"
    L.seed_everything(0, verbose=False)
    ddp = "ddp_find_unused_parameters_true"  # DINOv2's mask token takes no part in classification
    checkpointing = CHECKPOINTING[backbone]
    options: dict = {} if init is None else {"init": init}
    if sharding != "full":
        options["sharding"] = sharding
    strategy = ddp if tp == 0 else VitScaleStrategy(tensor_parallel=tp, activation_checkpointing=checkpointing,
                                                    **options)
    data_parallel = WORLD if tp in (0, 1) else WORLD // tp
    ema = backbone in ("examples", "timm") and precision == "32-true"  # every resume of a packed qkv: its EMA too
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, gradient_clip_val=0.05, logger=False,
        precision=precision, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[ShardedEMA(0.5)] if ema else [],
        plugins=[VitScaleCheckpointIO()] if tp == 0 else None,  # DDP resumes from sharded folders through it
    )
    trainer.fit(model, data(GLOBAL_BATCH // data_parallel), ckpt_path=str(ckpt) if ckpt else None)
    state = measure_state_bytes(model, trainer.optimizers)
    facts = {"losses": model.losses, "seen": model.seen, "fraction": state.sharded_fraction}
    if tp:
        facts.update(block_fraction=_block_fraction(model, trainer), summary=trainer.strategy.plan.summary(),
                     init_path=trainer.strategy.plan.init_path)
    if tp and backbone == "examples":  # the packed qkv's layout: the mesh and its placement on each dimension
        qkv = model.backbone.blocks[0].attn.qkv.weight
        facts.update(mesh=qkv.device_mesh.mesh.tolist(), placements=[str(p) for p in qkv.placements])
    return facts, model, trainer


CHECKPOINTING["big"] = False


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def pieces(model: Model) -> dict:
    """Every rank's piece of every parameter, after setup: pieces at the same place (replicas: the ranks of a
    tensor-parallel group for what it does not split, ...) must be equal, and weight pieces at different places
    must differ (no copies of one draw); the blocks' weight and bias statistics, gathered whole."""
    world = dist.get_world_size()
    replicas_agree, shards_differ = True, True
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        everyone: list = [None] * world
        dist.all_gather_object(everyone, (local_box(param), local.detach().clone()))
        for i in range(world):
            for j in range(i):
                (box_i, piece_i), (box_j, piece_j) = everyone[i], everyone[j]
                if box_i == box_j:
                    replicas_agree &= torch.equal(piece_i, piece_j)
                elif name.endswith("weight") and piece_i.dim() == 2 and piece_i.shape == piece_j.shape:
                    shards_differ &= not torch.equal(piece_i, piece_j)
    blocks = model.backbone.blocks
    linears = [m for m in blocks.modules() if isinstance(m, torch.nn.Linear)]
    weights = torch.cat([full_tensor(m.weight).flatten() for m in linears])
    biases = torch.cat([full_tensor(m.bias).flatten() for m in linears])
    norms = torch.cat([full_tensor(m.weight).flatten() for m in blocks.modules() if isinstance(m, torch.nn.LayerNorm)])
    return {"replicas_agree": replicas_agree, "shards_differ": shards_differ, "weight_std": weights.std().item(),
            "weight_mean": weights.mean().item(), "weight_max": weights.abs().max().item(),
            "bias_max": biases.abs().max().item(), "norm_values": sorted(set(norms.tolist()))}


def configured(backbone: str, built: dict[str, torch.Tensor]) -> dict:
    """The backbone built in ``configure_model()`` under TP=2 x FSDP=2: ``init="exact"`` against the ``__init__``
    run (``built``: its weights and optimizer state after the fit), ``init="meta"``'s pieces and statistics."""
    exact, model, trainer = fit(backbone, 2, init="exact")
    after = snapshot(model, trainer)
    exact["different"] = [k for k in built if not torch.equal(built[k], after[k])]
    exact["keys"] = len(built)
    if backbone != "examples":  # the meta path's replay is per tensor, whatever the family: one backbone
        return {f"{backbone}-2-exact": exact}
    meta, model, _ = fit(backbone, 2, init="meta")
    meta["pieces"] = model.pieces
    return {f"{backbone}-2-exact": exact, f"{backbone}-2-meta": meta}


def setup_memory() -> dict:
    """Peak host-memory growth from ``setup`` to the first step for a 57 MiB ViT built in ``configure_model()``
    under TP=2 x FSDP=2, on both paths, against the model's bytes. Large allocations are made their own mmaps
    first (last in the launch, so the earlier fits keep glibc's defaults): freed tensors then leave RSS at once, as
    they do in the planner's launches, instead of glibc's heap keeping some of them (rank 0's exact growth read
    1.09x in one CI run and 1.32x in another without it)."""
    mmap_large_allocations()
    facts = {}
    for init in ("exact", "meta"):
        result, model, trainer = fit("big", 2, steps=1, init=init)
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        facts[init] = {"growth": model.setup_growth / full, "losses": result["losses"],
                       "path": result["init_path"], "mib": full / 2**20}
    return facts


SAVED: dict[Path, dict[str, torch.Tensor]] = {}


def with_ema(state: dict[str, torch.Tensor], trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """``state`` and ShardedEMA's average (``e.<name>``, gathered), where the Trainer has one."""
    ema = next((c for c in trainer.callbacks if isinstance(c, ShardedEMA)), None)
    if ema is not None and ema.shards is not None:
        state.update({f"e.{k}": full_tensor(v) for k, v in ema.shards.state_dict().items()})
    return state


def in_model_order(state: dict[str, torch.Tensor], model: Model) -> dict[str, torch.Tensor]:
    """``state`` (``w.``, ``o.``, ``e.`` + name) with packed projections' rows gathered in per-rank order (under
    tensor parallelism) put in the model's own order, so that snapshots of any two layouts compare."""
    packed = packed_rows(model)
    for key, value in state.items():
        name = strip_wrapper_prefixes(key.split(".", 1)[1])
        spec = next((packed[n] for n in packed if name == n or name.startswith(n + ".")), None)
        if spec is not None and value.dim() > 0:
            state[key] = model_rows(value, *spec)
    return state


def save(trainer: L.Trainer, model: Model, path: Path) -> None:
    """A checkpoint (sharded folder, or DDP's file) and what it holds, gathered: weights, optimizer state, EMA."""
    trainer.save_checkpoint(path)
    SAVED[path] = in_model_order(with_ema(snapshot(model, trainer), trainer), model)
    SAVED[path]["global_step"] = torch.tensor(trainer.global_step)


def resumes(out: Path, backbone: str, name: str, resumed_under: int, save_as: str | None = None) -> dict:
    """Resume the checkpoint ``name`` for one step under ``resumed_under`` ranks of tensor parallelism (0: DDP);
    what it restored (weights, optimizer state, EMA) against what was saved; ``save_as``: its own checkpoint."""
    ckpt = out / name
    saved = dict(SAVED[ckpt])
    step = int(saved.pop("global_step"))
    _, resumed, trainer = fit(backbone, resumed_under, steps=step + 1, ckpt=ckpt)
    different = [k for k in saved if k not in resumed.restored or not torch.equal(saved[k], resumed.restored[k])]
    if save_as:
        save(trainer, resumed, out / save_as)
    return {"keys": len(saved), "optimizer_keys": sum(k.startswith("o.") for k in saved), "different": different,
            "ema_keys": sum(k.startswith("e.") for k in saved), "steps_run": trainer.global_step - step}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def momentum(optimizer_state: dict) -> dict[str, torch.Tensor]:
    return {str(i): s["momentum_buffer"] for i, s in optimizer_state["state"].items()}


def full_views(out: Path, model: Model, trainer: L.Trainer, ddp: dict) -> dict:
    """The examples' ViT (packed qkv) after a TP=2 x FSDP=2 fit: every full view of its weights in the model's own
    layout. ``ddp``: the same fit under DDP (weights and momentum, close to these up to reduction order)."""
    torch.manual_seed(1)
    initial = Model("examples").state_dict()  # rank 0's weights, which every rank takes at setup
    state = model.state_dict()
    full = out / "examples-2-full.ckpt"
    trainer.strategy.state_dict_type = "full"
    trainer.save_checkpoint(full)
    trainer.strategy.state_dict_type = "sharded"
    saved = torch.load(full, weights_only=True)
    x = torch.randn(4, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1))
    plain = Model("examples")
    plain.load_state_dict(saved["state_dict"], strict=True)  # as a DDP script loads it
    with torch.no_grad():
        outputs = (model.eval()(x), plain.eval()(x))
    twin = copy.deepcopy(model)  # DDP's plain copy: whole weights in the model's rows, the model's head counts
    with torch.no_grad():
        twin_output = twin.eval()(x)
    facts = {
        "deepcopy_vs_file": max_difference(twin.state_dict(), saved["state_dict"]),
        "deepcopy_outputs": (twin_output - outputs[1]).abs().max().item(),
        "deepcopy_plain": not any(isinstance(p, DTensor) for p in twin.parameters()),
        "after_setup": max_difference(model.initial, initial),
        "state_vs_file": max_difference(state, saved["state_dict"]),
        "state_vs_ddp": max_difference(state, ddp["state"]),
        "momentum_vs_ddp": max_difference(momentum(saved["optimizer_states"][0]), momentum(ddp["optimizer"])),
        "outputs": (outputs[0] - outputs[1]).abs().max().item(),
        "ema_vs_ddp": max_difference(saved["ema_state_dict"], ddp["ema"]),
    }
    shards = next(c for c in trainer.callbacks if isinstance(c, ShardedEMA)).shards
    ema = {k: full_tensor(v) for k, v in shards.state_dict().items()}
    shards.load_full(saved["ema_state_dict"])  # as a resume from the full file does
    facts["ema_round_trip"] = max_difference({k: full_tensor(v) for k, v in shards.state_dict().items()}, ema)
    if dist.get_rank() == 0:
        whole = load_consolidated(out / "examples-2.ckpt")
        facts["consolidated_vs_file"] = max_difference(whole["state_dict"], saved["state_dict"])
        facts["consolidated_momentum_vs_file"] = max_difference(
            momentum(whole["optimizer_states"][0]), momentum(saved["optimizer_states"][0])
        )
        facts["consolidated_ema_vs_file"] = max_difference(whole["ema_state_dict"], saved["ema_state_dict"])
        loaded = Model.load_from_checkpoint(consolidated(out / "examples-2.ckpt"), backbone="examples")  # the folder
        facts["load_from_checkpoint_vs_file"] = max_difference(loaded.state_dict(), saved["state_dict"])
        facts["load_from_checkpoint_vs_ddp"] = max_difference(loaded.state_dict(), ddp["state"])
    with torch.no_grad():  # a full state dict loads back into the split model (per-rank rows again)
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(state)
    facts["state_round_trip"] = max_difference(model.state_dict(), state)
    SAVED[full] = SAVED[out / "examples-2.ckpt"]  # the full file resumes as the sharded folder does
    return facts


def _block_fraction(model: Model, trainer: L.Trainer) -> float:
    """Parameter + optimizer bytes of the blocks' Linears on this rank / unsharded (gradients, freed after the
    step, take the parameters' layout)."""
    blocks = [model.get_submodule(name) for name in trainer.strategy.plan.block_names]
    params = [p for block in blocks for m in block.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()]
    state = trainer.optimizers[0].state
    tensors = [t for p in params for t in (p, state[p]["momentum_buffer"])]
    local = sum(t.to_local().numel() if isinstance(t, DTensor) else t.numel() for t in tensors)
    return local / sum(t.numel() for t in tensors)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    if WORLD != 4:
        return other_world_size(out, Path(sys.argv[2]))
    results = {}
    for backbone in [b for b in BACKBONES if b != "big"]:
        for tp in (0, 2, 4) if backbone == "examples" else (0, 2):
            results[f"{backbone}-{tp}"], model, trainer = fit(backbone, tp)
            if backbone == "examples" and tp == 0:
                ema = next(c for c in trainer.callbacks if isinstance(c, ShardedEMA)).shards.state_dict()
                ddp = {"state": model.state_dict(), "optimizer": trainer.optimizers[0].state_dict(), "ema": ema}
            if tp == 2:
                results.update(after_tp2_fit(out, backbone, model, trainer, ddp))
    if dist.get_rank() == 0:  # for the resumes on 2 ranks
        for backbone in ("examples", "timm"):
            torch.save(SAVED[out / f"{backbone}-2.ckpt"], out / f"{backbone}-2.snapshot.pt")
    results.update(hybrid())
    for tp in (1, 2):  # bf16-mixed (O2, fp32 norms, the non-finite guard on): TP beside FSDP=4's recipe
        results[f"examples-{tp}-bf16"] = fit("examples", tp, precision="bf16-mixed")[0]
    results.update(resumes_across_layouts(out))
    results["setup-memory"] = setup_memory()
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


def after_tp2_fit(out: Path, backbone: str, model: Model, trainer: L.Trainer, ddp: dict) -> dict:
    """What a TP=2 x FSDP=2 fit leaves for the checks: its checkpoint (and, for the examples' ViT, the full views),
    and the same backbone built in ``configure_model()``."""
    if backbone not in ("examples", "timm", "hf"):
        return {}
    results = {}
    built = snapshot(model, trainer)
    save(trainer, model, out / f"{backbone}-2.ckpt")  # for the resumes below
    if backbone == "examples":
        results["full-views"] = full_views(out, model, trainer, ddp)
    if backbone in ("examples", "timm"):
        results.update(configured(backbone, built))
    return results


def hybrid() -> dict:
    """Hybrid sharding beside tensor parallelism: a 3-D mesh, 2 replicas x 1-rank shard groups x 2 tensor parallel,
    the examples' ViT built in ``__init__`` and in ``configure_model()`` on both paths."""
    meta, model, _ = fit("examples", 2, sharding=2, init="meta")
    return {
        "examples-2-hybrid": fit("examples", 2, sharding=2)[0],
        "examples-2-hybrid-exact": fit("examples", 2, sharding=2, init="exact")[0],
        "examples-2-hybrid-meta": {**meta, "pieces": model.pieces},
    }


RESUME_LAYOUTS = {"examples": (1, 4, 0), "timm": (0,)}  # tensor_parallel resumed under (1: FSDP=4, 0: DDP)


def resumes_across_layouts(out: Path) -> dict:
    results = {"resume-hf-2-to-1": resumes(out, "hf", "hf-2.ckpt", 1)}
    # Packed qkv saved under TP=2 x FSDP=2, resumed under any layout, and back: FSDP=4's sharded folder and DDP's
    # file resumed under TP=2 (timm's, the same mapping on another family: through DDP only).
    for backbone, layouts in RESUME_LAYOUTS.items():
        for tp in layouts:
            save_as = f"{backbone}-2-to-{tp}.ckpt" if tp in (1, 0) else None
            results[f"resume-{backbone}-2-to-{tp}"] = resumes(out, backbone, f"{backbone}-2.ckpt", tp, save_as)
        for tp in (t for t in layouts if t in (1, 0)):
            results[f"resume-{backbone}-{tp}-to-2"] = resumes(out, backbone, f"{backbone}-2-to-{tp}.ckpt", 2)
    results["resume-examples-2-full-to-2"] = resumes(out, "examples", "examples-2-full.ckpt", 2)
    return results


def other_world_size(out: Path, saved: Path) -> None:
    """On 2 ranks: the 4-rank run's TP=2 x FSDP=2 folders resumed under TP=2 x FSDP=1 (examples) and FSDP=2
    (timm), against what the 4-rank run saved."""
    results = {}
    for backbone, tp in (("examples", 2), ("timm", 1)):
        SAVED[saved / f"{backbone}-2.ckpt"] = torch.load(saved / f"{backbone}-2.snapshot.pt", weights_only=True)
        results[f"resume-{backbone}-2-to-{tp}"] = resumes(saved, backbone, f"{backbone}-2.ckpt", tp)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
