"""``popjax cache list`` and ``popjax cache clear``: the entries on disk, their sizes and what
made them; removal by kind and age, with the debris of dead processes."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from .entries import RECORD, CacheError, _discard, _du, _subdirs, _sweep, cache_root

_AGE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([mhdw])\s*")
_UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


@dataclasses.dataclass(frozen=True)
class EntryInfo:
    kind: str
    key: str
    path: Path
    size: int  # payload bytes
    created: datetime  # UTC
    key_fields: dict[str, Any] | None  # None: the record is unreadable
    popjax_version: str | None = None

    @property
    def age(self) -> timedelta:
        return datetime.now(timezone.utc) - self.created


def list_entries(root: str | Path | None = None) -> list[EntryInfo]:
    """Every entry under ``root`` (default `cache_root()`) by kind and key; [] if there is none."""
    base = Path(root) if root is not None else cache_root()
    out = []
    for kind_dir in sorted(_subdirs(base)) if base.is_dir() else []:
        for path in sorted(_subdirs(kind_dir)):
            if not (path / RECORD).is_file():
                continue  # not an entry (an older layout, a download, ...)
            try:
                r = json.loads((path / RECORD).read_text())
                created = datetime.fromtimestamp(float(r["created"]), timezone.utc)
                version = r.get("popjax_version")
                info = EntryInfo(kind_dir.name, path.name, path, int(r["size"]), created, r["key"], version)
            except (OSError, ValueError, KeyError, TypeError):
                try:
                    created = datetime.fromtimestamp((path / RECORD).stat().st_mtime, timezone.utc)
                    info = EntryInfo(kind_dir.name, path.name, path, _du(path), created, None)
                except OSError:  # removed meanwhile
                    continue
            out.append(info)
    return out


def clear(
    kinds: Iterable[str] | None = None, older_than: timedelta | None = None, root: str | Path | None = None
) -> tuple[int, int]:
    """Removes the entries of ``kinds`` (default all) made more than ``older_than`` ago (default:
    any), and the debris of those kinds (dead temp dirs, lock files no one holds).
    -> (entries removed, bytes freed, debris included). CacheError when there is no cache."""
    base = Path(root) if root is not None else cache_root()
    if not base.is_dir():
        raise CacheError(f"no popjax cache at {base} (set POPJAX_CACHE or run a command that fills it)")
    wanted = None if kinds is None else {kinds} if isinstance(kinds, str) else set(kinds)
    cutoff = None if older_than is None else datetime.now(timezone.utc) - older_than
    removed = freed = 0
    for entry in list_entries(base):
        if (wanted is None or entry.kind in wanted) and (cutoff is None or entry.created <= cutoff):
            size = _discard(entry.path)
            removed, freed = removed + (size is not None), freed + (size or 0)
    for kind_dir in _subdirs(base):
        if wanted is None or kind_dir.name in wanted:
            freed += _sweep(kind_dir, locks=True)
    return removed, freed


def parse_age(text: str, option: str = "--older-than") -> timedelta:
    """``"30m"``, ``"12h"``, ``"7d"``, ``"2w"`` (decimals allowed) -> timedelta; ValueError otherwise."""
    match = _AGE.fullmatch(text) if isinstance(text, str) else None
    with contextlib.suppress(OverflowError):
        if match is not None:
            return timedelta(**{_UNITS[match[2]]: float(match[1])})
    raise ValueError(f"{option} {text!r} is not an age; use a number followed by m, h, d or w, e.g. 7d")


def format_entries(entries: list[EntryInfo]) -> str:
    """The ``popjax cache list`` table (kind, key, size, age, what made it), then a total line."""
    n = len(entries)
    total = f"total: {n} entr{'y' if n == 1 else 'ies'}, {human_size(sum(e.size for e in entries))}"
    rows = [("KIND", "KEY", "SIZE", "AGE", "MADE FROM")]
    rows += [(e.kind, e.key, human_size(e.size), _human_age(e.age), _summary(e.key_fields)) for e in entries]
    w = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [f"{a:<{w[0]}}  {b:<{w[1]}}  {c:>{w[2]}}  {d:>{w[3]}}  {e}".rstrip() for a, b, c, d, e in rows]
    return "\n".join([*lines, total]) if entries else total


def human_size(n: float) -> str:
    """1536 -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _human_age(age: timedelta) -> str:
    s = max(age.total_seconds(), 0)
    for unit, seconds, limit in (("m", 60, 120), ("h", 3600, 48), ("d", 86400, 14)):
        if s < seconds * limit:
            return f"{int(s // seconds)}{unit}"
    return f"{int(s // 604800)}w"


def _summary(fields: dict[str, Any] | None, width: int = 72) -> str:
    """``model=3f2a9c0d1e…, statistic.name=wanda_sp, ...``: nesting dotted, hashes shortened."""
    if fields is None:
        return "(unreadable record)"
    parts, todo = [], list(fields.items())
    while todo:
        k, v = todo.pop(0)
        if isinstance(v, dict) and v:
            todo[:0] = [(f"{k}.{k2}", v2) for k2, v2 in v.items()]
            continue
        text = v if isinstance(v, str) else json.dumps(v)
        parts.append(f"{k}={text[:10] + '…' if re.fullmatch(r'[0-9a-f]{20,}', text) else text}")
    line = ", ".join(parts)
    return line if len(line) <= width else line[: width - 1] + "…"
