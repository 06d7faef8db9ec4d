"""A `tpu_compile` report as a terminal table and as a plot of estimated decode tokens/s against
the pruning ratio, one line per method (dense a horizontal reference).

Every tokens/s figure here is a roofline *estimate* of `popjax.analysis.tpu_compile` (bytes per
step over HBM bandwidth: the cost analysis's bytes accessed, and the HBM bytes counted from the
optimized HLO, which the plot shows), labelled so in the table and on the plot.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

GiB = 1024**3


def _gib(n: float) -> str:
    return f"{n / GiB:7.2f}"


def format_report(report: dict[str, Any]) -> str:
    """The report as a table: per method, per-device memory of the decode loop (or, without it,
    the decode step) and of the prefill, fit, decode-step bytes (compiler, ideal) and the
    estimated tokens/s, with ratios against dense when it was compiled."""
    t = report["topology"]
    head = (f"{report['model']['source']} ({report['model']['layers']} layers), {report['dtype']}"
            f"{', int8 weights' if report['weights'] == 'int8' else ''} on {t['name']} ({t['chips']} {t['chip']} chips, "
            f"{t['devices']} devices, {t['processes']} host(s)), mesh {report['mesh']['data']}x{report['mesh']['model']}, "
            f"batch {report['batch']}, context {report['context']} (prompt bucket {report['prompt_bucket']}, "
            f"{report['capacity']} new){', scanned layers' if report['scan_layers'] else ''}")
    lines = [
        head,
        f"per device: HBM {t['hbm_per_device'] / GiB:.2f} GiB, {t['hbm_bandwidth_per_device'] / 1e9:.0f} GB/s; "
        f"memory and bytes from XLA:TPU (GiB); tok/s is an {report['estimate_note']}",
        f"{'method':<24}{'ratio':>6}{'weights':>8}{'KV':>8}{'state':>8}{'data':>8}{'decode':>8}{'prefill':>8}  fits"
        f"{'step GiB':>9}{'ideal':>8}{'est tok/s':>10}{'vs dense':>9}{'ideal x':>8}{'HBM GiB':>8}{'HBM x':>7}"
        f"{'XLA tok/s':>10}{'XLA x':>7}"
        f"{'compile s':>10}",
    ]
    for r in report["records"]:
        if "error" in r:  # XLA:TPU refused to compile it: larger than the chip's HBM
            lines.append(f"{r['method'][:23]:<24}{r['ratio']:6.2f}  does NOT fit: {r['error']}")
            continue
        progs, a, step = r["programs"], r["arguments"], r["decode_step"]
        decode = progs.get("decode_loop", progs["decode_step"])
        vs = r.get("vs_dense")
        lines.append(
            f"{r['method'][:23]:<24}{r['ratio']:6.2f}{_gib(a['weights']):>8}{_gib(a['kv_cache']):>8}{_gib(a['method_state']):>8}"
            f"{_gib(a.get('method_data', 0)):>8}"
            f"{_gib(decode['peak']):>8}{_gib(progs['prefill']['peak']) if 'prefill' in progs else 'n/c':>8}"
            f"  {'yes ' if r['fits'] else 'NO  '}"
            f"{step['bytes_accessed'] / GiB:9.3f}{step['ideal_bytes_per_device'] / GiB:8.3f}"
            f"{step['estimated_tokens_per_s']:10.1f}"
            + (f"{vs['estimated_speedup']:8.2f}x{vs['ideal_speedup']:7.2f}x" if vs else f"{'':>9}{'':>8}")
            + f"{step['hbm_bytes'] / GiB:8.3f}" + (f"{vs['hbm_estimated_speedup']:6.2f}x" if vs else f"{'':>7}")
            + (f"{step['xla_estimated_tokens_per_s']:10.1f}" if step.get("xla_estimated_tokens_per_s") else f"{'n/a':>10}")
            + (f"{vs['xla_estimated_speedup']:6.2f}x" if vs and vs.get("xla_estimated_speedup") else f"{'':>7}")
            + f"{sum(p['compile_seconds'] for p in progs.values()):10.1f}"
        )
    lines.append("data: a method's calibrated data and weight copies (TEAL's kernel layout); decode/prefill: peak per device "
                 "(arguments + outputs - aliased + temps + code; n/c: not compiled); fits: every peak, and weights + KV + state "
                 "+ data together; step GiB: bytes "
                 "accessed per device per decode step (XLA:TPU cost analysis"
                 + (", unrolled 1- and 2-layer steps extrapolated" if report["scan_layers"] else "")
                 + "; it counts weights staged into VMEM on top of HBM traffic: docs/tpu.md); ideal: the analytic "
                 "bytes; vs dense / ideal x: estimated speed-up over dense, compiler / ideal "
                 "bytes; HBM GiB: the bytes the compiled step moves to and from HBM (its optimized HLO's memory spaces); "
                 f"HBM x: the speed-up over dense estimated from them ({report['hbm_estimate_note']}); "
                 f"XLA tok/s: an {report['xla_estimate_note']}")
    missing = [f"{r['method']}: {name} needs {p['peak'] / GiB:.2f} GiB" for r in report["records"]
               for name, p in r["programs"].items() if not p["fits"]]
    missing += [f"{r['method']}: weights, KV, state and data held {r['held'] / GiB:.2f} GiB" for r in report["records"]
                if r.get("held", 0) > t["hbm_per_device"]]
    missing += [f"{r['method']}: refused by XLA:TPU" for r in report["records"] if "error" in r]
    if missing:
        lines.append(f"does not fit in {t['hbm_per_device'] / GiB:.2f} GiB per device: " + "; ".join(missing))
    # kernel="auto" that met a Pallas kernel which did not build compiled through XLA (popjax.kernels.fallback)
    fell_back = [f"{r['method']}: {r['kernel']}" for r in report["records"] if str(r.get("kernel", "")).startswith("xla (fallback")]
    if fell_back:
        lines.append("ran through XLA instead of a Pallas kernel: " + "; ".join(fell_back))
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: str | Path) -> Path:
    """Estimated decode tokens/s (from the step's HBM bytes) against the ratio, one line per method name (dense dashed) ->
    the PNG's path. Needs matplotlib (the eval extra)."""
    try:
        import matplotlib  # optional: the plot needs the eval extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)
    except ImportError:
        raise ImportError('the plot needs matplotlib: pip install -e ".[eval]"') from None
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in report["records"]:
        if "decode_step" not in r:  # did not compile (does not fit): no estimate
            continue
        series[r["name"]].append((r["ratio"], r["decode_step"]["hbm_estimated_tokens_per_s"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        points.sort()
        if name == "dense":
            ax.axhline(points[0][1], color="black", linestyle="--", label="dense")
            continue
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    t = report["topology"]
    ax.set_xlabel("pruning ratio (global)")
    ax.set_ylabel("decode tokens/s (estimate)")
    ax.set_title(f"{report['model']['source']} {report['dtype']}{' int8' if report['weights'] == 'int8' else ''} on "
                 f"{t['name']}, batch {report['batch']}: HBM bytes of the compiled step / HBM bandwidth (estimate)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
