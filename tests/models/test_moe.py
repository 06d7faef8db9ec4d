"""Mixture-of-experts models (models/moe.py, docs/moe.md): parity with transformers for
Qwen2-MoE, Qwen3-MoE and Mixtral, per-expert POP against a NumPy reference, the rule for experts
no prompt token reached, compile counts, traces and the error paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import popjax
from popjax import engine
from popjax.convert import convert as conv
from popjax.convert.readers import CheckpointError
from popjax.requests import pad_batch
from popjax.loading import build_model
from popjax.methods import ffn_ratio
from popjax.models.config import ConfigError, ModelConfig
from popjax.models.moe import moe_mlp
from tests.conftest import random_prompts

ATOL = 1e-4
BASE = dict(
    vocab_size=160, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)
# name -> (model class, config class, fields). qwen2-moe-mixed: a dense layer (mlp_only_layers) and
# a shared expert whose width is no multiple of the expert width (a zero-padded block).
MOE_CONFIGS = {
    "qwen2-moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
        num_experts_per_tok=2)),
    "qwen2-moe-mixed": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        intermediate_size=80, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16,
        norm_topk_prob=True)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)),
}


def _make(name: str, directory):
    import transformers

    model_cls, config_cls, extra = MOE_CONFIGS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**BASE, **extra)).eval()
    with torch.no_grad():  # HF initialises biases and the router at zero-ish scales; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            directory = tmp_path_factory.mktemp(name)
            cache[name] = (directory, _make(name, directory))
        return cache[name]

    return get


def _hf_router_choices(hf_model, ids):
    """Top-k expert ids per layer that transformers picks: {layer: [T, k]}."""
    got, hooks = {}, []
    for i, layer in enumerate(hf_model.model.layers):
        block = getattr(layer, "block_sparse_moe", None) or layer.mlp
        if hasattr(block, "gate"):
            hooks.append(block.gate.register_forward_hook(lambda m, a, out, i=i: got.__setitem__(i, out[2].numpy())))
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].numpy()
    for h in hooks:
        h.remove()
    return logits, got


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_prefill_decode_and_router_match_transformers(name, moe_checkpoints):
    directory, hf_model = moe_checkpoints(name)
    model = popjax.load(directory, cache=False)
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, (5, 9, 13), model.config.vocab_size)
    continuations = random_prompts(rng, [6] * 3, model.config.vocab_size)
    expected = [_hf_router_choices(hf_model, p + c) for p, c in zip(prompts, continuations)]

    tokens, mask = pad_batch(prompts, pad_id=0)
    T = tokens.shape[1]
    plan = popjax.Dense().bind(model.config)
    mixed = name.endswith("mixed")  # layers of two kinds: their aux cannot be stacked over layers
    logits, _, _, aux = engine.prefill(
        model.graphdef, model.params, jnp.asarray(tokens), jnp.asarray(mask), plan, all_logits=True, with_aux=not mixed
    )
    for row, p in enumerate(prompts):
        np.testing.assert_allclose(np.asarray(logits)[row, T - len(p):], expected[row][0][: len(p)], atol=ATOL, rtol=0)
        if not mixed:  # router choices identical (as sets: the order of equal-weight picks is free)
            ours = np.sort(np.asarray(aux["router_topk"])[:, row, T - len(p):], axis=-1)
            want = np.sort(np.stack([expected[row][1][i][: len(p)] for i in sorted(expected[row][1])]), axis=-1)
            np.testing.assert_array_equal(ours, want)

    # the continuations fed one token at a time through the decode path and the KV cache
    record = () if mixed else ("router_topk",)
    targets = np.resize(np.asarray(continuations), (tokens.shape[0], 6))  # rows of the batch bucket
    _, logp, rec = engine.teacher_force(
        model.graphdef, model.params, plan, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(targets),
        with_logprobs=True, record=record,
    )
    for row, p in enumerate(prompts):
        want = torch.log_softmax(torch.tensor(expected[row][0][len(p) - 1 : len(p) + 5]), -1).numpy()
        np.testing.assert_allclose(np.asarray(logp)[row], want, atol=ATOL, rtol=0)
    if record:  # decode-path router choices: the step feeding continuation token i routes it
        for row, p in enumerate(prompts):
            ours = np.sort(np.asarray(rec["router_topk"])[:, :, row, 0], axis=-1)  # [N, L, k]
            want = np.stack([expected[row][1][i][len(p): len(p) + 6] for i in sorted(expected[row][1])], axis=1)
            np.testing.assert_array_equal(ours, np.sort(want, axis=-1))


# ---------------------------------------------------------------- per-expert POP vs NumPy

E, K, F_E, D, SHARED, NEVER = 8, 2, 16, 32, 40, 7  # SHARED = 2.5 blocks; expert 7 is never routed
RAW = dict(
    model_type="qwen2_moe", vocab_size=50, hidden_size=D, intermediate_size=48, moe_intermediate_size=F_E,
    shared_expert_intermediate_size=SHARED, num_experts=E, num_experts_per_tok=K, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, norm_topk_prob=False,
)


@pytest.fixture(scope="module")
def moe_layer():
    """A random one-layer Qwen2-MoE (HF-layout numpy weights in float64, and the built MoEWeights)."""
    cfg = ModelConfig.from_hf_dict(RAW)
    rng = np.random.default_rng(0)
    hf = {k: rng.normal(0, 0.3, size=s) for k, s in conv.checkpoint_shapes(cfg).items()}
    hf["layers.0.mlp.router"][NEVER] = -1.0  # inputs are positive: expert 7 loses every race
    tree = conv.unflatten({k: v.astype(np.float32) for k, v in hf.items()})
    loaded = build_model(cfg, tree, None, "test", "float32")
    return cfg, hf, nnx.merge(loaded.graphdef, loaded.params).layers[0].mlp


def _moe(mlp, fn, state, x, valid, dispatch="auto"):
    """moe_mlp under jit (eager vmaps are slow): -> (y, state, aux)."""
    graphdef, params = nnx.split(mlp)
    run = lambda p, s, x, v: moe_mlp(nnx.merge(graphdef, p), fn, s, x, v, jnp.int32(0), dispatch=dispatch)
    return jax.jit(run)(params, state, x, valid)


def _h(gate, up, x):
    g, u = x @ gate.T, x @ up.T
    return g / (1 + np.exp(-g)) * u


def _weight_score(gate, up, down):
    return np.linalg.norm(gate, axis=1) * np.linalg.norm(up, axis=1) * np.linalg.norm(down, axis=0)


def _ffns(hf):
    """[(gate, up, down, ids)] of the 8 experts, then the shared expert's 16-channel blocks (zero padded, id -1)."""
    p = "layers.0.mlp."
    out = [(hf[f"{p}experts.{e}.gate"], hf[f"{p}experts.{e}.up"], hf[f"{p}experts.{e}.down"], np.arange(F_E)) for e in range(E)]
    for b in range(-(-SHARED // F_E)):
        ids = np.arange(b * F_E, (b + 1) * F_E)
        real = ids[ids < SHARED]
        pad = lambda a, axis: np.concatenate([a, np.zeros_like(a.take(range(F_E - len(real)), axis=axis))], axis=axis)
        g, u, dn = hf[p + "shared.gate"][real], hf[p + "shared.up"][real], hf[p + "shared.down"][:, real]
        out.append((pad(g, 0), pad(u, 0), pad(dn, 1), np.where(ids < SHARED, ids, -1)))
    return out


def _reference(hf, x, valid, x_t, valid_t, n_keep, m):
    """Per-expert POP in float64 (one batch = one aggregate group): prefill y, decode y, and per
    FFN (experts, then shared blocks) the HF ids of R, C and the selected S."""
    p = "layers.0.mlp."
    probs = np.exp(x @ hf[p + "router"].T)
    probs /= probs.sum(-1, keepdims=True)
    routed = np.zeros(x.shape[:2] + (E,))  # router weight of each expert per token (0: not routed)
    for idx in np.ndindex(*x.shape[:2]):
        top = np.argsort(-probs[idx], kind="stable")[:K]
        routed[idx + (top,)] = probs[idx][top]
    probs_t = np.exp(x_t @ hf[p + "router"].T)
    probs_t /= probs_t.sum(-1, keepdims=True)
    routed_t = np.zeros(x_t.shape[:2] + (E,))
    for idx in np.ndindex(*x_t.shape[:2]):
        top = np.argsort(-probs_t[idx], kind="stable")[:K]
        routed_t[idx + (top,)] = probs_t[idx][top]
    gate_s = 1 / (1 + np.exp(-(x @ hf[p + "shared_gate"].T)))
    gate_t = 1 / (1 + np.exp(-(x_t @ hf[p + "shared_gate"].T)))
    y, y_t, parts = np.zeros_like(x), np.zeros_like(x_t), []
    for i, (g, u, dn, ids) in enumerate(_ffns(hf)):
        w, w_t = (routed[..., i], routed_t[..., i]) if i < E else (gate_s[..., 0], gate_t[..., 0])
        mine, mine_t = valid & (w > 0), valid_t & (w_t > 0)
        h = _h(g, u, x)
        norms = np.linalg.norm(dn, axis=0)
        imp = np.sqrt(np.sum(np.where(mine[..., None], h, 0) ** 2, axis=(0, 1))) * norms
        wscore = _weight_score(g, u, dn)
        order = sorted(range(F_E), key=lambda j: (-imp[j], -wscore[j], j))  # no prompt token: weight-only
        keep, R, C = order[:n_keep], order[: n_keep - m], order[n_keep - m : n_keep + m]
        y += w[..., None] * (h[..., keep] @ dn[:, keep].T)
        h_t = _h(g, u, x_t)
        scores = np.sqrt(np.sum(np.where(mine_t[..., None], h_t[..., C], 0) ** 2, axis=(0, 1))) * norms[C]
        S = [C[j] for j in sorted(range(len(C)), key=lambda j: (-scores[j], j))[:m]]
        y_t += w_t[..., None] * (h_t[..., R] @ dn[:, R].T + h_t[..., S] @ dn[:, S].T)
        parts.append((sorted(ids[R]), sorted(ids[C]), sorted(ids[S])))
    return y, y_t, parts


def _engine_fns(plan):
    """The FFN functions as popjax.engine builds them (each block gets its rows: ``valid`` narrowed
    to the tokens routed to it)."""
    prefill = lambda w, s, x, rows: plan.prefill(w, x, rows)
    decode = lambda w, s, x, rows: plan.decode(w, s, x, jnp.int32(0), rows)
    return prefill, decode


def _stored_ids(mlp, idx, i):
    order = np.asarray((mlp.experts if i < E else mlp.shared).channel_order[...])[i if i < E else i - E]
    return sorted(order[np.asarray(idx)])


@pytest.mark.parametrize("aggregate", ["shared", "per_sequence"])
@pytest.mark.parametrize("batch", [1, 3])
def test_per_expert_pop_matches_numpy(moe_layer, aggregate, batch):
    cfg, hf, mlp = moe_layer
    plan = popjax.POP(0.3, aggregate=aggregate).bind(cfg)
    rng = np.random.default_rng(batch)
    x = np.abs(rng.normal(size=(batch, 7, D)))
    valid = np.ones((batch, 7), bool)
    valid[1:, :3] = False  # left padding in the later rows
    x_t = np.abs(rng.normal(size=(batch, 1, D)))
    valid_t = np.ones((batch, 1), bool)
    valid_t[-1] = batch == 1  # a stopped row in the batch
    prefill, decode = _engine_fns(plan)
    y, state, _ = _moe(mlp, prefill, None, jnp.asarray(x, jnp.float32), jnp.asarray(valid))
    outs = {}
    for dispatch in ("dense", "auto"):  # auto gathers the ≤ 2·batch routed experts of 8
        outs[dispatch] = _moe(mlp, decode, state, jnp.asarray(x_t, jnp.float32), jnp.asarray(valid_t), dispatch)
    np.testing.assert_allclose(outs["auto"][0], outs["dense"][0], atol=1e-6)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(a, b), outs["auto"][1], outs["dense"][1])
    y_t, _, aux = outs["auto"]

    groups = [slice(None)] if aggregate == "shared" else [slice(b, b + 1) for b in range(batch)]
    for g, rows in enumerate(groups):
        want_y, want_y_t, parts = _reference(hf, x[rows], valid[rows], x_t[rows], valid_t[rows], plan.n_keep, plan.m)
        np.testing.assert_allclose(np.asarray(y)[rows] * valid[rows][..., None], want_y * valid[rows][..., None], atol=1e-5)
        np.testing.assert_allclose(np.asarray(y_t)[rows][valid_t[rows]], want_y_t[valid_t[rows]], atol=1e-5)
        for i, (R, C, S) in enumerate(parts):
            kind = "experts" if i < E else "shared"
            pick = lambda a: np.asarray(a)[i if i < E else i - E] if aggregate == "shared" else np.asarray(a)[i if i < E else i - E][g]
            assert _stored_ids(mlp, pick(state[kind]["retained_idx"]), i) == R, (g, i)
            assert _stored_ids(mlp, pick(state[kind]["candidate_idx"]), i) == C, (g, i)
            routed_now = i >= E or np.any(np.asarray(aux["router_topk"])[rows][valid_t[rows]] == i)
            if routed_now:  # unrouted experts' selections are not part of the output
                assert _stored_ids(mlp, pick(aux[kind]["selected"]), i) == S, (g, i)


def test_never_routed_expert_gets_the_weight_only_ranking(moe_layer):
    cfg, hf, mlp = moe_layer
    plan = popjax.POP(0.3, aggregate="shared").bind(cfg)
    x = jnp.asarray(np.abs(np.random.default_rng(5).normal(size=(2, 9, D))), jnp.float32)
    valid = jnp.ones((2, 9), bool)
    _, state, aux = _moe(mlp, _engine_fns(plan)[0], None, x, valid)
    assert not np.any(np.asarray(aux["router_topk"]) == NEVER)
    p = f"layers.0.mlp.experts.{NEVER}."
    score = _weight_score(hf[p + "gate"], hf[p + "up"], hf[p + "down"])
    ranking = np.argsort(-score, kind="stable")
    n_r = plan.n_keep - plan.m
    assert _stored_ids(mlp, state["experts"]["retained_idx"][NEVER], NEVER) == sorted(ranking[:n_r])
    assert _stored_ids(mlp, state["experts"]["candidate_idx"][NEVER], NEVER) == sorted(ranking[n_r : n_r + 2 * plan.m])


def test_global_ratio_counts_activated_parameters(moe_layer):
    cfg, _, _ = moe_layer
    attn = D * 32 + 2 * D * 16 + 32 * D + (32 + 2 * 16)  # q, k, v, o and q/k/v biases (head_dim 8)
    activated = 3 * D * (K * F_E + SHARED)
    assert ffn_ratio(cfg, 0.3) == pytest.approx(0.3 * (attn + activated) / activated)
    assert popjax.POP(0.3).bind(cfg).f == F_E  # the budget is per expert-width block


# ---------------------------------------------------------------- engine: compiles, traces


@pytest.mark.slow  # four generations' programs (~4 s); tests/models/test_scan.py counts compiles per bucket quickly
def test_generation_compiles_once_per_bucket_and_traces_experts(moe_checkpoints):
    model = popjax.load(moe_checkpoints("qwen3-moe")[0], cache=False)
    prompts = random_prompts(np.random.default_rng(3), (4, 7, 12, 20), model.config.vocab_size)
    for method in (popjax.Dense(), popjax.POP(0.4, aggregate="per_sequence")):
        popjax.generate_ids(model, [prompts[0]], max_new_tokens=6, method=method)
        before = engine.compile_counts()
        popjax.generate_ids(model, [prompts[1]], max_new_tokens=6, method=method)
        popjax.generate_ids(model, [prompts[2]], max_new_tokens=9, method=method)
        assert engine.compile_counts() == before, method
    plan = popjax.POP(0.2, aggregate="shared").bind(model.config)
    ids, trace = popjax.generate_ids(model, prompts[:2], max_new_tokens=5, method=popjax.POP(0.2, aggregate="shared"), return_trace=True, stop_ids=[])
    L = model.config.num_hidden_layers
    assert trace["partition"]["experts"]["retained_idx"].shape == (L, 8, plan.n_keep - plan.m)
    assert trace["prefill"]["experts"]["importance"].shape == (L, 8, 32)
    assert trace["decode"]["experts"]["selected"].shape == (4, L, 8, plan.m)
    assert trace["decode"]["router_topk"].shape == (4, L, 2, 1, 2)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(scoring_func="sigmoid"), r"router type scoring_func='sigmoid'.*supported: \['softmax'\]"),
        (dict(hidden_act="gelu"), r"expert type hidden_act='gelu'.*\['silu'\]"),
        (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 exceeds num_experts=8"),
        (dict(num_experts=0), r"num_experts=0 is invalid"),
        (dict(mlp_only_layers=[3]), r"mlp_only_layers=\[3\]"),
    ],
)
def test_bad_moe_configs_name_the_value(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict({**RAW, **change})


def test_missing_expert_tensor_is_named(moe_checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    directory, _ = moe_checkpoints("mixtral")
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"lacks 1 parameter\(s\): layers\.1\.mlp\.experts\.5\.up"):
        popjax.load(tmp_path, cache=False)


def test_config_round_trips_through_hf_fields():
    for raw in (RAW, {**RAW, "model_type": "mixtral", "num_local_experts": 4, "intermediate_size": 16}):
        cfg = ModelConfig.from_hf_dict(raw)
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    dense = ModelConfig.from_hf_dict({**RAW, "model_type": "qwen2"})
    assert "moe" not in dense.to_hf_dict() and "num_experts" not in dense.to_hf_dict()
