"""The tiny calibration corpus the calibrated methods' tests share: a paragraph of English, a byte
tokenizer standing in for the tiny models' (they have none), and the corpus of its windows."""

from __future__ import annotations

from popjax.calibration import Corpus

TEXT = (
    "The committee met on a grey Tuesday to decide the fate of the old railway bridge. Some members "
    "argued that it should be restored, since the iron had survived a century of floods; others said "
    "the money would be better spent on the school, whose roof leaked every winter. The engineer read "
    "her report aloud: the piers were sound, the deck was not, and the paint hid more rust than anyone "
    "had guessed. After an hour of polite disagreement the chairman proposed a compromise. The bridge "
    "would close to cars but stay open to walkers and bicycles, and a small fee at the summer fair "
    "would pay for new planks. Nobody liked it very much, which, he remarked, is how one recognises a "
    "fair decision. Outside, the river ran high and brown under the arches, carrying branches from the "
    "hills, and a heron stood on the last pier as if it had been appointed to guard the place. "
)


def byte_ids(text: str, vocab: int = 160) -> list[int]:
    """A deterministic stand-in tokenizer for the tiny models (they have none): bytes -> [3, vocab)."""
    return [3 + b % (vocab - 3) for b in text.encode()]


class ByteTokenizer:
    """The transformers call signature the corpus builders use."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": byte_ids(text)}


def tiny_corpus(text: str = TEXT * 2, window: int = 32, n_tokens: int | None = 1024) -> Corpus:
    return Corpus.from_token_ids("tiny-text", byte_ids(text), n_tokens, window)
