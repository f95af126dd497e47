"""Which module of a block gets which tensor-parallel role: found from the block's own structure (Megatron style),
or given by the user. Policy only (roles, head counts, no ``torch.distributed``); ``tensor_parallel.py`` applies it.

Megatron's split of a transformer block over ``k`` ranks: the attention's input projections and the MLP's first
linear(s) column-wise (each rank computes its own heads and its own slice of the hidden layer, no communication),
the attention output projection and the MLP's last linear row-wise (one all-reduce each, forward and backward),
everything else (norms, layer scales, residuals) replicated. A packed ``[q; k; v]`` projection is split so that
each rank holds its own heads' q, k and v rows (``packed_colwise``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from lightning_vitscale.discovery.blocks import holds_parameters
from lightning_vitscale.discovery.norms import is_normalization

Role = Literal["colwise", "rowwise", "packed_colwise"]
TensorPlanSelector = dict[str, Any] | Callable[[str, nn.Module], dict[str, Any]]
"""A user's plan: a dict of module-name patterns inside a block (``fnmatch``, e.g. ``"attn.qkv"``, ``"mlp.fc*"``)
to ``torch.distributed.tensor.parallel`` styles, or a callable ``(block name, block) -> {module name: style}``
(which also sets the block's per-rank head counts itself)."""

HEAD_COUNTS = ("num_heads", "heads", "n_heads", "nhead", "num_attention_heads")  # timm, lucidrains, HF, ...
HEAD_WIDTHS = ("attn_dim", "all_head_size")  # ... and, where they keep it, heads x head size (timm, older HF)


class TensorPlanError(ValueError):
    """A block the automatic plan cannot split without changing model code: pass ``tensor_plan=``."""


@dataclass(frozen=True)
class BlockPlan:
    """One block's plan: ``styles`` (module name inside the block -> role, ``"attn.qkv" -> "packed_colwise"``, or a
    user's ParallelStyle) and ``attributes`` (``"attn.num_heads" -> 2``: what this rank's modules must hold)."""

    styles: dict[str, Any]
    attributes: dict[str, int] = field(default_factory=dict)
    family: str = "automatic"
    attention: tuple[str, ...] = ()

    def describe(self) -> str:
        """``attn.qkv packed colwise, attn.proj rowwise, ...; num_heads 4 -> 2 per rank``."""
        roles = ", ".join(f"{name} {s.replace('_', ' ') if isinstance(s, str) else type(s).__name__}"
                          for name, s in self.styles.items())
        heads = "; ".join(f"{name} -> {value} per rank" for name, value in self.attributes.items())
        return f"{roles}{'; ' + heads if heads else ''}"

    def whole(self, block: nn.Module) -> str:
        """``replicated: norm1, norm2, ls1``: the modules of ``block`` holding parameters that no style splits."""
        kept = [n or "the block" for n, m in block.named_modules()
                if n not in self.styles and holds_parameters(m, recurse=False)]
        return f"replicated: {', '.join(kept[:8])}{f' +{len(kept) - 8}' if len(kept) > 8 else ''}" if kept else (
            "nothing replicated")

    def held_whole(self, block: nn.Module) -> str:
        """A refusal's sentence on what the split attention modules keep whole (q/v biases, per-head tables)."""
        names = [_joined(a, n) for a in self.attention for n, _ in block.get_submodule(a).named_parameters()]
        owners = {n: n.rpartition(".")[0] for n in names}
        held = [n for n, o in owners.items() if not (o in self.styles or is_normalization(o, block.get_submodule(o)))]
        return f" Its attention also holds {', '.join(held)}, which the plan keeps whole beside the split heads." if (
            held) else ""


def plan_block(name: str, block: nn.Module, ranks: int, user: TensorPlanSelector | None) -> BlockPlan:
    """The plan for ``block`` (``name`` in the model) over ``ranks`` tensor-parallel ranks (proven before use:
    ``sharding/tensor_proof.py``)."""
    if user is not None:
        return _user_plan(name, block, user)
    _refuse_packed_module_attention(block)
    styles: dict[str, Any] = {}
    attributes: dict[str, int] = {}
    found = [(n, m) for n, m in block.named_modules() if _is_attention(m)]
    ids = {id(m) for _, m in found}  # the innermost: a block keeping its own head count is no attention module
    attention = [(n, m) for n, m in found if not any(id(sub) in ids for sub in list(m.modules())[1:])]
    inside_attention = {id(sub) for _, m in attention for sub in m.modules()}
    for module_name, module in attention:
        styles.update(_attention_roles(module_name, module, ranks, block))
        heads = _int_attributes(module, (*HEAD_COUNTS, *HEAD_WIDTHS))
        attributes.update({_joined(module_name, attr): value // ranks for attr, value in heads.items()})
    for module_name, module in block.named_modules():
        if id(module) not in inside_attention and len(_linears(module)) >= 2:
            styles.update(_mlp_roles(module_name, module, ranks, block))
    if not styles:
        raise TensorPlanError(
            f"{type(block).__name__} ({name}) holds no attention module (one keeping its head count as"
            f" {', '.join(HEAD_COUNTS)}, or a packed q, k, v projection) and no MLP (two or more Linear children) that"
            " the automatic tensor-parallel plan knows. Pass tensor_plan={'attn.qkv': ColwiseParallel(), ...}"
            " (module-name patterns inside the block) or a callable (block name, block) -> {name: style}, or"
            " tensor_parallel=1."
        )
    return BlockPlan(styles, attributes, "automatic (Megatron: input projections colwise, output rowwise)",
                     tuple(n for n, _ in attention))


def _user_plan(name: str, block: nn.Module, user: TensorPlanSelector) -> BlockPlan:
    if callable(user):
        return BlockPlan(dict(user(name, block)), family="user callable")
    names = [n for n, _ in block.named_modules() if n]
    styles = {n: style for pattern, style in user.items() for n in names if fnmatch.fnmatchcase(n, pattern)}
    unmatched = [p for p in user if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        raise TensorPlanError(
            f"tensor_plan patterns {unmatched} match no module of {type(block).__name__} ({name}), whose modules are"
            f" {names[:12]}{' ...' if len(names) > 12 else ''}. Patterns are module names inside the block."
        )
    return BlockPlan(styles, family="user patterns")


def _refuse_packed_module_attention(block: nn.Module) -> None:
    for module_name, module in block.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            raise TensorPlanError(
                f"{type(block).__name__} uses nn.MultiheadAttention ({module_name or 'the block'}; torchvision's"
                " EncoderBlock, nn.TransformerEncoderLayer): its packed in-projection is a raw parameter and its"
                " forward checks the full width, so the automatic tensor-parallel plan cannot split its heads"
                " without changing model code. Pass tensor_plan= (e.g. {'mlp.0': ColwiseParallel(), 'mlp.3':"
                " RowwiseParallel()} for the MLP only) or a callable, or use tensor_parallel=1."
            )


def _linears(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, c) for n, c in module.named_children() if isinstance(c, nn.Linear)]


def _projections(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    """An attention module's Linears, nested ones included (lucidrains' ``to_out = Sequential(Linear, Dropout)``)."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]


def _is_attention(module: nn.Module) -> bool:
    """It keeps a head count and holds Linears, or (no head count: heads are then read from the shapes in its
    forward, which the proof checks) its Linears are a packed ``[q; k; v]`` or q, k, v, then the output."""
    linears = [linear for _, linear in _projections(module)]
    if not linears:
        return False
    if _head_count(module) is not None:
        return True
    *inputs, out = linears
    return ([i.out_features for i in inputs] == [3 * out.in_features] or
            (len(inputs) == 3 and all(i.out_features == out.in_features for i in inputs)))


def _int_attributes(module: nn.Module, names: tuple[str, ...]) -> dict[str, int]:
    return {a: v for a in names if isinstance(v := getattr(module, a, None), int) and not isinstance(v, bool)}


def _head_count(module: nn.Module) -> int | None:
    return next(iter(_int_attributes(module, HEAD_COUNTS).values()), None)


def _joined(prefix: str, child: str) -> str:
    return f"{prefix}.{child}" if prefix else child


def _attention_roles(prefix: str, module: nn.Module, ranks: int, block: nn.Module) -> dict[str, Role]:
    """Packed ``[qkv, proj]`` (timm, the examples) or separate ``[q, k, v, out]`` (HF): the output comes last."""
    linears = _projections(module)
    *inputs, (out_name, out) = linears
    width = out.in_features
    heads = _head_count(module) or 0
    where = f"{type(block).__name__}.{prefix or type(module).__name__}"
    if heads % ranks:
        raise TensorPlanError(f"{where} has {heads} heads, not divisible by tensor_parallel={ranks}.")
    if len(inputs) == 1 and inputs[0][1].out_features == 3 * width:
        return {_joined(prefix, inputs[0][0]): "packed_colwise", _joined(prefix, out_name): "rowwise"}
    if len(inputs) == 3 and all(linear.out_features == width for _, linear in inputs):
        roles: dict[str, Role] = {_joined(prefix, n): "colwise" for n, _ in inputs}
        return {**roles, _joined(prefix, out_name): "rowwise"}
    raise TensorPlanError(
        f"{where}: the automatic tensor-parallel plan knows a packed [q; k; v] Linear or three q, k, v Linears"
        f" followed by the output Linear; found {[n for n, _ in linears]} (a gate or extra projection?). Pass"
        " tensor_plan= with a style per module, or tensor_parallel=1."
    )


def _mlp_roles(prefix: str, module: nn.Module, ranks: int, block: nn.Module) -> dict[str, Role]:
    """``fc1 (, fc_gate) -> act -> fc2``: every Linear but the last column-wise, the last row-wise."""
    *inputs, (out_name, out) = _linears(module)
    hidden = out.in_features
    where = f"{type(block).__name__}.{prefix or type(module).__name__}"
    if any(linear.out_features != hidden for _, linear in inputs):
        raise TensorPlanError(
            f"{where}: an MLP whose first Linear(s) do not produce the last one's {hidden} inputs (a packed"
            " SwiGLU?). Pass tensor_plan= with a style per module, or tensor_parallel=1."
        )
    if hidden % ranks:
        raise TensorPlanError(f"{where} has a hidden width of {hidden}, not divisible by tensor_parallel={ranks}.")
    roles: dict[str, Role] = {_joined(prefix, n): "colwise" for n, _ in inputs}
    return {**roles, _joined(prefix, out_name): "rowwise"}
