"""The cache's entries: keys, atomic making under a lock, verification on read, and the sweep
of what a dead process left (the layout and the guarantees: `popjax.cache`)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

try:
    import fcntl
except ImportError:  # Windows: no flock; the atomic rename alone keeps entries whole
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__.rpartition(".")[0])  # the package's: one logger for the cache

RECORD = "entry.json"
FORMAT = 1
FULL_VERIFY_MAX_BYTES = 64 << 20
STALE_AFTER = timedelta(hours=24)
Verify = Literal["auto", "full", "manifest", "none"] | bool  # True = "auto", False = "none"
_KIND = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
# .<key>.tmp-<pid>-<random>; no pid in the mkdtemp debris of older popjax (.<name>.tmp-XXXX): swept by age
_TMP = re.compile(r"\.(?P<key>.+)\.tmp-(?:(?P<pid>\d+)-)?[A-Za-z0-9_]+")


class CacheError(ValueError):
    """A misuse of the cache, or no cache where one is needed (one line, printable by the CLI)."""


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


# ---------------------------------------------------------------- internals


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
