"""What XLA:CPU makes of int8 weights: compiles FFN formulations on int8 and fp32 weights of the
default model's FFN size and reports, from the optimised HLO, whether the int8→float convert is
fused into the dot (no float copy of the weights is written) and whether the dot is split over
the cores (``outer_dimension_partitions``), with the time of each (median of repeats).

    python benchmarks/int8_hlo.py --json int8_hlo.json [--hlo-dir hlo/]

Formulations, each at batch 1 and 8, over L stacked layers inside one jitted ``lax.scan`` (as a
decode step runs them):
  dense        x · convert(q)ᵀ · s           the dense FFN (gate/up [2f, d] then down [d, f])
  compact      the same on a prefill-made compact copy of 60% of the channels (static, POP's R ∪ C)
  gather_rows  rows gathered inside the step (jnp.take of 60% of the rows, then the dot)
  dequant_mul  convert(q) · s multiplied into the weight before the dot (the formulation avoided)
  group32      group-wise int8 (a scale per 32 input channels, as GGUF's Q8_0): one batched dot
               over the groups, the scales applied to its [B, n, groups] output, then summed
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

D, F, L = 576, 1536, 30  # SmolLM2-135M


def _time(fn, *args, repeats: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def ffn(x, gate_up, down, gu_scale=None, d_scale=None, dequant_first=False):
    """x [B, d]; gate_up [2n, d]; down [d, n] (int8 with scales, or float)."""
    if gu_scale is not None and dequant_first:
        gate_up = gate_up.astype(jnp.float32) * gu_scale
        down = down.astype(jnp.float32) * d_scale
        gu_scale = d_scale = None
    gu = jnp.einsum("bd,nd->bn", x, gate_up.astype(x.dtype))
    if gu_scale is not None:
        gu = gu * gu_scale[:, 0]
    n = gu.shape[-1] // 2
    h = jax.nn.silu(gu[:, :n]) * gu[:, n:]
    y = jnp.einsum("bn,dn->bd", h, down.astype(x.dtype))
    return y * d_scale[:, 0] if d_scale is not None else y


GROUP = 32


def group_dot(x, q, scale):
    """x [B, k]; q [n, k] int8; scale [n, k / GROUP] -> [B, n]."""
    n, k = q.shape
    xg = x.reshape(x.shape[0], k // GROUP, GROUP)
    partial = jnp.einsum("bgi,ngi->bng", xg, q.reshape(n, k // GROUP, GROUP).astype(x.dtype))
    return jnp.sum(partial * scale, axis=-1)


def stack_fn(kind: str, int8: bool):
    def layer(x, w):
        if kind == "group32":
            gu = group_dot(x, w["gate_up"], w["gu_scale"])
            n = gu.shape[-1] // 2
            h = jax.nn.silu(gu[:, :n]) * gu[:, n:]
            return group_dot(h, w["down"], w["d_scale"]), None
        if kind == "gather_rows":
            ids = w["ids"]
            gate_up = jnp.take(w["gate_up"].reshape(2, F, D), ids, axis=1).reshape(-1, D)
            down = jnp.take(w["down"], ids, axis=1)
            gs = jnp.take(w["gu_scale"].reshape(2, F, 1), ids, axis=1).reshape(-1, 1) if int8 else None
            return ffn(x, gate_up, down, gs, w.get("d_scale")), None
        return ffn(x, w["gate_up"], w["down"], w.get("gu_scale"), w.get("d_scale"), dequant_first=kind == "dequant_mul"), None

    @jax.jit
    def run(x, ws):
        return jax.lax.scan(lambda x, w: (x + layer(x, w)[0], None), x, ws)[0]

    return run


def weights(kind: str, int8: bool, rng):
    width = int(0.6 * F) if kind == "compact" else F
    w = {"gate_up": rng.normal(0, 0.02, (L, 2 * width, D)).astype(np.float32),
         "down": rng.normal(0, 0.02, (L, D, width)).astype(np.float32)}
    if int8 and kind == "group32":
        for name in ("gate_up", "down"):
            blocks = w[name].reshape(L, w[name].shape[1], -1, GROUP)
            scale = (np.abs(blocks).max(-1) / 127).astype(np.float32)
            w[name] = np.clip(np.rint(blocks / scale[..., None]), -127, 127).astype(np.int8).reshape(w[name].shape)
            w["gu_scale" if name == "gate_up" else "d_scale"] = scale
    elif int8:
        for name in ("gate_up", "down"):
            amax = np.abs(w[name]).max(-1, keepdims=True)
            scale = (amax / 127).astype(np.float32)
            w[name] = np.clip(np.rint(w[name] / scale), -127, 127).astype(np.int8)
            w["gu_scale" if name == "gate_up" else "d_scale"] = scale
    if kind == "gather_rows":
        w["ids"] = np.stack([np.sort(rng.choice(F, int(0.6 * F), replace=False)) for _ in range(L)]).astype(np.int32)
    return {k: jnp.asarray(v) for k, v in w.items()}


def analyse(hlo: str) -> dict:
    """Facts of the optimised HLO text: float copies of int8 weights, fused converts, partitions."""
    converts_in_fusions = len(re.findall(r"fused_computation[^{]*\{[^}]*convert[^}]*dot\(|dot\([^}]*convert", hlo))
    return {
        "dots": len(re.findall(r"\bdot\(", hlo)),
        "outer_dimension_partitions": len(re.findall(r"outer_dimension_partitions", hlo)),
        "int8_to_float_converts": len(re.findall(r"f32\[[^\]]*\][^=]*= *f32\[[^\]]*\]\{[^}]*\} convert\(s8", hlo))
        + len(re.findall(r"= f32\[[^\]]*\]\S* convert\([^)]*s8", hlo)),
        "fusions_with_dot": len(re.findall(r"kind=kOutput|kind=kLoop[^\n]*calls=[^\n]*dot", hlo)),
        "convert_fused_with_dot": converts_in_fusions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="int8_hlo.json")
    parser.add_argument("--hlo-dir", default=None, help="also write each optimised HLO here")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for kind in ("dense", "compact", "gather_rows", "dequant_mul", "group32"):
        for int8 in (False, True):
            if kind in ("dequant_mul", "group32") and not int8:
                continue
            ws = weights(kind, int8, rng)
            run = stack_fn(kind, int8)
            for batch in (1, 8):
                x = jnp.asarray(rng.normal(size=(batch, D)).astype(np.float32))
                hlo = run.lower(x, ws).compile().as_text()
                if args.hlo_dir:
                    Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
                    (Path(args.hlo_dir) / f"{kind}-{'int8' if int8 else 'fp32'}-b{batch}.hlo").write_text(hlo)
                rows.append({"kind": kind, "weights": "int8" if int8 else "fp32", "batch": batch,
                             "ms_per_stack": 1000 * _time(run, x, ws), **analyse(hlo)})
                print(rows[-1])
    Path(args.json).write_text(json.dumps({"d": D, "f": F, "layers": L, "devices": str(jax.devices()), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
