"""Streaming tar shards (WebDataset format): which samples each rank and loader worker reads, and in what order.

The tar files are read with WebDataset's own tar iterator and key grouping (``webdataset.tariterators``), opened
through ``fsspec`` (local paths, ``file://``, ``memory://``, ``s3://``, ``gs://``, ... whatever fsspec can open).
The splitting is done here, not by WebDataset's ``split_by_node``/``split_by_worker``/``with_epoch``: those give
each rank whole shards, so ranks see different sample counts (a hang at the uneven last batch) or, with
``with_epoch``, repeat and drop samples; neither resumes mid-epoch. Here one epoch is one ordered stream:

1. The shards in the epoch's order (shuffled with ``seed + epoch``: the same on every rank, every run).
2. Rank ``r`` of ``R`` reads positions ``[r * n, (r + 1) * n)`` of that stream, ``n = ceil(N / R)``
   (``remainder="pad"``: positions past ``N`` wrap to the stream's start, so the first ``n * R - N`` samples of
   the epoch are read twice, as DDP's ``DistributedSampler`` pads) or ``n = N // R`` (``"drop"``: the last
   ``N mod R`` samples of the epoch's stream are not read). Every rank thus runs ``ceil(n / batch_size)`` batches.
3. A rank's range is cut into loader workers' contiguous runs of whole batches, so a worker reads its own shards
   (a shard may straddle two workers or ranks: each reads its part, the one with the later part skips the
   earlier). The DataLoader takes batches from its workers in turn, which :func:`consumed_per_worker` replays.
4. Each worker shuffles its run through a buffer of ``shuffle_buffer`` samples (seeded by seed, epoch, rank and
   worker), then decodes. A resumed epoch replays that buffer without decoding up to each worker's position.
"""

from __future__ import annotations

import math
import random
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import fsspec
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from webdataset.tariterators import group_by_keys, tar_file_expander

Remainder = Literal["pad", "drop"]


@dataclass(frozen=True)
class Piece:
    """Samples ``[start, stop)`` (in file order) of shard number ``shard``."""

    shard: int
    start: int
    stop: int


def epoch_order(n_shards: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The shards' order in one epoch: the same on every rank and every run for a given seed and epoch."""
    order = list(range(n_shards))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def samples_per_rank(total: int, world: int, remainder: Remainder) -> int:
    """Samples each rank reads per epoch: ``ceil(total / world)`` (pad) or ``total // world`` (drop)."""
    match remainder:
        case "pad":
            return -(-total // world)
        case "drop":
            return total // world
        case _:
            raise ValueError(f"remainder={remainder!r}: choose 'pad' (repeat the first samples) or 'drop'")


def worker_batches(per_rank: int, batch_size: int, workers: int) -> list[int]:
    """Whole batches per loader worker (the earlier workers take the extra ones; only the last batch is short)."""
    base, extra = divmod(math.ceil(per_rank / batch_size), max(1, workers))
    return [base + (w < extra) for w in range(max(1, workers))]


def worker_range(per_rank: int, batch_size: int, workers: int, worker: int) -> tuple[int, int]:
    """The worker's run ``[start, stop)`` of positions within its rank's range."""
    batches = worker_batches(per_rank, batch_size, workers)
    start = sum(batches[:worker]) * batch_size
    return start, min(start + batches[worker] * batch_size, per_rank)


def consumed_per_worker(batches_done: int, per_worker: list[int]) -> list[int]:
    """Batches each worker delivered when the loader had yielded ``batches_done``: the DataLoader takes one batch
    from each worker in turn, passing over the workers that have run out."""
    done, left = [0] * len(per_worker), batches_done
    while left > 0:
        progressed = False
        for w, n in enumerate(per_worker):
            if left > 0 and done[w] < n:
                done[w] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"position {batches_done} lies past the epoch's {sum(per_worker)} batches")
    return done


def stream_pieces(counts: list[int], order: list[int], start: int, stop: int) -> list[Piece]:
    """Positions ``[start, stop)`` of the epoch's stream (shards in ``order``) as pieces; positions ``>= sum``
    wrap around to the stream's start (the "pad" remainder)."""
    total = sum(counts)
    pieces: list[Piece] = []
    while start < stop:
        offset, position = 0, start % total
        for shard in order:
            if position < offset + counts[shard]:
                take = min(stop - start, offset + counts[shard] - position)
                pieces.append(Piece(shard, position - offset, position - offset + take))
                start += take
                break
            offset += counts[shard]
    return pieces


def read_pieces(urls: list[str], pieces: list[Piece]) -> Iterator[dict[str, Any]]:
    """Raw samples (``{"__key__": ..., "png": bytes, "cls": bytes}``) of ``pieces``, read through fsspec. A shard
    that cannot be read or holds fewer samples than the index says fails naming it: it is damaged."""
    for piece in pieces:
        url, seen = urls[piece.shard], 0
        try:
            with fsspec.open(url, "rb") as stream:
                samples = group_by_keys(tar_file_expander([{"url": url, "stream": stream}]))
                for seen, sample in enumerate(samples, 1):
                    if seen > piece.start:
                        yield sample
                    if seen == piece.stop:
                        break
        except (tarfile.TarError, EOFError) as error:  # WebDataset appends the stream and URL to the args
            detail = error.args[0] if error.args else type(error).__name__
            raise damaged_shard(url, f"it is not a readable tar file ({detail})") from None
        if seen < piece.stop:
            raise damaged_shard(url, f"it ends after {seen} samples, index.json records at least {piece.stop}")


def damaged_shard(url: str, problem: str) -> OSError:
    return OSError(
        f"Shard {url} is damaged: {problem} (truncated by an interrupted copy, or changed since index.json was"
        " written). Restore it from a good copy, or rewrite the shards and their index (python -m examples.shards"
        " write-shards SRC DEST); re-indexing alone would train without the lost samples."
    )


def shuffled(samples: Iterator[Any], buffer: int, rng: random.Random) -> Iterator[Any]:
    """WebDataset-style shuffle buffer: hold ``buffer`` samples, yield a random one as each new one arrives."""
    if buffer <= 1:
        yield from samples
        return
    held: list[Any] = []
    for sample in samples:
        if len(held) < buffer:
            held.append(sample)
            continue
        i = rng.randrange(buffer)
        held[i], sample = sample, held[i]
        yield sample
    rng.shuffle(held)
    yield from held


class ShardStream(IterableDataset):
    """One rank's samples of a set of shards, split between the DataLoader's workers (module docstring).

    ``epoch``, ``skip`` (batches already delivered per worker) and ``rotate`` (the worker whose turn is next) are
    set by :class:`ShardLoader` before it starts its workers, which then read them from their copy of this object.
    """

    def __init__(
        self, urls: list[str], counts: list[int], decode: Callable[[dict[str, Any]], Any], *, rank: int, world: int,
        batch_size: int, workers: int, shuffle: bool, shuffle_buffer: int = 0, seed: int = 0,
        remainder: Remainder = "pad",
    ) -> None:  # fmt: skip
        super().__init__()
        if not urls or sum(counts) == 0:
            raise ValueError(
                "no samples to stream: the shard list is empty (write shards with "
                "`python -m examples.shards write-shards SRC DEST`, then pass --data.root=DEST)"
            )
        self.urls, self.counts, self.decode = urls, counts, decode
        self.rank, self.world, self.batch_size, self.workers = rank, world, batch_size, max(1, workers)
        self.shuffle, self.shuffle_buffer, self.seed = shuffle, shuffle_buffer if shuffle else 0, seed
        self.per_rank = samples_per_rank(sum(counts), world, remainder)
        if self.per_rank == 0:
            raise ValueError(f"{sum(counts)} samples cannot give each of {world} ranks one with remainder='drop'")
        self.epoch = 0
        self.skip = [0] * self.workers
        self.rotate = 0

    def batches(self) -> list[int]:
        """Batches per worker in one epoch (the same on every rank)."""
        return worker_batches(self.per_rank, self.batch_size, self.workers)

    def pieces(self, worker: int) -> list[Piece]:
        start, stop = worker_range(self.per_rank, self.batch_size, self.workers, worker)
        order = epoch_order(len(self.urls), self.seed, self.epoch, self.shuffle)
        offset = self.rank * self.per_rank
        return stream_pieces(self.counts, order, offset + start, offset + stop)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if (info.num_workers if info is not None else 1) != self.workers:
            raise RuntimeError(f"ShardStream planned for {self.workers} workers, runs in {info}: use ShardLoader")
        # the DataLoader asks worker 0 first; a resumed epoch starts its turn where the interrupted one stood
        worker = ((info.id if info is not None else 0) + self.rotate) % self.workers
        rng = random.Random(hash((self.seed, self.epoch, self.rank, worker)))
        skip = min(self.skip[worker] * self.batch_size, sum(p.stop - p.start for p in self.pieces(worker)))
        for i, sample in enumerate(shuffled(read_pieces(self.urls, self.pieces(worker)), self.shuffle_buffer, rng)):
            if i >= skip:  # a resumed epoch: the samples before the position are read but never decoded
                yield self.decode(sample)


class ShardLoader(DataLoader):
    """DataLoader over a :class:`ShardStream` with a length (batches per rank per epoch, equal on every rank) and
    Lightning's stateful-loader interface: the position in the epoch is saved in the checkpoint
    (``loops.fit_loop.state_dict.combined_loader``) and a resumed run continues the epoch from there.

    ``epoch`` gives the epoch about to start (the datamodule passes the trainer's ``current_epoch``); without
    it, each ``iter()`` starts the next epoch. Workers are started anew each epoch (no persistent workers): they
    read the epoch and the resume position from their copy of the dataset.
    """

    dataset: ShardStream

    def __init__(
        self, dataset: ShardStream, *, num_workers: int, epoch: Callable[[], int] | None = None, **loader_kwargs: Any
    ) -> None:  # fmt: skip
        if max(1, num_workers) != dataset.workers:
            raise ValueError(f"the stream was split for {dataset.workers} worker(s), the loader has {num_workers}")
        loader_kwargs["persistent_workers"] = False
        super().__init__(dataset, batch_size=dataset.batch_size, num_workers=num_workers, **loader_kwargs)
        self.epoch_fn = epoch
        self._epoch, self._position, self._resume = -1, 0, (-1, 0)

    def __len__(self) -> int:
        return sum(self.dataset.batches())

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        epoch = self.epoch_fn() if self.epoch_fn is not None else self._epoch + 1
        skip = self._resume[1] if self._resume[0] == epoch else 0
        self._resume = (-1, 0)
        self.dataset.epoch, self.dataset.skip = epoch, consumed_per_worker(skip, self.dataset.batches())
        self.dataset.rotate = skip % self.dataset.workers
        self._epoch, self._position = epoch, skip
        for batch in super().__iter__():
            self._position += 1
            yield batch

    def _layout(self) -> dict[str, int]:
        ds = self.dataset
        return {"ranks": ds.world, "workers": ds.workers, "batch_size": ds.batch_size, "epoch_samples": sum(ds.counts)}

    def state_dict(self) -> dict[str, Any]:
        """Epoch, batches and samples this rank took so far in it (the same on every rank), the epoch's batches and
        the layout they were taken with."""
        done = consumed_per_worker(self._position, self.dataset.batches())
        samples = 0
        for worker, batches in enumerate(done):
            start, stop = worker_range(self.dataset.per_rank, self.dataset.batch_size, self.dataset.workers, worker)
            samples += min(batches * self.dataset.batch_size, stop - start)
        position = {"epoch": self._epoch, "batches": self._position, "samples": samples, "epoch_batches": len(self)}
        return {**position, **self._layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue epoch ``state["epoch"]`` after its first ``state["batches"]`` batches. A position at an epoch's
        end (or start) resumes under any layout: the next epoch starts from its beginning."""
        if not 0 < state["batches"] < state["epoch_batches"]:
            return
        saved = {k: state.get(k) for k in self._layout()}
        if saved != self._layout():
            raise ValueError(
                f"the checkpoint's stream position, mid-epoch, was taken with {saved}, this run has {self._layout()}:"
                " resume mid-epoch with the same --trainer.devices, --data.num_workers, --data.batch_size and shards,"
                " or resume from an end-of-epoch checkpoint"
            )
        self._resume = (state["epoch"], state["batches"])
