"""What verified checkpoints cost: at save (each rank CRC-32s its share of the files the save just wrote) and at
a whole-folder read (``load_consolidated``, what ``consolidate``, ``export`` and ``load_from_checkpoint`` run, checks
every file's CRC-32 before reading it).

Run: ``python -m torch.distributed.run --nproc-per-node 2 benchmarks/checksum_cost.py`` (CPU, gloo). Every rank
holds ``--mib`` MiB of its own fp32 tensors; ``save_sharded`` writes them to ``--dir`` (a sharded folder, as
``VitScaleStrategy`` saves) with the CRC-32s, interleaved with the same save whose hashing is replaced by a
no-op, ``--repeats`` times each. Rank 0 prints the median save time of both, the difference (ms per save and %
of the save), and zlib.crc32's single-core throughput on a buffer in memory. Then rank 0 alone reads the folder
with ``load_consolidated`` with and without the check (``verify=True``/``False``), interleaved, ``--repeats`` times
each, with the page cache warm (the files were just written and read) as a second read of a local disk is.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import zlib
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist

from lightning_vitscale.checkpoint import Location, load_consolidated, manifest, save
from lightning_vitscale.checkpoint.save import save_sharded
from lightning_vitscale.distributed import RankContext


def crc_throughput_mb_s(mib: int = 256) -> float:
    data = torch.randn(mib << 18).numpy().tobytes()
    start = time.perf_counter()
    zlib.crc32(data)
    return len(data) / 1e6 / (time.perf_counter() - start)


def timed_save(location: Location, state: dict, group: RankContext) -> float:
    dist.barrier()
    start = time.perf_counter()
    save_sharded({"state_dict": dict(state), "global_step": 0}, location, group)
    return time.perf_counter() - start


def timed_reads(location: Location, repeats: int) -> tuple[list[float], list[float]]:
    """``load_consolidated`` of the folder with and without the CRC-32 check, interleaved (one warm-up each)."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(repeats + 1):
        for verify in (True, False):
            start = time.perf_counter()
            load_consolidated(location.url, verify=verify)
            if i:
                times[verify].append(time.perf_counter() - start)
    return times[True], times[False]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=150, help="MiB of fp32 tensors per rank")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()

    def gather(value):
        out = [None] * world
        dist.all_gather_object(out, value)
        return out

    group = RankContext(rank=rank, world_size=world, all_gather_objects=gather, barrier=dist.barrier)
    state = {f"rank{rank}.w{i}": torch.randn(args.mib << 16) for i in range(4)}  # 4 tensors of mib/4 MiB
    location = Location.of(f"{args.dir}/checksum_cost.ckpt")
    fake = {"size": 0, "crc32": 0}
    no_hash = mock.patch.object(save, "file_sums", lambda folder, names: {n: manifest.FileSum(**fake) for n in names})
    timed_save(location, state, group)  # warm-up: files and page cache exist
    with_crc, without = [], []
    for _ in range(args.repeats):  # interleaved
        with_crc.append(timed_save(location, state, group))
        with no_hash:
            without.append(timed_save(location, state, group))
    timed_save(location, state, group)  # the folder with its real CRC-32s, for the reads
    if rank == 0:
        a, b = statistics.median(with_crc), statistics.median(without)
        total = sum(p.stat().st_size for p in __import__("pathlib").Path(location.path).iterdir()) / 2**20
        print(f"checkpoint: {total:.0f} MiB over {world} ranks; save median with CRC-32 {a * 1e3:.0f} ms,"
              f" without {b * 1e3:.0f} ms: +{(a - b) * 1e3:.0f} ms per save ({(a - b) / b * 100:.1f}% of the save)")
        print(f"runs with CRC-32 (s): {[round(t, 3) for t in with_crc]}; without: {[round(t, 3) for t in without]}")
        print(f"zlib.crc32, one core, in memory: {crc_throughput_mb_s():.0f} MB/s")
        checked, unchecked = timed_reads(location, args.repeats)
        c, u = statistics.median(checked), statistics.median(unchecked)
        print(f"load_consolidated of the folder: median with the check {c * 1e3:.0f} ms, without {u * 1e3:.0f} ms:"
              f" +{(c - u) * 1e3:.0f} ms ({(c - u) / u * 100:.0f}% of the read; {total / (c - u):.0f} MiB/s checked)")
        print(f"reads with the check (s): {[round(t, 3) for t in checked]};"
              f" without: {[round(t, 3) for t in unchecked]}")
        Location.of(location.url).remove()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
