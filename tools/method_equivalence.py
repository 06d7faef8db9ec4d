"""Every registry method, before and after a refactor: greedy tokens and teacher-forced log-probs.

For tiny random models of each family (LLaMA, Qwen3, Qwen2-MoE, Gemma 3, Qwen2-VL — its decoder
is Qwen2's — with an image), built from a seed without torch or transformers, and for the real
default model, every method of ``popjax.methods.METHODS`` (at its default ``aggregate``, and
per-sequence for POP and static; Prefill-Only alone, with POP, with calibrated and with no K/V;
``--all-aggregates``: every value) runs unrolled and scanned (``with_scanned_layers``):

* ``popjax.generate_ids``: greedy, ``NEW_TOKENS`` new tokens for a left-padded batch of 2 prompts;
* ``engine.teacher_force`` on fixed random targets [2, NEW_TOKENS]: the log-prob of each target,
  the argmax and its log-prob at each step (the full [B, N, V] rows are not kept: the file stays
  small, and equal argmax ids with equal log-probs mean equal greedy choices for any prefix).

Only APIs that exist before and after issue 41 are used (the model module is never called), so
the same script records a reference on an old checkout and compares the new code against it (the
links make ``popjax.models``/``popjax.convert`` resolve in the checkout, not the editable install)::

    git worktree add /tmp/popjax_before eea2c60 && cd /tmp/popjax_before/popjax
    ln -s ../models models && ln -s ../convert convert && cd /tmp
    PYTHONPATH=/tmp/popjax_before python $REPO/tools/method_equivalence.py --record before.json
    python tools/method_equivalence.py --compare before.json --report report.json   # exit 1: a difference

Each run's method hyper-parameters are written into the reference, ``aggregate`` explicitly, and a
comparison rebuilds the methods from them, so a changed default does not read as a regression.
Calibrated methods are calibrated on random token windows with ``cache=False`` (and
``POPJAX_CACHE`` points at a temporary folder), so no run reads another's calibration. The XLA
settings are written too and a comparison runs under the reference's (they change float rounding).
Log-probs are stored as base64 float32 (``--record``); ``--compare`` prints per (model, method,
layout) whether the tokens are equal and the max |Δ log-prob|.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is no package: its sibling module
from equivalence_report import compare, describe, encode  # noqa: E402

NEW_TOKENS = 8
TOL = 1e-6
TINY_MODELS = ("llama", "qwen3", "qwen2_moe", "gemma3", "qwen2_vl")  # Qwen2-VL's decoder is Qwen2's (q/k/v biases)
# besides each method's default: the per-sequence decode (a vmap over rows) that issue 41 makes
# the default of the methods that partition by the prompt
EXTRA_AGGREGATES = {"pop": ("per_sequence",), "static": ("per_sequence",), "prefill-only+pop": ("per_sequence",)}
LAYOUTS = ("unrolled", "scanned")
# XLA settings per model set: tiny programs compile unoptimised with the older loop emitters, as
# the test suite compiles them (tests/conftest.py: faster compiles); the real model keeps JAX's defaults
SETTINGS = {"tiny": {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false"},
            "default": {"JAX_DISABLE_MOST_OPTIMIZATIONS": "0", "XLA_FLAGS": ""}}
PROMPTS = [[1, 5, 17, 3, 60, 42], [1, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]  # ids < 64: every tiny vocabulary
DEFAULT_PROMPTS = ["Name three colors.", "Write a haiku about the sea, please."]
VISION = dict(start=121, image=120, end=122)  # Qwen2-VL's token ids in the tiny model
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
TINY_CONFIGS = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", head_dim=16, tie_word_embeddings=False),  # q/k norms
    # 4 routed experts of 32 + a shared expert of 48 (1.5 blocks: a zero-padded block slot)
    "qwen2_moe": dict(model_type="qwen2_moe", intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2),
    # a window of 8 (prompt + decode run past it), a sliding and a full layer, soft-capped logits
    "gemma3": dict(model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0),
    "qwen2_vl": dict(model_type="qwen2_vl", tie_word_embeddings=True, image_token_id=VISION["image"],
                     vision_start_token_id=VISION["start"], video_token_id=123,
                     text_config={"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
                     vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2)),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--record", metavar="OUT.json", help="write the tokens and log-probs of every run")
    p.add_argument("--compare", metavar="REF.json", help="re-run the reference's runs and compare (exit 1 on a difference)")
    p.add_argument("--report", metavar="REPORT.json", help="with --compare: write the per-run comparison")
    p.add_argument("--models", default=None, help=f"'tiny' ({', '.join(TINY_MODELS)}), 'default', or a comma list; "
                   "default: --compare's models, else tiny")
    p.add_argument("--methods", default=None, help="comma list of run labels (e.g. 'pop[shared],dense'); default all")
    p.add_argument("--diagonal", action="store_true",
                   help="with --compare: model i of n runs only its sorted run labels i, i + n, ... (every run on one model)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of unrolled, scanned")
    p.add_argument("--all-aggregates", action="store_true",
                   help="--record: every value of every method's aggregate (default: the default, and EXTRA_AGGREGATES)")
    p.add_argument("--tol", type=float, default=TOL, help="largest |Δ log-prob| accepted (default %(default)s)")
    args = p.parse_args(argv)
    if not args.record and not args.compare:
        p.error("give --record OUT.json and/or --compare REF.json")
    return args


def _configure_xla(settings: dict[str, str]) -> None:
    """Before jax is imported: CPU, and the XLA settings a reference was recorded under."""
    if "jax" in sys.modules:
        raise RuntimeError("method_equivalence must set XLA's options before jax is imported")
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.update(settings)


# ----------------------------------------------------------------------------- models


def tiny_model(name: str, seed: int = 0):
    """A random float32 model of family ``name``: weights of scale 1/√fan_in (norms 1 + 0.1·N,
    biases 0.1·N), each tensor drawn from (seed, crc32 of the family, crc32 of the tensor's
    name), so the tree does not depend on the order in which `checkpoint_shapes` lists it."""
    import numpy as np
    from popjax.convert import convert as conv
    from popjax.loading import build_model
    from popjax.models.config import ModelConfig

    cfg = ModelConfig.from_hf_dict({**BASE, **TINY_CONFIGS[name]})
    flat = {}
    for key, shape in sorted(conv.checkpoint_shapes(cfg).items()):
        rng = np.random.default_rng([seed, zlib.crc32(name.encode()), zlib.crc32(key.encode())])
        if len(shape) >= 2:
            value = rng.normal(size=shape) / np.sqrt(np.prod(shape[1:]))
        elif "norm" in key or "ln_q" in key:
            value = 1.0 + 0.1 * rng.normal(size=shape) if key.endswith("weight") else 0.1 * rng.normal(size=shape)
        else:
            value = 0.1 * rng.normal(size=shape)
        flat[key] = value.astype(np.float32)
    return build_model(cfg, conv.unflatten(flat), None, f"tiny-{name}", "float32")


def prompts_for(name: str, model):
    """(token-id prompts, images per prompt or None): a VLM's first prompt holds a 56×56 image."""
    import numpy as np
    from popjax.generation import encode_prompts

    if name == "default":
        return encode_prompts(model, list(DEFAULT_PROMPTS), True), None
    if name != "qwen2_vl":
        return [list(p) for p in PROMPTS], None
    image = (np.random.default_rng(7).random((56, 56, 3)) * 255).astype(np.uint8)
    first = PROMPTS[0][:3] + [VISION["start"], VISION["image"], VISION["end"]] + PROMPTS[0][3:]
    return [first, list(PROMPTS[1])], [[image], []]


# ----------------------------------------------------------------------------- methods


def method_specs(tiny: bool, all_aggregates: bool = False) -> dict[str, dict]:
    """label -> {"name": registry name, "hyper": hyper-parameters}: every registry method at its
    default ``aggregate``, set explicitly, plus ``EXTRA_AGGREGATES`` (or every value of every
    method's aggregate), Prefill-Only alone, with calibrated and with no K/V, and with POP."""
    from popjax.methods import METHODS, method_fields

    extra = {"pop-lowrank": {"rank": 8}, "principal-teal": {"rank": 2}} if tiny else {}
    # of 2 layers the paper's default (the last ⌊L/3⌋) skips none, and skipping the last one alone
    # changes nothing (its input and so its K/V are the full model's): skip the first
    skip = {"skip": [0]} if tiny else {}
    specs = {}
    for name, cls in [*METHODS.items(), ("prefill-only+pop", METHODS["pop"])]:
        hyper = {**extra.get(name, {}), **(skip if name.startswith("prefill-only") else {})}
        if "aggregate" not in method_fields(cls.name):
            specs[name] = {"name": name, "hyper": hyper}
            continue
        default = {f.name: f.default for f in dataclasses.fields(cls)}["aggregate"]
        chosen = cls.aggregates if all_aggregates else [default, *EXTRA_AGGREGATES.get(name, ())]
        for aggregate in dict.fromkeys(chosen):
            specs[f"{name}[{aggregate}]"] = {"name": name, "hyper": {**hyper, "aggregate": aggregate}}
    for kv in ("calibrated", "none"):
        specs[f"prefill-only[kv={kv}]"] = {"name": "prefill-only", "hyper": {**skip, "kv": kv}}
    return specs


def calibration_corpus(model):
    """Random token windows (a fixed seed): calibration needs no tokenizer and no cache."""
    import numpy as np
    from popjax.corpus import Corpus

    tiny = model.source.startswith("tiny-")
    shape, high = ((4, 32), 64) if tiny else ((8, 128), model.config.vocab_size)
    return Corpus("equivalence-random", np.random.default_rng(11).integers(3, high, shape))


def ready_method(spec: dict, model, corpus):
    """The method of ``spec``, calibrated on ``corpus`` (cache=False) where it calibrates, then
    ``prepare(model)`` as ``popjax.generate`` calls it."""
    from popjax.methods import make_method
    from popjax.methods.prefill_only.calibrate import calibrate_kv

    method = make_method(spec["name"], **spec["hyper"])
    inner = getattr(method, "mlp_method", None)
    if inner is not None and hasattr(inner, "calibrate"):
        method = dataclasses.replace(method, mlp_method=inner.calibrate(model, corpus, cache=False))
    elif hasattr(method, "calibrate"):
        method = method.calibrate(model, corpus, cache=False)
    elif spec["name"] == "pop-bands":
        method = method.prepare(model, corpus=corpus, cache=False)
    if getattr(method, "kv", None) == "calibrated":
        skipped = method.skipped_layers(model.config.num_hidden_layers)
        window = min(corpus.window, 64)
        method = dataclasses.replace(method, kv_calibration=calibrate_kv(model, skipped, corpus, window=window, cache=False))
    return method.prepare(model)


# ----------------------------------------------------------------------------- runs


def run_one(model, method, prompts, images) -> dict:
    """Greedy tokens and teacher-forced log-probs of one prepared method on one layout."""
    import jax.numpy as jnp
    import numpy as np
    import popjax
    from popjax import engine
    from popjax.requests import GenerationRequest

    tokens, _ = popjax.generate_ids(model, prompts, NEW_TOKENS, method=method, ignore_eos=True, images=images)
    req = GenerationRequest.create(model, prompts, NEW_TOKENS, method=method, ignore_eos=True, images=images)
    B = int(req.tokens.shape[0])
    targets = np.random.default_rng(3).integers(3, 64, (B, NEW_TOKENS)).astype(np.int32)
    _, logp, _ = engine.teacher_force(model.graphdef, model.params, req.plan, req.tokens, req.mask, jnp.asarray(targets),
                                      with_logprobs=True, data=req.data, images=req.images)
    logp = np.asarray(logp, np.float32)[: len(prompts)]  # [2, N, V]; dead rows dropped
    argmax = logp.argmax(-1)
    return {"tokens": tokens, "argmax": argmax.tolist(),
            "target_logprob": encode(np.take_along_axis(logp, targets[: len(prompts), :, None], -1)[..., 0]),
            "argmax_logprob": encode(np.take_along_axis(logp, argmax[..., None], -1)[..., 0])}


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:300]


def run_model(name: str, specs: dict[str, dict], layouts: list[str], out: dict, saved=lambda: None) -> None:
    """Fills ``out`` {label: {"method": spec, layout: run or {"error": ...}}} for one model, and
    calls ``saved()`` after each method; a method that cannot be made, prepared or run on a layout
    is recorded with its error there."""
    import jax
    import popjax
    from popjax.loaded import with_scanned_layers

    model = popjax.load() if name == "default" else tiny_model(name)
    views = {}
    for layout in layouts:
        try:
            views[layout] = model if layout == "unrolled" else with_scanned_layers(model)
        except Exception as err:  # noqa: BLE001 - e.g. layers that cannot be stacked; recorded as such
            views[layout] = _error(err)
    prompts, images = prompts_for(name, model)
    corpus = calibration_corpus(model)
    before = os.environ.get("POPJAX_CACHE")
    with tempfile.TemporaryDirectory(prefix="popjax-equivalence-") as cache:
        os.environ["POPJAX_CACHE"] = cache  # after load: nothing calibrated before is reused
        for label, spec in specs.items():
            entry = out[label] = {"method": spec}
            for layout in layouts:
                view = views[layout]
                try:
                    if isinstance(view, str):
                        raise RuntimeError(view)
                    # prepared on each view, as generate prepares it on the model it is given (a
                    # calibration is keyed by the model's fingerprint, which the layout changes)
                    entry[layout] = run_one(view, ready_method(spec, view, corpus), prompts, images)
                except Exception as err:  # noqa: BLE001 - recorded, and compared with the other side's
                    entry[layout] = {"error": _error(err)}
            jax.clear_caches()  # hundreds of executables would otherwise stay in memory (GBs)
            saved()
            print(f"{name:10s} {label:28s} " + " ".join(f"{l}={'error' if 'error' in entry[l] else 'ok'}" for l in layouts),
                  flush=True)
    if before is None:
        os.environ.pop("POPJAX_CACHE")
    else:
        os.environ["POPJAX_CACHE"] = before


def diagonal(reference: dict, model: str) -> list[str]:
    """The run labels ``--diagonal`` gives ``model``: its sorted labels i, i + n, ... (model i of n)."""
    models = list(reference["models"])
    return sorted(reference["models"][model])[models.index(model)::len(models)]


def _check_choice(flag: str, given: list[str], valid: list[str]) -> None:
    unknown = [g for g in given if g not in valid]
    if unknown:
        raise SystemExit(f"{flag}: {unknown} {'is' if len(unknown) == 1 else 'are'} not valid; valid: {valid}")


def plan(args: argparse.Namespace) -> tuple[dict | None, list[str], list[str], dict[str, str]]:
    """Validated before jax starts: (reference or None, models, layouts, XLA settings)."""
    reference = json.loads(Path(args.compare).read_text()) if args.compare else None
    if args.models is None:
        models = list(reference["models"]) if reference else list(TINY_MODELS)
    else:
        models = list(TINY_MODELS) if args.models == "tiny" else args.models.split(",")
    _check_choice("--models", models, list(reference["models"]) if reference else [*TINY_MODELS, "default"])
    if "default" in models and models != ["default"]:
        raise SystemExit("--models: run 'default' alone (it runs under JAX's default XLA settings)")
    if args.diagonal and reference is None:
        raise SystemExit("--diagonal: give --compare REF.json (the diagonal is of its runs)")
    layouts = args.layouts.split(",")
    _check_choice("--layouts", layouts, list(LAYOUTS))
    if reference is not None and args.methods is not None:
        labels = sorted({label for name in models for label in reference["models"][name]})
        _check_choice("--methods", args.methods.split(","), labels)
    settings = reference["settings"] if reference else SETTINGS["default" if models == ["default"] else "tiny"]
    return reference, models, layouts, settings


def save(path: str | None, data: dict, indent: int | None = None) -> None:
    """Writes ``data`` as JSON to ``path`` (nothing when None)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=indent, separators=None if indent else (",", ":")) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reference, models, layouts, settings = plan(args)
    _configure_xla(settings)
    import jax
    import popjax

    wanted = None if args.methods is None else set(args.methods.split(","))
    if reference is None and wanted is not None:
        _check_choice("--methods", sorted(wanted), sorted(method_specs(models != ["default"])))
    results = {"settings": settings, "jax": jax.__version__, "popjax": str(Path(popjax.__file__).parent),
               "new_tokens": NEW_TOKENS, "models": {}}
    for name in models:
        if reference is not None:  # the reference's methods, hyper-parameters as recorded
            specs = {label: e["method"] for label, e in reference["models"][name].items()}
            ran = [l for l in layouts if all(l in e for e in reference["models"][name].values())]
        else:
            specs, ran = method_specs(name != "default", args.all_aggregates), layouts
        if wanted is not None:
            specs = {k: v for k, v in specs.items() if k in wanted}
        if args.diagonal:
            specs = {k: specs[k] for k in diagonal(reference, name) if k in specs}
        run_model(name, specs, ran, results["models"].setdefault(name, {}), lambda: save(args.record, results))
    save(args.record, results)  # a killed run keeps the methods it ran (saved after each)
    if reference is None:
        return 0
    report = compare(reference, results, args.tol)
    for key, row in report["results"].items():
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {key}: {describe(row)}")
    print(f"{report['runs']} runs, {len(report['failed'])} failed, {report['bit_identical']} bit-identical, "
          f"max |Δ log-prob| {report['max_abs_dlogprob']:.3g} (tolerance {args.tol:g})")
    save(args.report, report, indent=1)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
