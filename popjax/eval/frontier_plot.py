"""Plots of `popjax.eval.frontier` records: NLL and KL against FFN weight bytes per decode token,
and NLL against measured decode tokens/s, one color per method family, one marker per ratio,
the Pareto front of each ratio as a line."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

MARKERS = "osD^vP*Xph"
LINESTYLES = ("--", ":", "-.", (0, (5, 1)))


def _front_line(points: list[tuple[float, float]], increasing_y: bool) -> tuple[list[float], list[float]]:
    """The front's points in x order (as a line)."""
    pts = sorted(points, key=lambda p: (p[0], -p[1] if increasing_y else p[1]))
    return [p[0] for p in pts], [p[1] for p in pts]


def _scatter(records: list[dict[str, Any]], x: Callable[[dict], float], y: str, front: Callable[[dict], bool], ax,
             overall: Callable[[dict], bool] | None = None, increasing_y: bool = False, per_ratio: bool = True) -> None:
    """One point per record (color: method family, marker: ratio; the dense reference a black
    star), front members ringed and joined per ratio; ``overall`` members joined by a wide gray line."""
    families = list(dict.fromkeys(r["method"] for r in records if r["method"] != "dense"))
    ratios = sorted({r["ratio"] for r in records if r["method"] != "dense"})
    color = {fam: f"C{i % 10}" for i, fam in enumerate(families)}
    marker = {ratio: MARKERS[i % len(MARKERS)] for i, ratio in enumerate(ratios)}
    for r in records:
        if r["method"] == "dense":
            ax.scatter(x(r), r[y], marker="*", s=160, color="black", zorder=4)
            continue
        ax.scatter(x(r), r[y], marker=marker[r["ratio"]], color=color[r["method"]], s=36, zorder=3,
                   edgecolors="black" if front(r) else "none", linewidths=1.2)
        if r.get("gamma") is not None:  # the band of POP-like methods, small beside its point
            ax.annotate(f"γ{r['gamma']:g}", (x(r), r[y]), fontsize=6, xytext=(3, 3), textcoords="offset points", color=color[r["method"]])
    for i, ratio in enumerate(ratios if per_ratio else []):
        pts = [(x(r), r[y]) for r in records if r["ratio"] == ratio and r["method"] != "dense" and front(r)]
        if len(pts) > 1:
            ax.plot(*_front_line(pts, increasing_y), color="black", lw=1, ls=LINESTYLES[i % len(LINESTYLES)], zorder=2)
    pts = [(x(r), r[y]) for r in records if overall is not None and overall(r)]
    if len(pts) > 1:
        ax.plot(*_front_line(pts, increasing_y), color="gray", lw=5, alpha=0.35, zorder=1, label="front over all")
    handles = [ax.scatter([], [], color=color[f], marker="o", label=f) for f in families]
    handles += [ax.scatter([], [], color="gray", marker=marker[q], label=f"ratio {q:.2f}") for q in ratios]
    if any(r["method"] == "dense" for r in records):
        handles.append(ax.scatter([], [], color="black", marker="*", s=120, label="dense"))
    if per_ratio:
        handles += ax.plot([], [], color="black", lw=1, ls=LINESTYLES[0], label="Pareto front per ratio (ringed)")
    if overall is not None:
        handles += ax.plot([], [], color="gray", lw=5, alpha=0.35, label="Pareto front over all")
    ax.legend(handles=handles, fontsize=7, ncol=2)
    ax.grid(alpha=0.3)


def plot_frontier(records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """``nll_vs_ffn_bytes.png``, ``kl_vs_ffn_bytes.png`` and, when records carry
    ``decode_tokens_per_s``, ``nll_vs_tokens_per_s.png``. Returns the PNG paths."""
    import matplotlib  # optional: plots need the eval extra (matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: see above

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dense_mb = next((r["ffn_bytes_per_token"] / r["ffn_bytes_fraction"] for r in records), 1.0) / 1e6
    mb = lambda r: r["ffn_bytes_per_token"] / 1e6  # noqa: E731
    paths = []
    for y, key, label in (("nll", "pareto", "online NLL (nats)"), ("kl", "pareto_kl", "KL(dense ‖ method) (nats)")):
        fig, ax = plt.subplots(figsize=(8, 5))
        overall = (lambda r: r.get("pareto_overall", False)) if y == "nll" else None
        _scatter(records, mb, y, lambda r, k=key: r.get(k, False), ax, overall)
        top = ax.secondary_xaxis("top", functions=(lambda v: v / dense_mb, lambda v: v * dense_mb))
        top.set_xlabel("fraction of dense FFN bytes")
        ax.set(xlabel="FFN weight MB read per decode token (batch 1)", ylabel=label, title=f"{y.upper()} vs FFN bytes per token")
        fig.tight_layout()
        paths.append(out_dir / f"{y}_vs_ffn_bytes.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    timed = [r for r in records if r.get("decode_tokens_per_s") is not None]
    if timed:
        fig, ax = plt.subplots(figsize=(8, 5))
        speed_front = lambda r: r.get("pareto_speed", False)  # noqa: E731
        _scatter(timed, lambda r: r["decode_tokens_per_s"], "nll", speed_front, ax, overall=speed_front, increasing_y=True, per_ratio=False)
        ax.set(xlabel="measured decode tokens/s (popjax bench)", ylabel="online NLL (nats)", title="NLL vs measured decode speed")
        fig.tight_layout()
        paths.append(out_dir / "nll_vs_tokens_per_s.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
