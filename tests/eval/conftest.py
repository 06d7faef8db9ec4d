"""Fixtures of the evaluation tests: the tiny model converted with a character-level tokenizer
(the shared tiny checkpoints carry none), once per test module."""

from __future__ import annotations

import shutil

import pytest

import popjax

CHARS = [chr(i) for i in range(32, 127)] + ["\n"]


def write_char_tokenizer(directory) -> None:
    """A character-level tokenizer (ids 3.. are printable ASCII and newline; 1 = BOS, 2 = EOS as
    in the tiny configs) saved so that ``AutoTokenizer.from_pretrained(directory)`` loads it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(directory))


@pytest.fixture(scope="module")
def converted(tiny_checkpoints, tmp_path_factory):
    """A converted tiny model directory that carries a tokenizer (the shared fixture's has none)."""
    source, _ = tiny_checkpoints("llama-gqa")
    root = tmp_path_factory.mktemp("lm_eval_model")
    shutil.copytree(source, root / "hf")
    write_char_tokenizer(root / "hf")
    return popjax.convert_source(root / "hf", root / "converted")


@pytest.fixture(scope="module")
def model(converted):
    return popjax.load(converted)
