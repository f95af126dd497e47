"""Published weights out of a checkpoint: one submodule's own state dict (``--module net``: the ``net.`` prefix
stripped), the trained, EMA-averaged or DINO-teacher weights, as a ``safetensors`` file with provenance metadata.
Reads a sharded folder, a Lightning ``.ckpt`` or a plain state-dict file through the one safe reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_vitscale.checkpoint.consolidate import ema_as_weights, load_consolidated, require_file_target, write_file
from lightning_vitscale.checkpoint.errors import CheckpointError
from lightning_vitscale.checkpoint.formats import PathLike, as_full, require_existing
from lightning_vitscale.checkpoint.safe_reading import load_pickle, load_safetensors
from lightning_vitscale.checkpoint.storage import Location

WeightsChoice = Literal["model", "ema", "teacher"]
EXPORT_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
TEACHER = "teacher"  # the attribute the DINO example (examples/models/dino.py) keeps its EMA teacher under


@dataclass(frozen=True)
class Weights:
    """A submodule's state dict as its own ``state_dict()`` names it, and where it came from (``metadata``: strings,
    as safetensors stores them: ``source``, ``weights``, ``module``, ``global_step``, ``epoch``)."""

    state: dict[str, Tensor]
    metadata: dict[str, str]
    hyper_parameters: dict[str, Any]


def read_weights(
    src: PathLike, weights: WeightsChoice = "model", module: str = "", dtype: torch.dtype | None = torch.float32,
    weights_only: bool | None = None, verify: bool = True,
) -> Weights:
    """The state dict of submodule ``module`` ("" = the whole LightningModule) in ``src``, prefix stripped:
    ``"model"`` the trained weights, ``"ema"`` ``ShardedEMA``'s average, ``"teacher"`` the DINO example's EMA
    teacher (``module`` looked up inside it). A sharded folder's CRC-32s are checked first (``verify``)."""
    if weights not in ("model", "ema", "teacher"):
        raise ValueError(f"`weights` must be 'model', 'ema' or 'teacher'; got {weights!r}.")
    location = Location.of(src)
    require_existing(location)
    checkpoint, flat = _read(location, weights, dtype, weights_only, verify)
    state = checkpoint["state_dict"]
    base = f"{TEACHER}." if weights == "teacher" and not flat else ""
    if base and not any(k.startswith(base) for k in state):
        raise CheckpointError(
            f"{src} has no teacher weights (no keys under '{TEACHER}.'): --weights teacher takes the DINO example's"
            f" EMA teacher. Its submodules: {sorted({k.split('.', 1)[0] for k in state})}. Use --weights model or ema."
        )
    prefix = base + (module.strip(".") + "." if module.strip(".") else "")
    selected = {k[len(prefix) :]: as_full(v, dtype) for k, v in state.items() if k.startswith(prefix)}
    if not selected:
        where = " in the teacher" if base else ""
        raise CheckpointError(f"{src} has no submodule {module!r}{where}: {_hint(state, base, module)}")
    metadata = {"source": str(src), "weights": checkpoint.get("weights", weights) if flat else weights}
    metadata |= {"module": module} | {key: str(checkpoint.get(key, "")) for key in ("global_step", "epoch")}
    return Weights(selected, metadata, dict(checkpoint.get("hyper_parameters") or {}))


def _read(
    location: Location, weights: WeightsChoice, dtype: torch.dtype | None, weights_only: bool | None, verify: bool
) -> tuple[dict[str, Any], bool]:
    """``(checkpoint with a 'state_dict', flat)``; ``flat``: one state dict (an export), one choice of weights."""
    if location.is_dir():
        choice: Literal["raw", "ema"] = "ema" if weights == "ema" else "raw"
        return load_consolidated(location.url, dtype, weights_only, weights=choice, verify=verify), False
    if location.url.endswith(".safetensors"):
        tensors, metadata = load_safetensors(location)
        return _flat({"state_dict": tensors, **metadata}, weights, location), True
    loaded = load_pickle(location, weights_only, mmap=True)
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{location} holds a {type(loaded).__name__}, not a checkpoint or a state dict.")
    if "state_dict" not in loaded:
        return _flat({"state_dict": loaded}, weights, location), True
    if weights == "ema":
        ema_as_weights(loaded, location.url)
    return loaded, False


def _flat(checkpoint: dict[str, Any], weights: WeightsChoice, location: Location) -> dict[str, Any]:
    saved = checkpoint.get("weights")
    if weights != "model" and weights != saved:
        raise CheckpointError(
            f"{location} holds one state dict ({saved or 'which weights is not recorded'}), not a training"
            f" checkpoint: it has no separate {weights} weights. Drop --weights {weights} (read what it holds), or"
            " pass the run's checkpoint folder."
        )
    return checkpoint


def _hint(state: dict[str, Any], base: str, module: str) -> str:
    """Where the weights are: the submodules at the top (of the teacher), those ending in ``module`` first."""
    inner = {k[len(base) :] for k in state if k.startswith(base)}
    name = module.strip(".")
    deeper = sorted({k.split(f".{name}.")[0] + f".{name}" for k in inner if f".{name}." in k}) if name else []
    tops = sorted({k.split(".", 1)[0] for k in inner if "." in k}) or ["(none)"]
    return (
        f"its weights are under {tops}. Pass the submodule's full name as --module (e.g. --module"
        f" {(deeper or tops)[0]}), or --module '' for everything."
    )


def write_bytes(data: bytes, dst: PathLike) -> Location:
    """``data`` written atomically to the file ``dst`` (``consolidate.write_file``)."""
    require_file_target(dst)
    write_file(data, dst)
    return Location.of(dst)


def write_safetensors(weights: Weights, dst: PathLike) -> Location:
    """The submodule's own key names, the provenance in the file's metadata; contiguous copies (safetensors refuses
    views and shared storage)."""
    from safetensors.torch import save

    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in weights.state.items() if torch.is_tensor(v)}
    return write_bytes(save(tensors, metadata={"format": "pt", **weights.metadata}), dst)
