"""The step-peak measurement's pairing of allocator events (``tests/helpers/peak.py``), on synthetic event streams:
allocations on the training thread, frees on a collective's worker thread, the same addresses reused."""

from __future__ import annotations

from tests.helpers.peak import AllocatorEvent, address_matched_peak

MAIN, WORKER = 1, 2
A, B = 0x1000, 0x2000
MIB = 2**20


def test_frees_the_profiler_never_saw_are_retired_when_their_address_is_reused():
    # gloo's worker thread drops each collective input (at A) unrecorded; glibc hands A out again.
    events = [
        AllocatorEvent(10, MAIN, A, 4 * MIB),  # reduce-scatter input of block 3
        AllocatorEvent(20, MAIN, B, 1 * MIB),  # an activation gradient
        AllocatorEvent(30, MAIN, A, 4 * MIB),  # block 2's input, at A: block 3's was freed unseen
        AllocatorEvent(40, MAIN, A, 4 * MIB),  # block 1's
        AllocatorEvent(50, MAIN, B, -1 * MIB),
    ]
    assert address_matched_peak(events, start=0) == 5 * MIB  # a plain running sum says 13 MiB


def test_a_free_recorded_on_another_thread_retires_the_block_once():
    # Listed thread by thread, as the profiler's event tree gives them: the worker's free comes first.
    events = [
        AllocatorEvent(20, WORKER, A, -4 * MIB),  # the worker frees the main thread's block at A
        AllocatorEvent(10, MAIN, A, 4 * MIB),
        AllocatorEvent(30, MAIN, A, 4 * MIB),  # A reused: the earlier block there is already retired
        AllocatorEvent(40, MAIN, B, 1 * MIB),
    ]
    # Paired by (thread, address) the reuse at 30 retires the block a second time (4 MiB);
    # in the order given the free counts before its allocation (1 MiB).
    assert address_matched_peak(events, start=0) == 5 * MIB


def test_events_before_the_start_pair_but_do_not_count():
    events = [
        AllocatorEvent(5, MAIN, B, 2 * MIB),  # the previous step's: in the baseline, not in the sum
        AllocatorEvent(10, MAIN, A, 3 * MIB),
        AllocatorEvent(15, MAIN, B, -2 * MIB),  # freed during the step: the sum goes below its start
        AllocatorEvent(20, MAIN, B, 1 * MIB),
    ]
    assert address_matched_peak(events, start=8) == 3 * MIB
