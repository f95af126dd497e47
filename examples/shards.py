"""Write tar shards for the streaming datamodules: ``python -m examples.shards write-shards SRC DEST``.

``write-shards SRC DEST --samples-per-shard N``: an ImageFolder tree (``SRC/{train,val}/<class>/*.jpg``) to
``DEST/{train,val}-NNNNNN.tar`` + ``DEST/index.json``; DEST is a folder or an fsspec URL (``s3://bucket/set``).
``index ROOT``: count the samples of shards written elsewhere (``ROOT/{train,val}-*.tar``) into ``ROOT/index.json``.
Then ``python examples/classification.py fit --data=ShardImageDataModule --data.root=DEST``.
"""

from __future__ import annotations

import argparse

from examples.models.shard_writer import index_shards, write_imagefolder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.shards", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write-shards", help="ImageFolder tree -> tar shards + index.json")
    write.add_argument("src", help="ImageFolder root: SRC/{train,val}/<class>/*")
    write.add_argument("dest", help="folder or fsspec URL for the shards")
    write.add_argument("--samples-per-shard", type=int, default=1000)
    index = commands.add_parser("index", help="write index.json for existing ROOT/{train,val}-*.tar")
    index.add_argument("root")
    args = parser.parse_args(argv)
    if args.command == "write-shards":
        counts = write_imagefolder(args.src, args.dest, args.samples_per_shard)
    else:
        counts = index_shards(args.root)
    print(", ".join(f"{split}: {n} samples" for split, n in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
