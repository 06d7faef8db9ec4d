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

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal

try:
    import fcntl
except ImportError:  # Windows: no flock; the atomic rename alone keeps entries whole
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

RECORD = "entry.json"
FORMAT = 1
FULL_VERIFY_MAX_BYTES = 64 << 20
STALE_AFTER = timedelta(hours=24)
Verify = Literal["auto", "full", "manifest", "none"] | bool  # True = "auto", False = "none"
_KIND = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
# .<key>.tmp-<pid>-<random>; no pid in the mkdtemp debris of older popjax (.<name>.tmp-XXXX): swept by age
_TMP = re.compile(r"\.(?P<key>.+)\.tmp-(?:(?P<pid>\d+)-)?[A-Za-z0-9_]+")
_AGE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([mhdw])\s*")
_UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


class CacheError(ValueError):
    """A misuse of the cache, or no cache where one is needed (one line, printable by the CLI)."""


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


def cache_root() -> Path:
    """Root of popjax's caches: $POPJAX_CACHE, else ~/.cache/popjax."""
    return Path(os.environ.get("POPJAX_CACHE") or Path.home() / ".cache" / "popjax").expanduser()


def entry_key(key_fields: dict[str, Any], name: str | None = None) -> str:
    """An entry's directory name, ``<name>-<16 hex>``: the hash decides, the name is for people."""
    digest = hashlib.sha256(json.dumps(_normalize(key_fields), sort_keys=True).encode()).hexdigest()[:16]
    safe = re.sub(r"[^A-Za-z0-9_.+-]+", "_", name or "").lstrip("._+-")[:80]
    return f"{safe}-{digest}" if safe else digest


def lookup(
    kind: str, key_fields: dict[str, Any], *, name: str | None = None, root: str | Path | None = None,
    verify: Verify = "auto",
) -> Path | None:
    """The path of a valid entry, else None (with a warning when one is there but invalid)."""
    fields = _normalize(key_fields)
    path = _kind_dir(kind, root) / entry_key(fields, name)
    why = _problem(path, fields, verify) if os.path.lexists(path) else "missing"
    if why not in (None, "missing"):
        log.warning("popjax cache: %s %s; ignoring it", path, why)
    return path if why is None else None


def get_or_make(
    kind: str, key_fields: dict[str, Any], make: Callable[[Path], None], *, name: str | None = None,
    root: str | Path | None = None, verify: Verify = "auto",
) -> Path:
    """The path of the entry for ``key_fields``, made by ``make(empty_dir)`` if missing or invalid.

    ``make`` writes the payload into the directory it gets (any names but entry.json); then the
    record is written and the directory renamed into place. An invalid entry is removed and made
    again, with one warning. An exception from ``make`` propagates and leaves nothing behind."""
    fields = _normalize(key_fields)
    kind_dir = _kind_dir(kind, root)
    key = entry_key(fields, name)
    path = kind_dir / key
    if os.path.lexists(path) and _problem(path, fields, verify) is None:  # no lock, no warning
        _sweep(kind_dir)
        return path
    kind_dir.mkdir(parents=True, exist_ok=True)
    with _locked(kind_dir, key) as locked:
        _sweep(kind_dir, held_key=key if locked else None)
        if os.path.lexists(path):  # again under the lock: the process we waited for made it
            why = _problem(path, fields, verify)
            if why is None:
                return path
            log.warning("popjax cache: %s %s; removing it and making it again", path, why)
            _discard(path)
        tmp = kind_dir / f".{key}.tmp-{os.getpid()}-{secrets.token_hex(6)}"
        os.mkdir(tmp)  # umask permissions: mkdtemp's 0700 would hide a shared cache from its other users
        try:
            make(tmp)
            _write_record(tmp, kind, key, fields)
            try:
                os.rename(tmp, path)
            except OSError:  # ENOTEMPTY/EEXIST: a process that could not lock renamed first
                if _problem(path, fields, verify) is not None:
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
                return path
            _fsync(kind_dir)  # the rename itself durable
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return path


def check_entry(path: str | Path, verify: Verify = "full") -> str | None:
    """What is wrong with the entry at ``path`` (e.g. "fails its checksum"), None if intact."""
    return _problem(Path(path), None, verify)


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


# ---------------------------------------------------------------- internals


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


def _normalize(key_fields: dict[str, Any]) -> dict[str, Any]:
    """The key fields as they read back from JSON (tuples become lists), so records compare equal."""
    if not isinstance(key_fields, dict):
        raise CacheError(f"cache key fields must be a dict, got {type(key_fields).__name__}")
    try:
        return json.loads(json.dumps(key_fields, sort_keys=True, allow_nan=False))
    except (TypeError, ValueError) as err:  # silently str()-ing an object would make keys lie
        raise CacheError(f"cache key fields must be plain JSON (str, int, finite float, bool, None): {err}") from None


def _kind_dir(kind: str, root: str | Path | None) -> Path:
    if not isinstance(kind, str) or not _KIND.fullmatch(kind):
        raise CacheError(f"cache kind {kind!r} must be a plain name (letters, digits, _ . + -)")
    return (Path(root) if root is not None else cache_root()) / kind


def _subdirs(directory: Path) -> list[Path]:
    with os.scandir(directory) as it:  # d_type: no stat per file (the jax compile cache is large)
        return [Path(e.path) for e in it if not e.name.startswith(".") and e.is_dir()]


def _payload(directory: Path) -> list[tuple[str, Path]]:
    found = ((Path(d, f).relative_to(directory).as_posix(), Path(d, f)) for d, _, fs in os.walk(directory) for f in fs)
    return sorted(item for item in found if item[0] != RECORD)


def _digest(directory: Path, sync: bool = False) -> tuple[str, list[list[Any]]]:
    """(sha256 over each payload file's path, size and bytes, read 1 MiB at a time; manifest)."""
    h, manifest, buf = hashlib.sha256(), [], bytearray(1 << 20)
    for rel, path in _payload(directory):
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            h.update(f"{rel}\0{st.st_size}\0".encode())
            while n := fh.readinto(buf):
                h.update(memoryview(buf)[:n])
            if sync:  # durable before the rename publishes it (fsync works on a read-only fd)
                _fsync(fh.fileno())
        manifest.append([rel, st.st_size, st.st_mtime_ns])
    return "sha256:" + h.hexdigest(), manifest


def _write_record(tmp: Path, kind: str, key: str, fields: dict[str, Any]) -> None:
    if os.path.lexists(tmp / RECORD):
        raise CacheError(f"make() wrote {RECORD} in {tmp}; that name is the cache's own record")
    checksum, manifest = _digest(tmp, sync=True)
    from importlib import metadata  # not popjax.__version__: this module imports nothing of popjax

    try:
        version = metadata.version("popjax")
    except metadata.PackageNotFoundError:
        version = "unknown"
    record = {"format": FORMAT, "kind": kind, "name": key, "key": fields, "created": time.time(),
              "popjax_version": version, "size": sum(m[1] for m in manifest), "checksum": checksum, "files": manifest}
    (tmp / RECORD).write_text(json.dumps(record, indent=1))
    _fsync(tmp / RECORD)


def _problem(path: Path, fields: dict[str, Any] | None, verify: Verify) -> str | None:
    """Why the entry at ``path`` is not usable for ``fields`` (None: it is)."""
    try:
        record = json.loads((path / RECORD).read_text())
        files = {rel: (int(size), int(mtime)) for rel, size, mtime in record["files"]}
    except FileNotFoundError:
        return f"has no {RECORD}"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"has an unreadable {RECORD} ({type(err).__name__}: {err})"
    if record.get("format") != FORMAT:
        return f"is in cache format {record.get('format')!r}, not {FORMAT}"
    if fields is not None and record.get("key") != fields:
        return "was made for other key fields"
    level = {True: "auto", False: "none"}.get(verify, verify)  # type: ignore[call-overload]
    if level == "auto":
        level = "full" if sum(s for s, _ in files.values()) <= FULL_VERIFY_MAX_BYTES else "manifest"
    if level == "none":
        return None
    touched = []
    try:
        if level == "manifest":
            found = dict(_payload(path))
            for rel in sorted(set(files) ^ set(found)):
                return f"is missing {rel}" if rel in files else f"has an unrecorded file {rel}"
            for rel, file in found.items():
                st = file.stat()
                if st.st_size != files[rel][0]:
                    return f"has {rel} of {st.st_size} bytes, {files[rel][0]} recorded (truncated?)"
                if st.st_mtime_ns != files[rel][1]:
                    touched.append((file, st.st_atime_ns, files[rel][1]))
            if not touched:
                return None
        checksum, _ = _digest(path)
    except OSError as err:
        return f"cannot be read ({err})"
    if checksum != record.get("checksum"):
        return "fails its checksum (corrupt)"
    for file, atime, mtime in touched:  # content proven intact: the next manifest check is cheap again
        with contextlib.suppress(OSError):
            os.utime(file, ns=(atime, mtime))
    return None


@contextlib.contextmanager
def _locked(kind_dir: Path, key: str) -> Iterator[bool]:
    """Holds ``.<key>.lock`` (yields True), or yields False where flock is unavailable."""
    lock, fd = kind_dir / f".{key}.lock", None
    for _ in range(100 if fcntl is not None else 0):  # more than once only if `clear` unlinks it
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o666)  # read-only: locks another user's file too
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("popjax cache: waiting for another process making %s", kind_dir / key)
                fcntl.flock(fd, fcntl.LOCK_EX)
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                break
            raise FileNotFoundError(lock)  # we hold an unlinked inode: lock the new file
        except OSError as err:  # not FileNotFoundError: ENOLCK, EROFS, ...: the rename still decides
            if fd is not None:
                os.close(fd)
                fd = None
            if not isinstance(err, FileNotFoundError):
                break
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)  # releases the flock, as the kernel does for a killed process


def _held(lock: Path) -> bool | None:
    """Whether someone holds ``lock``; None when that cannot be told (no file, no flock)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError as err:
        return True if isinstance(err, BlockingIOError) else None
    finally:
        os.close(fd)


def _fsync(target: Path | int) -> None:
    """fsync of an open fd, or of a file or directory by path (skipped where unsupported)."""
    with contextlib.suppress(OSError):
        fd = target if isinstance(target, int) else os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            if fd is not target:
                os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as err:
        return err.errno != errno.ESRCH  # EPERM: alive, someone else's
    return True


def _sweep(kind_dir: Path, held_key: str | None = None, locks: bool = False) -> int:
    """Removes the temp dirs of builders that are gone (``held_key``: a key whose lock the caller
    holds before making its own temp dir, so all of that key's are debris); with ``locks`` also
    the lock files no one holds. -> bytes freed."""
    try:
        names = os.listdir(kind_dir)
    except OSError:
        return 0
    freed = 0
    for name in names:
        match = _TMP.fullmatch(name)
        if match is not None:
            path, lock = kind_dir / name, kind_dir / f".{match['key']}.lock"
            held = False if match["key"] == held_key else _held(lock) if fcntl is not None else None
            if held is None:  # no usable lock: judge by pid (this host) and age (other hosts)
                with contextlib.suppress(OSError):
                    young = time.time() - path.lstat().st_mtime < STALE_AFTER.total_seconds()
                    held = young and (match["pid"] is None or _alive(int(match["pid"])))
            if held is False:
                freed += _discard(path, rename=False) or 0
        elif locks and fcntl is not None and name.startswith(".") and name.endswith(".lock"):
            with contextlib.suppress(OSError):  # BlockingIOError: in use, kept
                fd = os.open(kind_dir / name, os.O_RDONLY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    os.unlink(kind_dir / name)  # a waiter on this inode sees it and relocks (_locked)
                finally:
                    os.close(fd)
    return freed


def _du(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(path) for f in fs)


def _discard(path: Path, rename: bool = True) -> int | None:
    """Deletes ``path`` -> bytes freed (None: already gone). An entry is first renamed to a temp
    name, so it vanishes at once and a sweep finishes the job if this process dies midway."""
    try:
        if rename:
            trash = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
            os.rename(path, trash)
            path = trash
        size = _du(path)
    except FileNotFoundError:
        return None
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    return size
