"""Calibrated KV projections on disk (orbax arrays + a JSON record), written atomically.

Layout of one calibration directory::

    arrays/               orbax StandardCheckpointer tree {"weights": {"<layer>": [2·kv_dim, d]},
                          "biases": {"<layer>": [2·kv_dim]} (models with a qkv bias)}
    kv_calibration.json   {"key": what it was fitted for, "skip", "fit", "checksum" of the arrays}

`calibrate_kv` keeps its results under ``cache_root()/kv_calibration/<model fingerprint>/``,
one directory per (method, skip set, corpus, ridge, settings) — every part of the key is in the
name's hash, so another skip set is another directory and never read by mistake. A cached
directory that is corrupt or was made for another key is refitted (with a warning).
`save_kv_calibration` / `load_kv_calibration` move a calibration anywhere (e.g. next to the
converted model); loading one explicitly for another skip set or model is an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .kv_calibration import KVCalibration, KVCalibrationError, resolve_skip

log = logging.getLogger(__name__)

FORMAT = 1
RECORD = "kv_calibration.json"


def _digest(obj: Any, n: int = 12) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:n]


def cache_path(key: dict[str, Any], cache_dir: str | Path | None = None) -> Path:
    """Where `calibrate_kv` keeps the calibration for ``key``."""
    from .convert.store import cache_root

    root = Path(cache_dir) if cache_dir is not None else cache_root() / "kv_calibration"
    skip, corpus = key["skip"], key["corpus"]
    name = (f"{key['method']}-skip{len(skip)}of{key['n_layers']}-{_digest(skip, 8)}-{corpus['name']}-"
            f"{corpus['tokens']}x{corpus['window']}-{_digest(key)}")
    return root / key["model"][:24] / name


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


def write(path: Path, cal: KVCalibration) -> Path:
    """Writes ``cal`` to the new directory ``path`` atomically (a sibling temp directory renamed
    into place). If another process wrote it first, theirs is kept."""
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tree = _arrays(cal)
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp / "arrays", tree)
        checkpointer.wait_until_finished()
        record = {"key": cal.key, "skip": list(cal.skip), "fit": cal.fit, "checksum": _checksum(tree)}
        (tmp / RECORD).write_text(json.dumps(record, indent=1))
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
    import orbax.checkpoint as ocp

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


def read(path: Path, expected_key: dict[str, Any]) -> KVCalibration | None:
    """A cached calibration if intact and made for ``expected_key``; None (with a warning) otherwise."""
    try:
        cal = _load(path)
    except (KVCalibrationError, FileNotFoundError) as err:
        log.warning("%s; fitting again", err)
        shutil.rmtree(path, ignore_errors=True)
        return None
    if _digest(cal.key, 64) != _digest(json.loads(json.dumps(expected_key)), 64):
        log.warning("KV calibration %s was made for another model/skip set/corpus; fitting again", path)
        shutil.rmtree(path, ignore_errors=True)
        return None
    return cal


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
    from .calibration import model_fingerprint
    from .kv_calibration import without_prefill_kv

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
        fingerprint = model_fingerprint(without_prefill_kv(model))
        if fingerprint != cal.key["model"]:
            raise KVCalibrationError(
                f"KV calibration {path} was fitted for model {cal.key['model'][:16]}…, not this one ({fingerprint[:16]}…)"
            )
    return cal


__all__ = ["FORMAT", "cache_path", "load_kv_calibration", "read", "save_kv_calibration", "write"]
