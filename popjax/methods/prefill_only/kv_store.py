"""Calibrated KV projections on disk (orbax arrays + a JSON record).

Layout of one calibration directory::

    arrays/               orbax StandardCheckpointer tree {"weights": {"<layer>": [2·kv_dim, d]},
                          "biases": {"<layer>": [2·kv_dim]} (models with a qkv bias)}
    kv_calibration.json   {"key": what it was fitted for, "skip", "fit", "checksum" of the arrays}

`calibrate_kv` keeps its results as `popjax.cache` entries of kind "kv_calibration" (made
atomically, checksummed, verified on read, listed and cleared by ``popjax cache``), one per
(model, method, skip set, corpus, ridge, settings): every part of the key is in the entry's
hash, so another skip set is another entry and never read by mistake; a corrupt entry is
refitted with a one-line warning. `save_kv_calibration` / `load_kv_calibration` move a
calibration anywhere (e.g. next to the converted model); loading one explicitly for another
skip set or model is an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .kv_calibration import KVCalibration, KVCalibrationError, resolve_skip
from ...cache import cache_root, entry_key
from ...calibration import made_once, model_fingerprint

log = logging.getLogger(__name__)

FORMAT = 1
RECORD = "kv_calibration.json"
KIND = "kv_calibration"  # the popjax.cache kind of calibrate_kv's entries


def entry_name(key: dict[str, Any]) -> str:
    """The readable part of the cache entry's name for ``key`` (the hash of the whole key follows)."""
    skip, corpus = key["skip"], key["corpus"]
    return f"{key['method']}-skip{len(skip)}of{key['n_layers']}-{corpus['name']}-{corpus['tokens']}x{corpus['window']}"


def cache_path(key: dict[str, Any], cache_dir: str | Path | None = None) -> Path:
    """The cache entry where `calibrate_kv` keeps the calibration for ``key`` (``cache_dir``:
    the cache root, default `popjax.cache.cache_root()`)."""
    return (Path(cache_dir) if cache_dir is not None else cache_root()) / KIND / entry_key(key, entry_name(key))


def _arrays(cal: KVCalibration) -> dict[str, dict[str, np.ndarray]]:
    tree = {"weights": {str(l): np.asarray(w, np.float32) for l, w in cal.weights.items()}}
    if cal.biases:
        tree["biases"] = {str(l): np.asarray(b, np.float32) for l, b in cal.biases.items()}
    return tree


def _checksum(tree: dict[str, dict[str, np.ndarray]]) -> str:
    h = hashlib.sha256()
    for group in sorted(tree):
        for name in sorted(tree[group], key=int):
            a = np.ascontiguousarray(tree[group][name])
            h.update(f"{group}/{name}:{a.dtype}:{a.shape}".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def write_into(directory: Path, cal: KVCalibration) -> None:
    """Writes ``cal`` into the existing empty ``directory`` (not atomic by itself: the caller
    renames it into place)."""
    import orbax.checkpoint as ocp  # heavy: orbax (and its tensorstore) only when writing

    directory = Path(directory).resolve()  # orbax wants absolute paths
    tree = _arrays(cal)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / "arrays", tree)
    checkpointer.wait_until_finished()
    record = {"key": cal.key, "skip": list(cal.skip), "fit": cal.fit, "checksum": _checksum(tree)}
    (directory / RECORD).write_text(json.dumps(record, indent=1))


def write(path: Path, cal: KVCalibration) -> Path:
    """Writes ``cal`` to the new directory ``path`` atomically (a sibling temp directory renamed
    into place). If another process wrote it first, theirs is kept."""
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        write_into(tmp, cal)
        os.rename(tmp, path)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / RECORD).is_file():
            raise
        log.info("%s was written concurrently (%s); keeping that copy", path, err)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _load(path: Path) -> KVCalibration:
    """Reads and verifies a calibration directory (KVCalibrationError if corrupt)."""
    import orbax.checkpoint as ocp  # heavy: orbax (and its tensorstore) only when reading

    path = Path(path)
    if not (path / RECORD).is_file():
        raise FileNotFoundError(f"{path} is not a KV calibration directory (no {RECORD})")
    try:
        record = json.loads((path / RECORD).read_text())
        tree = ocp.StandardCheckpointer().restore((path / "arrays").resolve())
        tree = {g: {n: np.asarray(a) for n, a in arrays.items()} for g, arrays in tree.items()}
    except Exception as err:  # truncated JSON, missing or damaged orbax files: all mean corrupt
        raise KVCalibrationError(f"KV calibration {path} is unreadable ({err})") from None
    if record.get("checksum") != _checksum(tree):
        raise KVCalibrationError(f"KV calibration {path} fails its checksum (corrupt); fit it again")
    skip = tuple(record["skip"])
    if sorted(int(n) for n in tree["weights"]) != list(skip):
        raise KVCalibrationError(f"KV calibration {path} holds layers {sorted(map(int, tree['weights']))}, its record says {list(skip)}")
    return KVCalibration(
        skip=skip,
        weights={int(n): a for n, a in tree["weights"].items()},
        biases={int(n): a for n, a in tree.get("biases", {}).items()},
        key=record["key"],
        fit=record["fit"],
    )


def cached(
    key: dict[str, Any], fit: Callable[[], KVCalibration], cache_dir: str | Path | None = None
) -> tuple[KVCalibration, Path]:
    """The calibration for ``key`` from its cache entry, or ``fit()`` (it must return one made
    for ``key``) kept as a new entry -> (calibration, entry). ``cache_dir``: the cache root."""
    return made_once(KIND, key, fit, write_into, _load, name=entry_name(key), root=cache_dir)


def save_kv_calibration(cal: KVCalibration, path: str | Path) -> Path:
    """Saves ``cal`` into the new directory ``path`` (FileExistsError if it exists)."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} already exists; choose a new directory or remove it")
    return write(path, cal)


def load_kv_calibration(path: str | Path, skip=None, model=None) -> KVCalibration:
    """Loads a saved calibration, checked against what the caller means to use it for.

    Args:
      skip: the skip set it must have been fitted for (as ``PrefillOnly(skip=...)`` takes it;
        None = no check). Another skip set is an error: projections fitted for one skip set map
        another set's residual stream wrongly.
      model: a loaded model it must have been fitted for (None = no check).
    """
    cal = _load(Path(path))
    if skip is not None:
        want = resolve_skip(skip, int(cal.key["n_layers"]))
        if want != cal.skip:
            raise KVCalibrationError(
                f"KV calibration {path} was fitted for skipped layers {list(cal.skip)}, not skip={skip!r} "
                f"(layers {list(want)}); fit one for this skip set with calibrate_kv(model, skip={skip!r})"
            )
    if model is not None:
        if model.config.num_hidden_layers != cal.key["n_layers"]:
            raise KVCalibrationError(
                f"KV calibration {path} is for a {cal.key['n_layers']}-layer model; this one has {model.config.num_hidden_layers}"
            )
        fingerprint = model_fingerprint(model)
        if fingerprint != cal.key["model"]:
            raise KVCalibrationError(
                f"KV calibration {path} was fitted for model {cal.key['model'][:16]}…, not this one ({fingerprint[:16]}…)"
            )
    return cal


__all__ = ["FORMAT", "cache_path", "cached", "load_kv_calibration", "save_kv_calibration", "write", "write_into"]
