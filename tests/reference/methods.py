"""NumPy references of the methods' plans (docs/methods.md §2, §5), written independently of
popjax with loops over float64 copies: POP's shared-mode prefill and decode step, dynamic's step,
GRIFFIN's scores and FLAP's selection. Layers W are `tests.reference.ffn.random_layer`'s dicts
(math layout: W_g, W_u [d, f], W_d [f, d])."""

from __future__ import annotations

import math

import numpy as np

from tests.reference.ffn import ref_down_norms, ref_hidden, ref_rank


def ref_prefill(W, X, valid, n_keep, m):
    """Shared-mode POP prefill over the whole batch: -> (Y, R, C, importance)."""
    H = ref_hidden(W, X)
    dn = ref_down_norms(W)
    f = H.shape[-1]
    importance = np.zeros(f)
    for j in range(f):
        total = 0.0
        for b in range(X.shape[0]):
            for t in range(X.shape[1]):
                if valid[b, t]:
                    total += H[b, t, j] ** 2
        importance[j] = math.sqrt(total) * dn[j]
    order = ref_rank(importance)
    n_r = n_keep - m
    keep = order[:n_keep]
    Y = H[..., keep] @ W["down"][keep]
    return Y, order[:n_r], order[n_r : n_r + 2 * m], importance


def ref_pop_decode(W, R, C, x, m):
    """One shared-mode POP decode step, x [B, 1, d] -> (y, selected channel ids in score order)."""
    H = ref_hidden(W, x)
    dn = ref_down_norms(W)
    scores = {c: math.sqrt(sum(H[b, 0, c] ** 2 for b in range(x.shape[0]))) * dn[c] for c in C}
    selected = sorted(C, key=lambda c: (-scores[c], C.index(c)))[:m]
    y = sum(H[..., [j]] * W["down"][j] for j in list(R) + selected)
    return y, selected


def ref_dynamic_decode(W, x, n_keep):
    H = ref_hidden(W, x)
    dn = ref_down_norms(W)
    scores = [math.sqrt(sum(H[b, 0, j] ** 2 for b in range(x.shape[0]))) * dn[j] for j in range(H.shape[-1])]
    keep = ref_rank(scores)[:n_keep]
    return H[..., keep] @ W["down"][keep]


def ref_griffin_scores(W, X, valid):
    H = ref_hidden(W, X)
    f = H.shape[-1]
    s = np.zeros(f)
    for b in range(X.shape[0]):
        for t in range(X.shape[1]):
            if valid[b, t]:
                a = H[b, t]
                norm = math.sqrt(sum(v * v for v in a))
                for j in range(f):
                    s[j] += (a[j] / norm) ** 2
    return np.sqrt(s)


def ref_flap(H_layers, downs, n_keep, floor):
    """FLAP from dense activations. H_layers: per layer [N, f] float64 (valid tokens only);
    downs: per layer W_d [d, f]. -> (kept sets, bias [L, d])."""
    L, f = len(downs), downs[0].shape[1]
    z = []
    mus = []
    for H, down in zip(H_layers, downs):
        n = H.shape[0]
        mu = [sum(H[t, j] for t in range(n)) / n for j in range(f)]
        var = [sum((H[t, j] - mu[j]) ** 2 for t in range(n)) / n for j in range(f)]
        S = [var[j] * sum(down[i, j] ** 2 for i in range(down.shape[0])) for j in range(f)]
        m = sum(S) / f
        sd = math.sqrt(sum((s - m) ** 2 for s in S) / f)
        z.append([(s - m) / sd for s in S])
        mus.append(mu)
    kept = [set(sorted(range(f), key=lambda j, l=l: (-z[l][j], j))[:floor]) for l in range(L)]
    rest = sorted((-z[l][j], l, j) for l in range(L) for j in range(f) if j not in kept[l])
    for _, l, j in rest[: L * n_keep - L * floor]:
        kept[l].add(j)
    bias = [[sum(downs[l][i, j] * mus[l][j] for j in range(f) if j not in kept[l]) for i in range(downs[l].shape[0])] for l in range(L)]
    return [sorted(k) for k in kept], np.array(bias)
