"""The calibration pipeline shared by every offline method (TEAL, CATS, Wanda-sp, FLAP).

* **Corpus** (`popjax.corpus`, re-exported here) — real text as token-id windows
  ``[n_windows, window]``: by default the Shakespeare works of ``popjax.data`` without
  ``HELD_OUT_PLAY`` and ``DEV_PLAY`` (`default_corpus`), or a user's text (`text_corpus`,
  `text_file_corpus`) or ids (`Corpus.from_token_ids`).
* **Collection** — `collect` runs the model's prefill over the corpus in batches with a
  `CollectorPlan`: at every layer's MLP the statistic's output (dense by default, so later
  layers see the dense model) plus its per-batch sums as aux (stacked ``[L, ...]``); the host
  adds batches in a fixed order in float64/int64, so a corpus gives bit-identical statistics.
* **Cache** — `calibrate` = `collect` once, kept as a `popjax.cache` entry of kind
  "calibration" (``cache_root()/calibration/<statistic>-v<version>-<corpus>-<hash>/arrays.npz``)
  keyed by the model (a hash of its config and every weight), the corpus (name, token count,
  window, a hash of the ids), the statistic (name, version, fields) and the batch size. Made
  atomically; key and checksum are verified on every read: a corrupt or mismatched entry is
  made again with a one-line warning, never used. `cached_arrays` does the same for any
  arrays (low-rank factors, ...).

A statistic is a frozen (hashable: it is part of a jit static argument) `Statistic`:

    @dataclasses.dataclass(frozen=True)
    class SumSquares(Statistic):
        name: ClassVar[str] = "sum_squares"
        def collect(self, w, x, valid, h):       # x [B, T, d], valid [B, T], h [B, T, f]
            hv = jnp.where(valid[..., None], h.astype(jnp.float32), 0.0)
            return {"sumsq": jnp.sum(hv * hv, axis=(0, 1)), "tokens": jnp.sum(valid)}

    sums = calibrate(model, SumSquares())        # {"sumsq": [L, f] float64, "tokens": [L] int64}

Override `Statistic.output` to collect under a pruned model (it sees ``w.layer``). Quantile
thresholds: `log_histogram` inside `collect`, `histogram_quantile` on the host.

**Mixture-of-experts models** (docs/moe.md): the statistic runs on every FFN block — each
routed expert over the calibration tokens the router sent to it (the engine narrows ``valid``),
each shared-expert or dense-layer block over all tokens — and `collect` returns
``{name: [L, slots, ...]}`` by block slot (`models.moe.MoEConfig.slots`: expert e is slot e,
always-active block b is slot E + b; slots without a block hold zeros).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import weakref
from pathlib import Path
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from . import distributed, engine
from .corpus import (  # noqa: F401  re-exported: the corpus is the calibration pipeline's input
    DEFAULT_TOKENS,
    DEFAULT_WINDOW,
    CalibrationError,
    Corpus,
    default_corpus,
    shakespeare_corpus,
    text_corpus,
    text_file_corpus,
)
from .cache import cache_root, entry_key, get_or_make, lookup
from .ffn import Plan, activations, down_proj, gate_activation

log = logging.getLogger(__name__)

DEFAULT_BATCH = 8
CACHE_FORMAT = 1


# ---------------------------------------------------------------- statistics and collection


@dataclasses.dataclass(frozen=True)
class Statistic:
    """What a calibration pass gathers at each layer's MLP. Subclasses set ``name``/``version``
    (bump the version whenever the computation changes: it is part of the cache key) and
    implement `collect`; dataclass fields are hyper-parameters, also part of the key."""

    name: ClassVar[str] = "statistic"
    version: ClassVar[int] = 1

    def collect(self, w: dict[str, jax.Array], x: jax.Array, valid: jax.Array, h: jax.Array) -> dict[str, jax.Array]:
        """x [B, T, d], valid [B, T] bool, h = H [B, T, f] -> {name: fixed-shape array} summed
        over this batch's valid tokens (float or integer; the host adds batches up)."""
        raise NotImplementedError  # pragma: no cover - interface

    def output(self, w: dict[str, jax.Array], x: jax.Array, valid: jax.Array, h: jax.Array) -> jax.Array:
        """The layer's MLP output during collection, [B, T, d]: dense by default."""
        return down_proj(h, w.down)

    def key(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "fields": repr(dataclasses.astuple(self))}


@dataclasses.dataclass(frozen=True)
class CollectorPlan(Plan):
    """A method plan that runs a `Statistic` at every layer's MLP (prefill only): the output of
    `Statistic.output`, the statistic's sums as aux. ``CollectorPlan(f, f, statistic)``."""

    statistic: Statistic | None = None

    def prefill(self, w, x, valid):
        h = activations(w.gate_up, x, gate_activation(w))
        return self.statistic.output(w, x, valid, h), None, self.statistic.collect(w, x, valid, h)


def collect(model, statistic: Statistic, corpus: Corpus, batch_size: int = DEFAULT_BATCH) -> dict[str, np.ndarray]:
    """Runs ``statistic`` over the corpus: -> {name: [L, ...]} summed over every token (float64
    for float statistics, int64 for integer ones; a MoE model's are [L, slots, ...], see the
    module docstring). Batches of ``batch_size`` windows, in order."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise CalibrationError(f"batch_size={batch_size!r} is invalid; use an integer ≥ 1")
    if corpus.windows.size == 0:
        raise CalibrationError(f"corpus {corpus.name!r} is empty")
    bad = corpus.windows[(corpus.windows < 0) | (corpus.windows >= model.config.vocab_size)]
    if bad.size:
        raise CalibrationError(f"corpus {corpus.name!r} holds token ids {bad[:5].tolist()} outside [0, {model.config.vocab_size})")
    f = model.config.intermediate_size
    plan = CollectorPlan(f=f, n_keep=f, statistic=statistic)
    totals: dict[str, np.ndarray] = {}
    for start in range(0, len(corpus.windows), batch_size):
        tokens = jnp.asarray(corpus.windows[start : start + batch_size])
        _, _, _, aux = engine.prefill(model.graphdef, model.params, tokens, jnp.ones_like(tokens), plan, with_aux=True)
        for name, value in by_slot(model.config, distributed.to_host(aux)).items():
            value = np.asarray(value)
            value = value.astype(np.int64 if np.issubdtype(value.dtype, np.integer) or value.dtype == bool else np.float64)
            totals[name] = totals[name] + value if name in totals else value
    return totals


def by_slot(cfg, aux: dict[str, Any]) -> dict[str, np.ndarray]:
    """A MoE model's stacked aux ({"experts": {name: [L, E, ...]}, "shared": {name: [L, n, ...]},
    "router_topk": ...}) -> {name: [L, slots, ...]} (`models.moe.MoEConfig.slots`); a dense
    model's aux as it is."""
    if cfg.moe is None:
        return aux
    L, E = cfg.num_hidden_layers, cfg.moe.num_experts
    n_shared = cfg.moe.slots(L) - E
    parts = {kind: aux.get(kind) or {} for kind in ("experts", "shared")}
    out = {}
    for name in dict.fromkeys([*parts["experts"], *parts["shared"]]):
        sample = np.asarray(parts["experts"].get(name, parts["shared"].get(name)))
        blocks = []
        for kind, n in (("experts", E), ("shared", n_shared)):
            value = parts[kind].get(name)
            value = np.zeros((L, n, *sample.shape[2:]), sample.dtype) if value is None else np.asarray(value)
            blocks.append(value)
        out[name] = np.concatenate(blocks, axis=1)
    return out


# ---------------------------------------------------------------- the cache


_FINGERPRINTS: dict[tuple[int, str], tuple[Any, str]] = {}


def model_fingerprint(model) -> str:
    """A hash of the model's config and every parameter's bytes (changes with any weight).

    Memoised per params object (seconds for a 135M model): a model with other weights is a new
    params pytree; editing a ``params`` State in place is not detected."""
    config = json.dumps(model.config.to_hf_dict(), sort_keys=True, default=str)
    key = (id(model.params), config)
    hit = _FINGERPRINTS.get(key)
    if hit is not None and hit[0]() is model.params:
        return hit[1]
    h = hashlib.blake2b(config.encode(), digest_size=16)
    for path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]:
        array = distributed.to_host(leaf)  # a multi-host model's leaf: gathered, one tensor at a time
        h.update(f"{jax.tree_util.keystr(path)}:{array.dtype}:{array.shape}".encode())
        h.update(np.ascontiguousarray(array).tobytes())
    try:
        _FINGERPRINTS[key] = (weakref.ref(model.params), h.hexdigest())
    except TypeError:  # a params pytree without weak references (a plain dict): no memo
        pass
    return h.hexdigest()


ARRAYS = "arrays.npz"


def cache_key(model_key: str, corpus: Corpus, statistic: Statistic, batch_size: int = DEFAULT_BATCH) -> tuple[dict[str, Any], str]:
    """-> (the key fields, the entry's name) under which `calibrate` caches a statistic."""
    key = {
        "format": CACHE_FORMAT,
        "model": model_key,
        "corpus": {"name": corpus.name, "tokens": corpus.n_tokens, "window": corpus.window, "ids": corpus.fingerprint()},
        "statistic": statistic.key(),
        "batch_size": batch_size,
    }
    return key, f"{statistic.name}-v{statistic.version}-{corpus.name}"


def cache_path(
    model_key: str, corpus: Corpus, statistic: Statistic, cache_dir: str | Path | None = None,
    batch_size: int = DEFAULT_BATCH,
) -> Path:
    """The cache entry (a directory) where `calibrate` keeps a statistic for this model and corpus."""
    key, name = cache_key(model_key, corpus, statistic, batch_size)
    return (Path(cache_dir) if cache_dir is not None else cache_root()) / "calibration" / entry_key(key, name)


def made_once(
    kind: str, key: dict[str, Any], compute: Callable[[], Any], write: Callable[[Path, Any], None],
    read: Callable[[Path], Any], *, name: str, root: str | Path | None = None,
) -> tuple[Any, Path]:
    """``compute()`` once per key, kept as a `popjax.cache` entry of ``kind`` by ``write(directory,
    value)`` and read back by ``read(entry)`` -> (value, entry); a fresh value is returned as
    computed. In a multi-host run ``compute`` is one program over every process's devices, so
    every process must run it or none (one that waited on another's lock would hang the run):
    all read when every process finds a valid entry, else all compute and each stores it in its
    own cache (a shared cache: the first rename wins, the others find the entry)."""
    if jax.process_count() > 1:
        found = lookup(kind, key, name=name, root=root)
        if distributed.everywhere(found is not None):
            return read(found), found
        value = compute()
        return value, get_or_make(kind, key, lambda directory: write(directory, value), name=name, root=root)
    fresh: list[Any] = []

    def make(directory: Path) -> None:
        fresh.append(compute())
        write(directory, fresh[0])

    entry = get_or_make(kind, key, make, name=name, root=root)
    return (fresh[0] if fresh else read(entry)), entry


def cached_arrays(
    kind: str, key: dict[str, Any], compute: Callable[[], dict[str, np.ndarray]], *, name: str,
    root: str | Path | None = None,
) -> dict[str, np.ndarray]:
    """``compute()`` once per key, kept as a `popjax.cache` entry of ``kind`` (one ``arrays.npz``:
    made atomically, checksummed and verified on every read; a corrupt entry is made again with
    a one-line warning). A fresh result is returned as computed, not read back."""
    arrays, _ = made_once(kind, key, compute, lambda directory, value: np.savez(directory / ARRAYS, **value),
                          _read_arrays, name=name, root=root)
    return arrays


def _read_arrays(entry: Path) -> dict[str, np.ndarray]:
    with np.load(entry / ARRAYS, allow_pickle=False) as data:
        return {array: np.array(data[array]) for array in data.files}


def calibrate(
    model,
    statistic: Statistic,
    corpus: Corpus | None = None,
    *,
    batch_size: int = DEFAULT_BATCH,
    cache: bool = True,
    cache_dir: str | Path | None = None,
) -> dict[str, np.ndarray]:
    """`collect` once per (model, corpus, statistic): later calls read the cache entry.

    Args:
      model: a ``popjax.load`` result.
      statistic: what to gather (see `Statistic`).
      corpus: default `default_corpus(model)` (Shakespeare, 16384 tokens in windows of 256).
      batch_size: windows per prefill batch (does not change the result beyond float rounding,
        so it is part of the key).
      cache: False always recomputes and writes nothing.
      cache_dir: the cache root for this call (entries go to ``<cache_dir>/calibration/``);
        default `popjax.cache.cache_root()`.
    Returns {name: [L, ...]} as `collect`.
    """
    corpus = default_corpus(model) if corpus is None else corpus
    if not cache:
        return collect(model, statistic, corpus, batch_size)
    key, name = cache_key(model_fingerprint(model), corpus, statistic, batch_size)
    return cached_arrays("calibration", key, lambda: collect(model, statistic, corpus, batch_size), name=name, root=cache_dir)


# ---------------------------------------------------------------- magnitude histograms


HIST_LOG10_MIN, HIST_LOG10_MAX, HIST_BINS = -8.0, 4.0, 4096  # bin width: a factor 1.0068


def hist_edges() -> np.ndarray:
    """Edges of the log-spaced bins, [HIST_BINS + 1]. Bin 0 counts |v| < edges[0] (zeros
    included), bin i ∈ [1, HIST_BINS] counts edges[i−1] ≤ |v| < edges[i], the last bin the rest."""
    return 10.0 ** np.linspace(HIST_LOG10_MIN, HIST_LOG10_MAX, HIST_BINS + 1)


def log_histogram(values: jax.Array, valid: jax.Array) -> jax.Array:
    """Counts of |values| in the log bins, invalid entries excluded: values [..., n] with valid
    broadcastable to values[..., 0] -> [HIST_BINS + 2] int32."""
    a = jnp.abs(values.astype(jnp.float32))
    scale = HIST_BINS / (HIST_LOG10_MAX - HIST_LOG10_MIN)
    idx = jnp.floor((jnp.log10(jnp.maximum(a, 1e-30)) - HIST_LOG10_MIN) * scale).astype(jnp.int32) + 1
    idx = jnp.clip(idx, 0, HIST_BINS + 1)
    weights = jnp.broadcast_to(valid[..., None], a.shape).astype(jnp.int32)
    return jnp.bincount(idx.reshape(-1), weights.reshape(-1), length=HIST_BINS + 2)


def histogram_quantile(counts: np.ndarray, q: float) -> float:
    """The value t with P(|v| < t) ≈ q from `log_histogram` counts [HIST_BINS + 2]; linear in
    log|v| inside a bin. q = 0 gives 0 (nothing below); the under/overflow bins clamp."""
    if not 0.0 <= q <= 1.0:
        raise CalibrationError(f"quantile q={q!r} is outside [0, 1]")
    counts = np.asarray(counts, np.float64)
    total = counts.sum()
    if total <= 0:
        raise CalibrationError("the histogram is empty: the calibration corpus gave no values")
    if q == 0.0:
        return 0.0
    target = q * total
    cum = np.cumsum(counts)
    i = int(np.searchsorted(cum, target, side="left"))  # first bin whose cumulative count reaches it
    if i == 0:
        return 0.0  # inside the underflow bin (zeros): keep every non-zero
    edges = hist_edges()
    if i > HIST_BINS:
        return float(edges[-1])
    before = cum[i - 1]
    frac = (target - before) / counts[i] if counts[i] > 0 else 0.0
    lo, hi = np.log10(edges[i - 1]), np.log10(edges[i])
    return float(10.0 ** (lo + frac * (hi - lo)))

