"""The GPU benchmark's pieces on CPU: no per-step device sync, OOM by type ends a batch search cleanly, FLOPs."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from benchmarks import vit_gpu
from benchmarks.search import OK, OOM, classify_failure, largest_batch
from benchmarks.tables import markdown_table, mfu, train_flops_per_sample
from benchmarks.timing import CudaClock, WindowTimer, rates, summarize


class FakeEvent:
    """Stands in for ``torch.cuda.Event`` on CPU; counts what the timer asks of the device."""

    calls: dict[str, int] = {}
    clock = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t: float | None = None

    def record(self, stream=None) -> None:
        FakeEvent.calls["record"] += 1
        FakeEvent.clock += 1.0
        self.t = FakeEvent.clock

    def synchronize(self) -> None:
        FakeEvent.calls["synchronize"] += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        FakeEvent.calls["elapsed_time"] += 1
        return (end.t - self.t) * 1e3


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeEvent.calls = {"record": 0, "synchronize": 0, "elapsed_time": 0, "device_synchronize": 0}

    def device_synchronize(device=None) -> None:
        FakeEvent.calls["device_synchronize"] += 1

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", device_synchronize)
    return FakeEvent.calls


def test_timer_records_only_window_edges_and_waits_only_when_read(fake_cuda):
    resets = []
    timer = WindowTimer(warmup=2, steps_per_window=4, windows=3, clock=CudaClock(),
                        on_measure_start=lambda: resets.append(timer.steps))
    records_after_step = []
    for _ in range(timer.total_steps):
        timer.step()
        records_after_step.append(fake_cuda["record"])
        assert fake_cuda["synchronize"] == fake_cuda["elapsed_time"] == fake_cuda["device_synchronize"] == 0
    # edges: end of warm-up (step 2), then the end of each 4-step window (steps 6, 10, 14)
    assert records_after_step == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    assert resets == [2]
    assert timer.done
    assert timer.window_seconds() == [1.0, 1.0, 1.0]  # the fake clock ticks once per recorded event
    assert fake_cuda["device_synchronize"] == 0
    assert fake_cuda["synchronize"] == fake_cuda["elapsed_time"] == 3  # one wait per window, at read time


def test_extra_steps_after_the_last_window_are_not_timed(fake_cuda):
    timer = WindowTimer(warmup=0, steps_per_window=1, windows=3, clock=CudaClock())
    for _ in range(10):
        timer.step()
    assert fake_cuda["record"] == 4 and len(timer.window_seconds()) == 3


def test_median_and_range_over_windows():
    spread = summarize(rates(8, 2, [1.0, 2.0, 4.0]))  # 16, 8, 4 images/s
    assert (spread.median, spread.low, spread.high, spread.n) == (8.0, 4.0, 16.0, 3)
    assert spread.relative_range == pytest.approx(1.5)
    with pytest.raises(ValueError, match="no finished window"):
        summarize([])


def _fits_up_to(capacity: int, log: list[int]):
    """A trial that raises a real ``torch.OutOfMemoryError`` above ``capacity`` and is classified by type."""

    def try_batch(batch: int) -> str:
        log.append(batch)
        try:
            if batch > capacity:
                raise torch.OutOfMemoryError(f"CUDA out of memory (test stand-in, batch {batch})")
            return OK
        except BaseException as exc:
            return classify_failure(exc)

    return try_batch


@pytest.mark.parametrize("capacity", [1, 5, 16, 17, 100, 511])
def test_binary_search_returns_the_largest_batch_that_fits(capacity):
    log: list[int] = []
    result = largest_batch(_fits_up_to(capacity, log), start=4, limit=512)
    assert result.largest == capacity
    assert result.stopped_by == OOM
    assert max(log) <= 512 and len(log) == len(set(log)) <= 2 * 10


def test_search_reaching_the_limit_stops_there():
    log: list[int] = []
    result = largest_batch(_fits_up_to(10_000, log), start=16, limit=100)
    assert (result.largest, result.stopped_by, log) == (100, "limit", [16, 32, 64, 100])


def test_search_with_granularity_stops_when_bounds_are_close():
    result = largest_batch(_fits_up_to(100, []), start=16, limit=1024, granularity=8)
    assert 100 - 8 < result.largest <= 100


def test_other_failures_stop_the_search_and_are_recorded_by_type():
    def try_batch(batch: int) -> str:
        try:
            if batch >= 64:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return OK
        except BaseException as exc:
            return classify_failure(exc)

    result = largest_batch(try_batch, start=16, limit=1024)
    assert (result.largest, result.stopped_by) == (32, "RuntimeError")
    assert result.trials == [(16, OK), (32, OK), (64, "RuntimeError")]


def test_oom_is_classified_by_type_not_text():
    try:
        try:
            raise torch.OutOfMemoryError("allocation failed")
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("backend compiler failed") from inner
    except RuntimeError as wrapped:
        assert classify_failure(wrapped) == OOM  # e.g. Inductor wrapping the allocator's error
    assert classify_failure(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")) == "RuntimeError"
    assert classify_failure(KeyError("x")) == "KeyError"


def test_trial_reports_an_out_of_memory_error_raised_inside_lightning_as_oom():
    spec = dict(model=vit_gpu.DRY_MODEL, row=vit_gpu.asdict(vit_gpu.ROWS["single"]), batch=4, steps=1, windows=1,
                warmup=0, device="cpu", fake_oom_above=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = vit_gpu.trial(spec)
    assert result["status"] == OOM, result


def test_model_flops_match_a_hand_count():
    # forward of x(1 x 32) @ W(32 x 16): 2 * 32 * 16 FLOPs; forward + backward counted as 3x.
    assert train_flops_per_sample(lambda: nn.Linear(32, 16), (32,)) == 3 * 2 * 32 * 16
    assert mfu(3 * 2 * 32 * 16, samples_per_sec=1000.0, peak_flops=1e9) == pytest.approx(3072e3 / 1e9)
    assert mfu(1.0, 1.0, None) is None


def test_vit_b16_flops_are_the_published_figure():
    flops = train_flops_per_sample(lambda: vit_gpu.build_vit(vit_gpu.MODELS["vit-b16"]), (3, 224, 224))
    assert flops / 3 == pytest.approx(2 * 17.56e9, rel=0.01)  # ViT-B/16 at 224 px: 17.6 GMACs forward


def test_markdown_table_layout():
    text = markdown_table(["a", "b"], [[1, None], ["x", 2.5]])
    assert text.splitlines() == ["| a | b |", "|---|---|", "| 1 | - |", "| x | 2.5 |"]
    with pytest.raises(ValueError, match="2 headers"):
        markdown_table(["a", "b"], [[1]])


def test_rows_differ_only_in_their_named_factor():
    rows = vit_gpu.ROWS
    assert rows["single"].strategy == "auto" and rows["ddp"].strategy == "ddp"
    assert (rows["ddp_compile"].compile_model, rows["ddp_compile"].fused_adamw) == (True, True)
    for kernels in ("eager", "auto"):
        assert rows[f"{kernels}_ac0"].ac is False and rows[f"{kernels}_ac1"].ac is True
        assert rows[f"{kernels}_ac0"].kernels == rows[f"{kernels}_ac1"].kernels == kernels
    assert len({vit_gpu.MODELS[m]["image"] for m in vit_gpu.MODELS}) == 1


def test_the_default_row_is_the_strategy_as_a_user_writes_it_and_the_recipe_row_its_memory_first_setting():
    from lightning_vitscale import VitScaleStrategy

    default = vit_gpu.make_strategy(vit_gpu.ROWS["default"])
    assert default.config == VitScaleStrategy().config  # nothing passed: what a drop-in user gets
    recipe = vit_gpu.make_strategy(vit_gpu.ROWS["recipe"])
    assert recipe.config == VitScaleStrategy(**vit_gpu.RECIPE).config != default.config
    assert vit_gpu.CAP_ROWS == ["single", "ddp", "default", "recipe"]
