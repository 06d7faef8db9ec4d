"""A float64 NumPy Gemma 3 (`RefGemma3`) and the fixtures the Gemma 3 method tests share
(tests/methods/test_gemma3_methods.py, tests/methods/test_gemma3_prefill_only.py).

`RefGemma3` is built from the transformers model's weights and config (not popjax's): it feeds
any number of tokens per row after what its caches hold, keeps every key/value of the sequence
(sliding layers mask by position instead of keeping a ring), and runs a caller's FFN function per
layer, so POP, GRIFFIN and CATS (the references of tests/reference/methods.py, whose layers carry
the GeGLU activation as ``W["act"]``, tests/reference/ffn.py) run inside a whole Gemma model. tests/methods/test_gemma3_methods.py anchors it to
transformers' own logits first.
"""

from __future__ import annotations

import math

import numpy as np

import popjax
from popjax.calibration import Corpus
from tests.conftest import random_prompts
from tests.reference.ffn import ref_gate, ref_hidden, ref_rank
from tests.reference.lm import log_softmax
from tests.reference.methods import ref_griffin_scores, ref_pop_decode, ref_prefill

ATOL = 1e-4  # fp32 engine vs float64 reference, logits through every layer
SWEEP_MODEL = "gemma3-last-sliding"  # 3 layers (sliding, full, sliding), window 6, soft-capped logits, untied
PROMPT_LENGTHS = (13, 9)  # both longer than the window of 6
N_TARGETS = 6  # decode steps, past the window again
SKIP = (0, 2)  # the Prefill-Only layers of the sweep: both sliding layers


# ------------------------------------------------------------------ the NumPy Gemma 3


def _inv_freq(params: dict, h: int) -> np.ndarray:
    """Inverse frequencies of one rope block of HF ``rope_parameters`` (default or linear)."""
    assert params["rope_type"] in ("default", "linear"), params
    inv = 1.0 / params["rope_theta"] ** (np.arange(0, h, 2) / h)
    return inv / params.get("factor", 1.0) if params["rope_type"] == "linear" else inv


class RefGemma3:
    """Gemma 3 in float64 NumPy from a transformers ``Gemma3ForCausalLM`` (its state dict and
    config): embeddings × √d, (1 + w) RMSNorms, q/k norms, RoPE of each layer's kind (sliding
    layers: their own base), scores × query_pre_attn_scalar^-½, sliding windows by position,
    sandwich norms, logits soft-capped."""

    def __init__(self, hf):
        cfg = hf.config
        self.sd = {k: v.detach().double().numpy() for k, v in hf.state_dict().items()}
        self.head = hf.lm_head.weight.detach().double().numpy()  # the embedding when tied
        self.L, self.d, self.eps = cfg.num_hidden_layers, cfg.hidden_size, cfg.rms_norm_eps
        self.n_q, self.n_kv, self.h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.kinds = list(cfg.layer_types)
        self.sliding_window = cfg.sliding_window
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.cap = cfg.final_logit_softcapping
        self.inv_freq = {kind: _inv_freq(cfg.rope_parameters[kind], self.h) for kind in set(self.kinds)}
        self.W = [self._ffn(l, cfg.hidden_activation) for l in range(self.L)]

    def p(self, l: int, name: str) -> np.ndarray:
        return self.sd[f"model.layers.{l}.{name}"]

    def _ffn(self, l, act):
        """Layer l's FFN in math layout (tests/reference/ffn.py), carrying its gate activation."""
        return {"gate": self.p(l, "mlp.gate_proj.weight").T, "up": self.p(l, "mlp.up_proj.weight").T,
                "down": self.p(l, "mlp.down_proj.weight").T, "act": act}

    def norm(self, x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * (1.0 + weight)

    def window(self, l: int) -> int | None:
        return self.sliding_window if self.kinds[l] == "sliding_attention" else None

    def rope(self, x, pos, l):
        """x [T, n, h] at positions pos [T], with layer l's kind's frequencies."""
        ang = pos[:, None] * self.inv_freq[self.kinds[l]][None]
        ang = np.concatenate([ang, ang], axis=-1)[:, None]
        rot = np.concatenate([-x[..., self.h // 2 :], x[..., : self.h // 2]], axis=-1)
        return x * np.cos(ang) + rot * np.sin(ang)

    def kv_rows(self, l):
        """[W_k; W_v] [2·kv_dim, d], the layout of a K/V calibration."""
        return np.concatenate([self.p(l, "self_attn.k_proj.weight"), self.p(l, "self_attn.v_proj.weight")])

    def keys_values(self, l, x, pos, rows=None):
        """Layer l's keys (k-normed, RoPE'd) and values for residual input x [T, d] at pos [T],
        projected by ``rows`` (default the layer's own [W_k; W_v])."""
        rows = self.kv_rows(l) if rows is None else rows
        kv = self.norm(x, self.p(l, "input_layernorm.weight")) @ rows.T
        k, v = np.split(kv, 2, axis=-1)
        k = self.norm(k.reshape(len(x), self.n_kv, self.h), self.p(l, "self_attn.k_norm.weight"))
        return self.rope(k, pos, l), v.reshape(len(x), self.n_kv, self.h)

    def queries(self, l, x, pos):
        q = (self.norm(x, self.p(l, "input_layernorm.weight")) @ self.p(l, "self_attn.q_proj.weight").T).reshape(len(x), self.n_q, self.h)
        return self.rope(self.norm(q, self.p(l, "self_attn.q_norm.weight")), pos, l)

    def attend(self, l, q, q_pos, k, v, k_pos):
        """Queries q [T, n_q, h] at q_pos over keys/values [S, n_kv, h] at k_pos, causal and within
        the layer's window -> the output after o_proj [T, d]."""
        allowed = k_pos[None] <= q_pos[:, None]
        if self.window(l) is not None:
            allowed &= q_pos[:, None] - k_pos[None] < self.window(l)
        group = self.n_q // self.n_kv
        out = np.zeros(q.shape)
        for head in range(self.n_q):
            s = np.where(allowed, q[:, head] @ k[:, head // group].T * self.scale, -np.inf)
            a = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, head] = (a / a.sum(axis=1, keepdims=True)) @ v[:, head // group]
        return out.reshape(len(q), -1) @ self.p(l, "self_attn.o_proj.weight").T

    def dense(self, l, X, valid):
        return ref_hidden(self.W[l], X) @ self.W[l]["down"]

    def forward(self, rows, caches, ffn=None, skip=(), gates=None, record=None):
        """Feeds ``rows[b]`` (token ids) after the tokens ``caches[b]`` holds ([L] of (K, V) for
        every earlier position, or None) -> logits per row [T_b, V]; the caches grow.

        ``ffn(l, X [B, T, d], valid [B, T]) -> Y`` runs layer l's FFN on all rows at once
        (right-padded; default dense). Layers in ``skip`` only write their keys/values and pass
        x through (Prefill-Only Pruning's prefill). ``gates[b]`` [L, T_b] scale both residual
        branches; ``record`` collects each layer's input rows (then the final stream)."""
        ffn = ffn or self.dense
        xs = [self.sd["model.embed_tokens.weight"][np.asarray(r)] * math.sqrt(self.d) for r in rows]
        gate = lambda b, l: 1.0 if gates is None else gates[b][l][:, None]
        for l in range(self.L):
            if record is not None:
                record.append([x.copy() for x in xs])
            for b, x in enumerate(xs):
                n_old = 0 if caches[b][l] is None else len(caches[b][l][0])
                pos = np.arange(n_old, n_old + len(x))
                k, v = self.keys_values(l, x, pos)
                if caches[b][l] is not None:
                    k, v = np.concatenate([caches[b][l][0], k]), np.concatenate([caches[b][l][1], v])
                caches[b][l] = (k, v)
                if l not in skip:
                    o = self.attend(l, self.queries(l, x, pos), pos, k, v, np.arange(len(k)))
                    xs[b] = x + gate(b, l) * self.norm(o, self.p(l, "post_attention_layernorm.weight"))
            if l in skip:
                continue
            T = max(len(x) for x in xs)
            X, valid = np.zeros((len(xs), T, self.d)), np.zeros((len(xs), T), bool)
            for b, x in enumerate(xs):
                X[b, : len(x)], valid[b, : len(x)] = self.norm(x, self.p(l, "pre_feedforward_layernorm.weight")), True
            Y = ffn(l, X, valid)
            xs = [x + gate(b, l) * self.norm(Y[b, : len(x)], self.p(l, "post_feedforward_layernorm.weight")) for b, x in enumerate(xs)]
        if record is not None:
            record.append(xs)
        logits = [self.norm(x, self.sd["model.norm.weight"]) @ self.head.T for x in xs]
        return logits if self.cap is None else [np.tanh(z / self.cap) * self.cap for z in logits]

    def empty_caches(self, rows: int):
        return [[None] * self.L for _ in range(rows)]

    def hidden_states(self, windows) -> list[np.ndarray]:
        """Dense residual stream entering each layer (index L: the final one), [n, T, d] each."""
        record = []
        self.forward([list(w) for w in windows], self.empty_caches(len(windows)), record=record)
        return [np.stack(rows) for rows in record]


class FirstCallPrefill:
    """A method's FFN per layer: the first call at a layer is its prefill, every later call a
    decode step. A layer that skipped prefill (Prefill-Only Pruning) thus builds its state from
    its first call, the boundary token, as the engine runs it."""

    def __init__(self, ref: RefGemma3):
        self.ref, self.state, self.aux = ref, {}, {}
        self.steps = {l: [] for l in range(ref.L)}  # per layer, what each decode step chose

    def __call__(self, l, X, valid):
        W = self.ref.W[l]
        if l not in self.state:
            Y, self.state[l], self.aux[l] = self.prefill(W, X, valid)
            return Y
        Y, chosen = self.decode(W, self.state[l], X, l)
        self.steps[l].append(chosen)
        return Y


class RefPOP(FirstCallPrefill):
    """POP, shared mode (tests/reference/methods.py's reference): the partition from the
    prompt's valid tokens, then the top m of C by exact score at every step."""

    def __init__(self, ref, n_keep, m):
        super().__init__(ref)
        self.n_keep, self.m = n_keep, m

    def prefill(self, W, X, valid):
        Y, R, C, importance = ref_prefill(W, X, valid, self.n_keep, self.m)
        return Y, (R, C), importance

    def decode(self, W, state, X, l):
        return ref_pop_decode(W, *state, X, self.m)


class RefGRIFFIN(FirstCallPrefill):
    """GRIFFIN, shared mode: a dense prompt, then the top n_keep by token-normalised prompt scores."""

    def __init__(self, ref, n_keep):
        super().__init__(ref)
        self.n_keep = n_keep

    def prefill(self, W, X, valid):
        scores = ref_griffin_scores(W, X, valid)
        return ref_hidden(W, X) @ W["down"], ref_rank(scores)[: self.n_keep], scores

    def decode(self, W, kept, X, l):
        return ref_hidden(W, X)[..., kept] @ W["down"][kept], kept


class RefCATS(FirstCallPrefill):
    """CATS, "max" rule: a dense prompt; at a step the gate activations act(x W_g) whose largest
    magnitude over the batch's rows is ≤ the layer's threshold are zeroed (docs/methods.md §5.6)."""

    def __init__(self, ref, thresholds):
        super().__init__(ref)
        self.t = thresholds

    def prefill(self, W, X, valid):
        return ref_hidden(W, X) @ W["down"], None, None

    def decode(self, W, _, X, l):
        gate = ref_gate(W, X)
        keep = np.abs(gate).max(axis=(0, 1)) > self.t[l]
        return (np.where(keep, gate, 0.0) * (X @ W["up"])) @ W["down"], keep


def run_reference(ref, prompts, targets, ffn=None, skip=()):
    """Prefill (with ``skip``: of all but the last prompt token, which then runs as the full
    model's boundary step), then feed each target: -> (log-probabilities [B, N, V] of the
    teacher-forced positions, the caches)."""
    caches = ref.empty_caches(len(prompts))
    if skip:
        ref.forward([p[:-1] for p in prompts], caches, ffn, skip)
        logits = ref.forward([p[-1:] for p in prompts], caches, ffn)
    else:
        logits = ref.forward(prompts, caches, ffn)
    steps = [np.stack([z[-1] for z in logits])]
    for i in range(targets.shape[1]):
        steps.append(np.stack([z[-1] for z in ref.forward([[t] for t in targets[:, i]], caches, ffn)]))
    return log_softmax(np.stack(steps[:-1], axis=1)), caches  # the last target is fed (its step selects) but not scored


def sweep_data(vocab: int):
    rng = np.random.default_rng(7)
    return random_prompts(rng, PROMPT_LENGTHS, vocab), np.asarray(random_prompts(rng, [N_TARGETS] * 2, vocab))


def calibration_corpus(n_windows: int = 6, window: int = 16, seed: int = 1) -> Corpus:
    rng = np.random.default_rng(seed)
    return Corpus.from_token_ids("random", rng.integers(3, 160, n_windows * window), window=window)


def _ring_holds(ring, ref_kv, row, prompt_length, T):
    """A sliding layer's ring after prefill ([B, R, n_kv, h]) against the reference's keys (or
    values) of the whole prompt [n, n_kv, h]: cache index c (token c − (T − n)) lives in slot
    c mod R; the last R indices are there, padding slots are not compared. -> slots compared."""
    R = ring.shape[1]
    compared = 0
    for c in range(T - R, T):
        j = c - (T - prompt_length)
        if j >= 0:
            np.testing.assert_allclose(np.asarray(ring[row, c % R]), ref_kv[j], atol=1e-5, rtol=0)
            compared += 1
    return compared
