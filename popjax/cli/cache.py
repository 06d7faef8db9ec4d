"""``popjax cache``: list or clear what popjax keeps on disk (converted checkpoints, calibrations,
KV fits, ...; the cache itself: `popjax.cache`)."""

from __future__ import annotations

import argparse

from ..cache import CacheError, cache_root, clear, format_entries, human_size, list_entries, parse_age


def register(sub) -> None:
    p = sub.add_parser("cache", help="list or clear popjax's on-disk cache ($POPJAX_CACHE, else ~/.cache/popjax)")
    actions = p.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="every entry: kind, key, size, age and what it was made from")
    listing.set_defaults(run=run_list)
    clearing = actions.add_parser("clear", help="remove entries (all, or those the options select) and leftover debris")
    clearing.add_argument("--older-than", default=None, metavar="AGE",
                          help="only entries created more than AGE ago: a number and m, h, d or w, e.g. 7d")
    clearing.add_argument("--kind", action="append", default=None,
                          help="only entries of this kind, e.g. converted or calibration (repeatable)")
    clearing.set_defaults(run=run_clear)


def run_list(args: argparse.Namespace) -> None:
    root = cache_root()
    print(f"popjax cache: {root}")
    print(format_entries(list_entries(root)))


def run_clear(args: argparse.Namespace) -> None:
    older_than = parse_age(args.older_than) if args.older_than is not None else None  # before touching anything
    root = cache_root()
    if args.kind and root.is_dir():  # a misspelt kind would silently remove nothing
        folders = {p.name for p in root.iterdir() if p.is_dir()}
        unknown = [kind for kind in args.kind if kind not in folders]
        if unknown:
            kinds = sorted({entry.kind for entry in list_entries(root)})
            raise CacheError(f"--kind {unknown[0]!r}: the cache at {root} has no such kind; "
                             f"its kinds: {', '.join(kinds) if kinds else 'none (it holds no entries)'}")
    removed, freed = clear(kinds=args.kind, older_than=older_than, root=root)
    print(f"removed {removed} entr{'y' if removed == 1 else 'ies'}, freed {human_size(freed)} from {root}")
