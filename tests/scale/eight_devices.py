"""The 8-device worker: ONE subprocess with 8 fake CPU devices teacher-forces every method on
the tiny LLaMA below on the (2, 4) mesh (and (8, 1) where a method reduces over rows) against one
device, and reads the collectives and split copies of the compiled prefill and decode step on
(1, 8); tests/scale/test_eight_devices.py checks what it writes. The tiny config and random
checkpoint tree are shared with the other multi-device workers (Gemma 3, multi-host).

By hand: ``python tests/scale/eight_devices.py out.json --all`` (with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MESHES = ((8, 1), (1, 8), (2, 4))
# (8, 1) splits only the batch: it can break only what a method computes across rows (POP's
# shared scores, per-sequence selections); (1, 8) and (2, 4) split the channels as well.
BATCH_ONLY_METHODS = ("dense", "pop-shared", "pop-per_sequence")
ATOL = 1e-5
PROMPTS = [[5, 17, 3, 99, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
NEW_TOKENS = 8


def tiny_config(**overrides):
    """LLaMA-style, sized so every split of an 8-device mesh divides: heads 16, kv heads 8,
    f 256 (32 channels per shard), vocabulary 256."""
    from popjax.models.config import ModelConfig

    fields = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                  max_position_embeddings=256, tie_word_embeddings=False)
    return ModelConfig(**{**fields, **overrides})


def random_tree(cfg, seed: int = 0) -> dict:
    """A converted-checkpoint tree (HF layout: q/k/v and gate/up apart) of random weights."""
    rng = np.random.default_rng(seed)
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    w = lambda *shape: (rng.normal(size=shape) * 0.15).astype(np.float32)
    norm = lambda n: {"weight": (1 + 0.1 * rng.normal(size=n)).astype(np.float32)}
    layer = lambda: {
        "attn_norm": norm(d), "mlp_norm": norm(d),
        "attn": {"q": w(cfg.num_attention_heads * h, d), "k": w(cfg.num_key_value_heads * h, d),
                 "v": w(cfg.num_key_value_heads * h, d), "o": w(d, cfg.num_attention_heads * h)},
        "mlp": {"gate": w(f, d), "up": w(f, d), "down": w(d, f)},
    }
    if cfg.sandwich_norms:  # Gemma: norms on the attention and FFN outputs as well
        layer_without_post = layer
        layer = lambda: {**layer_without_post(), "attn_post_norm": norm(d), "mlp_post_norm": norm(d)}
    if cfg.qk_norm:
        layer_without_norms = layer
        layer = lambda: (lambda t: {**t, "attn": {**t["attn"], "q_norm": norm(h), "k_norm": norm(h)}})(layer_without_norms())
    tree = {"embed": w(cfg.vocab_size, d), "final_norm": norm(d), "layers": {str(i): layer() for i in range(cfg.num_hidden_layers)}}
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = w(cfg.vocab_size, d)
    return tree


# ----------------------------------------------------------------------------- the methods and what the worker runs


def core_meshes(name: str) -> tuple[tuple[int, int], ...]:
    """The meshes a core method is teacher-forced on: (2, 4), which splits the batch and the
    channels at once, and (8, 1) as well for those that reduce over rows. (1, 8) runs every
    core method's prefill and decode step below (the collective counts, the split copies)."""
    return ((8, 1), (2, 4)) if name in BATCH_ONLY_METHODS else ((2, 4),)


def core_methods():
    import popjax

    return {
        "dense": popjax.Dense(),
        "static": popjax.Static(0.3),
        "pop-shared": popjax.POP(0.3),
        "pop-per_sequence": popjax.POP(0.3, aggregate="per_sequence"),
        "pop-per_shard": popjax.POP(0.3, partition="per_shard", shards=8),
    }


def other_methods(model):
    """Every other registered method: those that need calibration data calibrated on random
    tokens (TEAL, CATS, FLAP), given their selection (Wanda-sp) or their drift (the layer
    bands), or prepared (the low-rank POP's SVD factors). Only methods with a model."""
    import popjax
    from popjax.methods import make_method

    out = {"dynamic": popjax.Dynamic(0.3), "griffin": popjax.GRIFFIN(0.3), "probe": popjax.ProbePruning(0.3),
           "bwap": popjax.BWAP(), "prefill-only+pop": popjax.PrefillOnly() + popjax.POP(0.3)}
    out["pop-shortlist"] = make_method("pop-shortlist", ratio=0.3, gamma=0.4)  # runs pop-gate's scoring too
    out["dynamic-shortlist"] = make_method("dynamic-shortlist", ratio=0.3)
    out["pop-gate"] = make_method("pop-gate", ratio=0.3, gamma=0.2)
    out["pop-bands"] = popjax.LayerBandsPOP(0.3, gamma=0.2).with_drift([0.1, 0.9])  # bands from a given drift
    out["pop-pallas"] = popjax.POP(0.3, gamma=0.2, kernel="pallas")  # the kernel on every device (interpret mode)
    out["dynamic-pallas"] = popjax.Dynamic(0.3, kernel="pallas")  # its replicated down copy
    out["shortlist-pallas"] = popjax.ShortlistPOP(0.3, gamma=0.2, kernel="pallas")  # row dots, then the down rows
    out["static-block-pallas"] = popjax.Static(0.3, block=8, kernel="pallas")  # its replicated slab, the fused block kernel
    if model is not None:  # calibrated for real, on random tokens (seconds on this model; not cached)
        from popjax.calibration import Corpus

        out["pop-lowrank"] = popjax.LowRankPOP(0.3, gamma=0.2, rank=8)  # its SVD factors
        corpus = Corpus("random", np.random.default_rng(6).integers(0, model.config.vocab_size, (4, 32)))
        out["wina"] = popjax.WINA(0.3)  # its column norms (prepared by the worker)
        for name, method in (("teal", popjax.TEAL(0.3)), ("cats", popjax.CATS(0.3)), ("flap", popjax.FLAP(0.3)),
                             ("glass", popjax.GLASS(0.3, aggregate="per_sequence")), ("larosa", popjax.LaRoSa(0.3)),
                             ("principal-teal", popjax.PrincipalTEAL(0.3, rank=2))):
            out[name] = method.calibrate(model, corpus, cache=False)  # Wanda-sp from a hand-made selection (no calibration): its kept rows split like static's
        out["teal-pallas"] = dataclasses.replace(out["teal"], kernel="pallas")  # its replicated copies, the kernel on every device
        out["cats-pallas"] = dataclasses.replace(out["cats"], kernel="pallas")  # its up/down channel rows, the gated kernel
        from popjax.methods.wanda_sp import ChannelSelection

        cfg, rng = model.config, np.random.default_rng(5)
        n_keep = popjax.WandaSP(0.3).n_keep(cfg)
        kept = tuple(tuple(sorted(rng.choice(cfg.intermediate_size, n_keep, replace=False).tolist()))
                     for _ in range(cfg.num_hidden_layers))
        out["wanda-sp"] = popjax.WandaSP(0.3, selection=ChannelSelection("wanda-sp", 0.3, kept))
    return out


def _teacher(model, plan, tokens, mask, targets, data=None):
    import jax.numpy as jnp

    from popjax import engine, sharding

    with sharding.use_mesh(model):
        nll, logp, _ = engine.teacher_force(model.graphdef, model.params, plan, jnp.asarray(tokens), jnp.asarray(mask),
                                            jnp.asarray(targets), with_logprobs=True, data=data)
        return np.asarray(logp)


def compiled_start(model, method):
    """The request for PROMPTS, the carry after its prefill and the compiled prefill's HLO text.
    The prefill runs from the executable whose HLO is read, so it compiles once; the decode-step
    and method-state checks below share it."""
    import jax.numpy as jnp

    from popjax import engine, sharding
    from popjax.requests import GenerationRequest

    req = GenerationRequest.create(model, PROMPTS, NEW_TOKENS, method=method, ignore_eos=True)
    with sharding.use_mesh(model):
        args = (req.tokens, req.mask, req.key, req.sampling, jnp.asarray(req.stops), jnp.int32(req.pad_id))
        compiled = engine.start.lower(model.graphdef, model.params, req.plan, *args, capacity=req.capacity,
                                      data=req.data).compile()
        carry, _ = compiled(model.params, *args, data=req.data)
    return req, carry, compiled.as_text()


def _decode_step_hlo(model, started) -> str:
    """The compiled decode step's HLO text after ``started = compiled_start(model, method)``."""
    import jax.numpy as jnp

    from popjax import engine, sharding

    req, carry, _ = started
    with sharding.use_mesh(model):
        lowered = engine.stream_step.lower(model.graphdef, model.params, req.plan, carry, req.sampling,
                                           jnp.asarray(req.stops), jnp.int32(req.pad_id), data=req.data)
    return lowered.compile().as_text()


def largest_all_gather(hlo: str) -> int:
    """Elements of the largest all-gather in compiled HLO text (0 without one)."""
    from popjax import sharding

    return max((n for _, n in sharding.collective_operands(hlo, "all-gather")), default=0)


def method_state_after_prefill(model, started) -> dict:
    """The prefill's method states after ``started = compiled_start(model, method)``: bytes in
    all and held by one device, and the largest all-gather of the compiled prefill (elements)."""
    import jax

    _, carry, prefill_hlo = started
    leaves = jax.tree_util.tree_leaves_with_path(carry.state.method_states)
    one_device = lambda a: a.addressable_shards[0].data.nbytes
    replicated = [(path[-1].key, a) for path, a in leaves if one_device(a) == a.nbytes]
    return {"total": sum(a.nbytes for _, a in leaves),
            "one_device": sum(one_device(a) for _, a in leaves),
            "replicated_bytes": sum(a.nbytes for _, a in replicated),
            # weight copies: leaves with a hidden-size (d) axis
            "replicated_weights": sorted({name for name, a in replicated if model.config.hidden_size in a.shape}),
            "prefill_largest_all_gather": largest_all_gather(prefill_hlo)}


def restore_straight_into_shardings(cfg, tree, placed) -> dict:
    """``popjax.load(converted dir, mesh=(1, 8))``, unrolled and scanned, with host placement
    (``sharding.place``) forbidden: orbax must restore every tensor into its sharding. -> per
    layout: the largest difference to ``placed`` (built from host arrays), for the stored
    tensors and for the derived ones, and the leaves whose sharding differs from the rules'."""
    import tempfile
    from unittest import mock

    import jax
    from flax import nnx

    import popjax
    from popjax import sharding
    from popjax.convert.store import dotted, write_converted
    from popjax.loaded import with_scanned_layers

    directory = Path(tempfile.mkdtemp()) / "model"
    write_converted(directory, cfg, tree, lambda _: False, {"source": "random", "kind": "hf", "dtype": "float32"})
    mesh = placed.mesh
    out = {}
    for layout, want_model in (("unrolled", placed), ("scanned", with_scanned_layers(placed))):
        with mock.patch.object(sharding, "place", side_effect=AssertionError("a host array was placed")):
            got_model = popjax.load(directory, mesh=mesh, scan_layers=layout == "scanned")
        got, want = nnx.to_pure_dict(got_model.params), nnx.to_pure_dict(want_model.params)
        diffs, derived, wrong = [], [0.0], []
        for (keys, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(want)):
            path = dotted(keys)
            # ‖W_d[:, j]‖₂ is computed after loading (per layer, or on the stack): rounding only
            (derived if path.endswith("down_norm") else diffs).append(float(np.abs(np.asarray(a) - np.asarray(b)).max()))
            if not a.sharding.is_equivalent_to(sharding.param_sharding(path, tuple(a.shape), mesh, cfg), a.ndim):
                wrong.append(path)
        out[layout] = {"leaves": len(diffs), "max_abs_diff": max(diffs), "max_abs_diff_derived": max(derived),
                       "wrong_shardings": wrong}
    return out


INT8_METHODS = ("dense", "static", "pop-shared", "pop-per_shard")


def int8_on_meshes(cfg, tree, tokens, mask, targets) -> dict:
    """The int8 model of ``tree`` on one device and on meshes (1, 8), (2, 4): each scale's
    sharding against its weight's (equal on every axis but the weight's input axis), and on the
    (2, 4) mesh the log-probabilities of the methods that read int8 rows split over the model
    axis (the whole weights, kept rows, per-shard blocks). The per-sequence gather of int8 rows
    is test_int8.py's, on one device; its split is the float model's, above."""

    from flax import nnx

    from popjax import sharding
    from popjax.loading import build_model

    cfg8 = dataclasses.replace(cfg, weights="int8")
    single = build_model(cfg8, tree, None, "tiny-int8", "float32")
    out = {"methods": {}, "scales_checked": 0, "scales_split_unlike_weights": []}
    meshes = ((1, 8), (2, 4))
    sharded = {shape: build_model(cfg8, tree, None, "tiny-int8", "float32", sharding.make_mesh(shape)) for shape in meshes}
    leaves = dict(sharding.param_paths(nnx.to_pure_dict(sharded[(1, 8)].params)))
    for path, scale in leaves.items():
        if path.endswith("_scale"):
            weight = leaves[path[: -len("_scale")]]
            w_spec, s_spec = weight.sharding.spec, scale.sharding.spec
            pad = lambda spec: tuple(spec) + (None,) * (weight.ndim - len(spec))
            out["scales_checked"] += 1
            if pad(w_spec)[:-1] != pad(s_spec)[:-1] or pad(s_spec)[-1] is not None:
                out["scales_split_unlike_weights"].append([path, str(w_spec), str(s_spec)])
    for name in INT8_METHODS:
        plan = core_methods()[name].bind(cfg8)
        want = _teacher(single, plan, tokens, mask, targets)[: len(PROMPTS)]
        got = _teacher(sharded[(2, 4)], plan, tokens, mask, targets)[: len(PROMPTS)]
        out["methods"][name] = {"(2, 4)": {"max_abs_logprob_diff": float(np.abs(got - want).max()),
                                           "greedy_same": bool((got.argmax(-1) == want.argmax(-1)).all())}}
    # per-step row copies of an int8-activation model keep its activation format on a mesh too
    # (tests/models/test_int8.py checks one device; this worker runs as a script, without the tests package)
    import jax
    import jax.numpy as jnp

    from popjax import engine
    from popjax.kernels.int8 import Int8Weight
    from popjax.methods import make_method

    fast = build_model(dataclasses.replace(cfg8, activations="int8"), tree, None, "tiny-int8", "float32", sharding.make_mesh((2, 4)))
    out["step_row_formats"] = {}
    for name in ("pop-gate", "pop-shortlist"):
        with sharding.use_mesh(fast):
            _, _, states, _ = engine.prefill(fast.graphdef, fast.params, jnp.asarray(tokens), jnp.asarray(mask),
                                             make_method(name).bind(fast.config))
        leaves = jax.tree_util.tree_leaves(states, is_leaf=lambda a: isinstance(a, Int8Weight))
        out["step_row_formats"][name] = sorted({a.activations for a in leaves if isinstance(a, Int8Weight)})
    return out


def worker(out_path: str, all_methods: bool = False) -> None:
    """Runs in the 8-device subprocess; writes its findings as JSON for the tests to check.

    Every method is teacher-forced through prefill and NEW_TOKENS decode steps on fixed random
    targets: equal log-probabilities and equal argmax at every step mean equal greedy choices
    for any prefix; the full greedy loop (generate_ids) runs on a mesh for dense and POP per shard."""
    import jax

    import popjax
    from popjax import sharding
    from popjax.generation import generate_ids
    from popjax.requests import pad_batch
    from popjax.loading import build_model

    start = time.process_time()
    cfg, tree = tiny_config(), random_tree(tiny_config())
    single = build_model(cfg, tree, None, "tiny", "float32")
    sharded = {shape: build_model(cfg, tree, None, "tiny", "float32", sharding.make_mesh(shape)) for shape in MESHES}
    tokens, mask = pad_batch(PROMPTS, 0, min_rows=8)  # 8 rows: the (8, 1) mesh splits the batch 8 ways
    results = {"devices": len(jax.devices()), "methods": {}, "collectives": {}, "generate": {}}
    runs = [(name, m, core_meshes(name)) for name, m in core_methods().items()]
    others = other_methods(single)  # calibrated once: the runs below and the split-copy checks share them
    if all_methods:  # the (2, 4) mesh splits the batch and the channels at once: what a mesh can break
        runs += [(name, m.prepare(single), ((2, 4),)) for name, m in others.items()]
    # registry names covered (a composite counts for its FFN method too)
    results["registry_names"] = sorted({n for _, m, _ in runs for n in (m.name, m.ffn_method.name if m.layer_level else m.name)})
    targets = np.random.default_rng(1).integers(0, cfg.vocab_size, (tokens.shape[0], NEW_TOKENS)).astype(np.int32)
    for name, method, meshes in runs:
        plan, data = method.bind(cfg), method.data(single)
        want = _teacher(single, plan, tokens, mask, targets, data)[: len(PROMPTS)]
        entry = {}
        for shape in meshes:
            got = _teacher(sharded[shape], plan, tokens, mask, targets, data)[: len(PROMPTS)]
            entry[str(shape)] = {"max_abs_logprob_diff": float(np.abs(got - want).max()),
                                 "greedy_same": bool((got.argmax(-1) == want.argmax(-1)).all())}
        results["methods"][name] = entry
    for name, method in (("pop-per_shard", core_methods()["pop-per_shard"]),):
        ids, _ = generate_ids(sharded[(2, 4)], PROMPTS, NEW_TOKENS, method=method, ignore_eos=True)
        want, _ = generate_ids(single, PROMPTS, NEW_TOKENS, method=method, ignore_eos=True)
        results["generate"][name] = ids == want
    # smaller than any FFN weight matrix or compact block (d·f, d·n_keep), larger than any
    # activation or logits row block ([B, V], [B, f]): an operand this size is weights moving
    weight_elements = cfg.hidden_size * cfg.hidden_size
    split_copies = {name: core_methods()[name]
                    for name in ("static", "pop-shared", "pop-per_sequence", "pop-per_shard")}
    split_copies["bwap"] = popjax.BWAP(0.3)
    split_copies.update({name: others[name] for name in ("wanda-sp", "pop-gate", "pop-bands")})
    split_copies["pop-lowrank"] = others["pop-lowrank"].prepare(single)
    step_methods = {**core_methods(), **split_copies,
                    "pop-per_shard-gather": popjax.POP(0.3, partition="per_shard", shards=8, weights="gather")}
    hlo_methods = ("dense", "static", "pop-shared", "pop-per_shard", "bwap", "pop-per_shard-gather")
    started = {name: compiled_start(sharded[(1, 8)], step_methods[name]) for name in dict.fromkeys([*hlo_methods, *split_copies])}
    for name in hlo_methods:
        hlo = _decode_step_hlo(sharded[(1, 8)], started[name])
        results["collectives"][name] = {
            "counts": sharding.count_collectives(hlo),
            "largest_all_gather": largest_all_gather(hlo),
            "weight_threshold_elements": weight_elements,
        }
    results["state_after_prefill"] = {name: method_state_after_prefill(sharded[(1, 8)], started[name])
                                      for name in split_copies}
    results["restore"] = restore_straight_into_shardings(cfg, tree, sharded[(1, 8)])
    results["int8"] = int8_on_meshes(cfg, tree, tokens, mask, targets)
    results["cpu_seconds"] = time.process_time() - start
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    worker(sys.argv[1], all_methods="--all" in sys.argv)


def run_worker(tmp_path, *args: str) -> dict:
    out = tmp_path / "sharding.json"
    from tests.conftest import fake_devices_env

    env = fake_devices_env(8)
    proc = subprocess.run([sys.executable, __file__, str(out), *args], env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def check_methods(results: dict) -> None:
    for name, entry in results["methods"].items():
        for shape, got in entry.items():
            assert got["greedy_same"], (name, shape)
            assert got["max_abs_logprob_diff"] <= ATOL, (name, shape, got)
