"""Converted checkpoints on disk (orbax params + config.json + tokenizer).

Layout of a converted directory::

    popjax.json   marker: format version, source, dtype
    config.json   allow-listed HF config fields
    params/       orbax StandardCheckpointer tree of numpy arrays, in the fused layout the
                  modules read (convert/fused.py), so a mesh restores each tensor into its sharding
    tokenizer/    transformers tokenizer files (when the source had one)

`write_into` fills an empty directory: `popjax.load` calls it inside ``popjax.cache.get_or_make``
(kind "converted": the cache makes the entry atomically, checksums it and sweeps what a killed
conversion left), `write_converted` for an explicit destination (``popjax convert``), with its
own temp directory renamed into place when complete.
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

import jax

from .. import distributed
from ..models.config import ModelConfig
from .fused import fuse_checkpoint

log = logging.getLogger(__name__)
# 2: HF [out, in] layout; 3: fused q/k/v and gate/up rows; 4: gate/up stacked [2, f, d];
# 5: q/k/v grouped by KV head [n_kv, g + 2, h, d] (convert/fused.py)
FORMAT_VERSION = 5
MARKER = "popjax.json"


def source_key(paths: list[Path], dtype: str) -> str:
    """Key of a source: resolved paths, sizes and mtimes of its files, dtype and format version."""
    h = hashlib.sha256(f"v{FORMAT_VERSION}:{dtype}".encode())
    for path in sorted(p.resolve() for p in paths):
        stat = path.stat()
        h.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def is_converted(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def write_into(
    directory: Path,
    cfg: ModelConfig,
    params: dict[str, Any],
    save_tokenizer: Callable[[Path], bool],
    meta: dict[str, Any],
) -> None:
    """Writes a converted checkpoint into the existing empty ``directory``: params, config.json,
    tokenizer, then the marker. ``params`` is in the HF layout (q/k/v and gate/up apart); it is
    stored fused (convert/fused.py). Not atomic by itself: the caller renames ``directory``."""
    import orbax.checkpoint as ocp  # heavy: orbax (and its tensorstore) only when writing

    directory = Path(directory)
    checkpointer = ocp.StandardCheckpointer(multiprocessing_options=_this_process_only(ocp))
    checkpointer.save(directory.resolve() / "params", fuse_checkpoint(cfg, params))
    checkpointer.wait_until_finished()
    (directory / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1))
    has_tokenizer = save_tokenizer(directory / "tokenizer")
    marker = dict(meta, format_version=FORMAT_VERSION, tokenizer=has_tokenizer)
    (directory / MARKER).write_text(json.dumps(marker, indent=1))


def _this_process_only(ocp):
    """Orbax's options for a save by this process alone. In a multi-host run orbax would
    otherwise make the save collective (every process waiting at its barriers), but a
    conversion is process 0 filling one directory while the others wait for it (`popjax.load`).
    Orbax writes NumPy leaves on process 0 only, so any other process refuses to write."""
    if not distributed.is_initialized():
        return ocp.options.MultiprocessingOptions()
    if jax.process_index() != 0:
        raise ValueError(f"process {jax.process_index()} of a multi-host run cannot write a converted checkpoint "
                         "(orbax writes host arrays from process 0 only); convert on process 0, or before the run "
                         "with `popjax convert SOURCE DIR` on each host")
    return ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0}, barrier_sync_key_prefix="popjax-convert")


def write_converted(
    destination: Path,
    cfg: ModelConfig,
    params: dict[str, Any],
    save_tokenizer: Callable[[Path], bool],
    meta: dict[str, Any],
) -> None:
    """Writes a converted checkpoint (`write_into`) to the new directory ``destination``
    atomically: into a sibling temp directory, renamed to ``destination`` when complete."""
    destination = Path(destination).resolve()
    if destination.exists():
        raise FileExistsError(f"{destination} already exists; choose a new destination or remove it")
    destination.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp-", dir=destination.parent))
    try:
        write_into(tmp, cfg, params, save_tokenizer, meta)
        try:
            os.rename(tmp, destination)
        except OSError:
            if destination.exists():  # another process wrote the same destination first
                raise FileExistsError(f"{destination} already exists (written concurrently)") from None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_converted(
    directory: Path, sharding_of: Callable[[str, tuple[int, ...]], Any] | None = None
) -> tuple[ModelConfig, dict[str, Any], dict[str, Any]]:
    """-> (config, params as a nested dict in the fused layout, marker metadata).

    Without ``sharding_of`` the params are host (NumPy) arrays. With it, ``sharding_of(name,
    shape)`` (``name`` dotted, e.g. ``layers.0.mlp.gate_up``) gives each tensor's sharding and
    orbax restores it straight into that sharding: each device reads only its own block."""
    import jax  # heavy: jax and orbax only when a checkpoint is read
    import orbax.checkpoint as ocp  # heavy: see above

    meta = json.loads((directory / MARKER).read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{directory} has popjax format {meta.get('format_version')}, this popjax reads "
            f"{FORMAT_VERSION}; convert the source again"
        )
    cfg = ModelConfig.from_json(directory / "config.json")
    path = (directory / "params").resolve()
    checkpointer = ocp.StandardCheckpointer()
    target = None
    if sharding_of is not None:
        stored = checkpointer.metadata(path).item_metadata
        target = jax.tree_util.tree_map_with_path(
            lambda keys, m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding_of(dotted(keys), tuple(m.shape))),
            stored.tree if hasattr(stored, "tree") else stored,
        )
    return cfg, checkpointer.restore(path, target), meta


def dotted(keys) -> str:
    """A pytree key path -> ``layers.0.mlp.gate_up``."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)
