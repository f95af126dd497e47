"""fp32 replicated norms: the parameter swap around a norm's forward survives a forward that raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vitscale.precision.norms import ReplicatedNorms


class FlakyNorm(nn.LayerNorm):
    """A LayerNorm whose forward raises while ``fail`` is set (an OOM or a bad input in real life)."""

    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("forward failed")
        return super().forward(x)


def test_a_forward_that_raises_leaves_the_dtensor_parameters_in_place(mesh):
    torch.manual_seed(0)
    norm = FlakyNorm(8)
    reference = nn.LayerNorm(8)
    reference.load_state_dict(norm.state_dict())
    ReplicatedNorms([norm], mesh, torch.float32)
    before = dict(norm._parameters)
    x = torch.randn(2, 8, dtype=torch.bfloat16)

    norm.fail = True
    with pytest.raises(RuntimeError, match="forward failed"):
        norm(x)
    assert all(norm._parameters[name] is param for name, param in before.items())  # not their local tensors
    assert all(isinstance(p, DTensor) for p in norm.parameters())

    norm.fail = False
    out = norm(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference(x.float()).to(torch.bfloat16))
    out.float().sum().backward()
    assert all(isinstance(p.grad, DTensor) for p in norm.parameters())


def _converted(mesh, dim: int = 8) -> tuple[nn.LayerNorm, nn.LayerNorm]:
    torch.manual_seed(0)
    norm, reference = nn.LayerNorm(dim), nn.LayerNorm(dim)
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    reference.load_state_dict(norm.state_dict())
    ReplicatedNorms([norm], mesh, torch.float32)
    return norm, reference


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for n, p in module.named_parameters()}


def test_eager_forward_records_no_dtensor_conversion_and_grads_match_a_plain_norm(mesh):
    """The eager path computes on plain leaves aliasing the parameters: no DTensor autograd function in the graph
    (to_local/from_local per parameter per step was most of the norms' host time), same gradients."""
    norm, reference = _converted(mesh)
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    out = norm(x)
    nodes, leaves, stack = set(), [], [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in nodes:
            continue
        nodes.add(node)
        if hasattr(node, "variable"):
            leaves.append(node.variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    assert not [type(n).__name__ for n in nodes if "Torch" in type(n).__name__ or "DTensor" in type(n).__name__]
    aliases = [leaf for leaf in leaves if leaf is not x]
    assert len(aliases) == 2 and not any(isinstance(leaf, DTensor) for leaf in aliases)
    assert {a.data_ptr() for a in aliases} == {p.to_local().data_ptr() for p in norm.parameters()}

    (out.float() * torch.arange(8.0)).sum().backward()
    (reference(x.detach().float()).to(torch.bfloat16).float() * torch.arange(8.0)).sum().backward()
    got, want = _grads(norm), _grads(reference)
    assert all(isinstance(p.grad, DTensor) for p in norm.parameters())
    assert all(leaf.grad is None for leaf in aliases)  # handed over, not kept twice
    for name in want:
        torch.testing.assert_close(got[name], want[name])


def test_gradients_accumulate_follow_zero_grad_and_freezing_as_on_a_plain_parameter(mesh):
    norm, reference = _converted(mesh)
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)

    def both(fn):
        for module in (norm, reference):
            fn(module)

    both(lambda m: m(x1).pow(2).sum().backward())
    both(lambda m: m(x2).sin().sum().backward())  # a second micro-batch: summed into the first
    for name, grad in _grads(reference).items():
        torch.testing.assert_close(_grads(norm)[name], grad)

    both(lambda m: [p.grad.zero_() for p in m.parameters()])  # zero_grad(set_to_none=False): summed into zeros
    both(lambda m: m(x2).pow(3).sum().backward())
    for name, grad in _grads(reference).items():
        torch.testing.assert_close(_grads(norm)[name], grad)

    both(lambda m: [setattr(p, "grad", None) for p in m.parameters()])
    both(lambda m: m.weight.requires_grad_(False))  # a frozen weight gets no gradient; the bias still does
    both(lambda m: m(x1).pow(2).sum().backward())
    assert norm.weight.grad is None and reference.weight.grad is None
    torch.testing.assert_close(_grads(norm)["bias"], _grads(reference)["bias"])

    both(lambda m: m.weight.requires_grad_(True))  # unfrozen: its gradient flows again
    both(lambda m: m(x1).pow(2).sum().backward())
    torch.testing.assert_close(_grads(norm)["weight"], _grads(reference)["weight"])


def test_a_replaced_or_copied_parameter_is_computed_with_never_a_stale_alias(mesh):
    import copy

    norm, _ = _converted(mesh)
    x = torch.randn(4, 8)
    norm(x).sum().backward()  # builds the leaves of the current local tensors
    norm._apply(lambda t: t.clone())  # DTensor parameters are swapped in place: new local tensors
    with torch.no_grad():
        for p in norm.parameters():
            p.fill_(2.0)
            p.grad = None
    torch.testing.assert_close(norm(x), nn.functional.layer_norm(x, (8,)) * 2.0 + 2.0)

    twin = copy.deepcopy(norm)
    with torch.no_grad():
        for p in twin.parameters():
            p.fill_(3.0)
    torch.testing.assert_close(twin(x), nn.functional.layer_norm(x, (8,)) * 3.0 + 3.0)
    twin(x).sum().backward()
    assert all(p.grad is None for p in norm.parameters())  # the copy's gradients reach the copy only
    assert all(isinstance(p.grad, DTensor) for p in twin.parameters())


def test_the_norms_are_averaged_once_per_synced_backward_however_it_was_called(mesh):
    """At the end of any backward that handed a norm gradient over (a raw ``loss.backward()`` too), once; Lightning's
    post-backward then does not average again, but does when no gradient was handed over (compiled norms)."""
    norm = nn.LayerNorm(8)
    norms = ReplicatedNorms([norm], mesh, torch.float32)
    calls: list[str] = []
    norms.reduce_grads = lambda: calls.append("reduce") or 0  # type: ignore[method-assign]
    x = torch.randn(4, 8)

    norm(x).sum().backward()
    assert calls == ["reduce"]  # at the end of the backward, not once per parameter
    norms.after_backward()
    assert calls == ["reduce"]  # already done for this backward

    norms.syncing = False  # a micro-batch before the last of an accumulation window
    norm(x).sum().backward()
    norms.after_backward()
    assert calls == ["reduce"]
    norms.syncing = True

    norms.after_backward()  # a backward that handed nothing over (compiled norms): Lightning's hook averages
    assert calls == ["reduce", "reduce"]


def test_compiled_norms_are_averaged_at_the_end_of_a_raw_backward_too(mesh):
    """Compiled, a norm's gradient accumulates on its DTensor parameter (no leaf hands it over): the parameter's
    own hook queues the average, once per backward; a norm frozen at setup and unfrozen later is followed."""
    norm, frozen = nn.LayerNorm(8), nn.LayerNorm(8).requires_grad_(False)
    norms = ReplicatedNorms([norm, frozen], mesh, torch.float32)
    calls: list[str] = []
    norms.reduce_grads = lambda: calls.append("reduce") or 0  # type: ignore[method-assign]
    compiled, compiled_frozen = torch.compile(norm, backend="eager"), torch.compile(frozen, backend="eager")
    x = torch.randn(4, 8, requires_grad=True)

    compiled(x).sum().backward()
    assert calls == ["reduce"] and isinstance(norm.weight.grad, DTensor)  # two gradients, one average
    compiled_frozen(x).sum().backward()
    assert calls == ["reduce"]  # nothing of the norms trained
    frozen.weight.requires_grad_(True)
    compiled_frozen(x).sum().backward()
    assert calls == ["reduce", "reduce"] and isinstance(frozen.weight.grad, DTensor) and frozen.bias.grad is None


def test_a_backward_that_raises_does_not_stop_later_ones_averaging(mesh):
    """The end-of-backward callback queued in a backward that raised never runs: the next backward must queue its
    own (a flag left set would stop every later average, and the replicas would drift apart)."""
    norm = nn.LayerNorm(8)
    norms = ReplicatedNorms([norm], mesh, torch.float32)
    calls: list[str] = []
    norms.reduce_grads = lambda: calls.append("reduce") or 0  # type: ignore[method-assign]

    def fail(_: torch.Tensor) -> None:
        raise RuntimeError("boom")

    x = torch.randn(4, 8, requires_grad=True)
    handle = x.register_hook(fail)  # on the leaf below a multiplication: after the norm's gradients arrived
    with pytest.raises(RuntimeError, match="boom"):
        norm(x * 2).sum().backward()
    assert calls == [] and isinstance(norm.weight.grad, DTensor)
    handle.remove()
    norm(x * 2).sum().backward()
    assert calls == ["reduce"]
