"""One keyed, atomic, checksummed on-disk cache for everything popjax computes once.

Layout under ``cache_root()`` ($POPJAX_CACHE, else ~/.cache/popjax)::

    <kind>/                          "converted", "calibration", "kv_calibration", "lowrank", ...
        <key>/                       an entry, ``<name>-<16 hex of sha256(key fields)>``:
            ...payload...            what ``make(directory)`` wrote (any files, any depth)
            entry.json               written last: format, kind, key fields, created (unix time),
                                     popjax version, size, checksum, files [[path, size, mtime_ns]]
        .<key>.lock                  advisory flock, held while a process makes <key>
        .<key>.tmp-<pid>-<random>/   an entry being made (or deleted)

``checksum``: a streaming sha256 over the payload files in sorted relative-path order (path,
size, bytes). Verification on read (``verify=``): ``"full"`` re-hashes; ``"manifest"`` checks that
exactly the recorded files exist with their sizes and re-hashes only if an mtime changed (then
puts the recorded mtimes back, so a copied cache pays once); ``"none"`` checks record and key
only. The default ``"auto"`` is "full" up to ``FULL_VERIFY_MAX_BYTES`` (64 MiB, ~0.1 s:
statistics, KV fits) and "manifest" above (converted checkpoints: hashed when made, not on each
load). Sound because an entry appears only by a rename after its files are fsynced and its
record written, so a killed writer leaves none; what is left to catch is truncation or loss (a
full disk, a partial copy: sizes), edits (mtimes, then the hash) and silent bit rot of a large
entry, which only a full hash finds: `check_entry` (``popjax cache verify``).

Concurrency: the lock makes a second process wait for the first rather than make the entry
twice; without flock (some network filesystems) both make it, one rename wins and the other
returns the winner's entry. A temp dir is debris when its key's lock file exists and no one
holds it (the kernel drops a dead process's flock), or, with no usable lock, when its pid is
dead here or it is older than ``STALE_AFTER`` (another host's). `get_or_make` sweeps its kind's
debris (one listdir), and so does `clear`. Only entries (directories with an entry.json) are
listed or cleared: files of older popjax layouts, the jax compile cache etc. are left alone.
"""

from .entries import (
    FORMAT,
    FULL_VERIFY_MAX_BYTES,
    RECORD,
    STALE_AFTER,
    CacheError,
    Verify,
    cache_root,
    check_entry,
    entry_key,
    get_or_make,
    log,
    lookup,
)
from .listing import EntryInfo, clear, format_entries, human_size, list_entries, parse_age

__all__ = [
    "FORMAT", "FULL_VERIFY_MAX_BYTES", "RECORD", "STALE_AFTER", "CacheError", "EntryInfo", "Verify", "cache_root",
    "check_entry", "clear", "entry_key", "format_entries", "get_or_make", "human_size", "list_entries", "lookup",
    "parse_age",
]
