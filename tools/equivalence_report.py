"""The comparison half of tools/method_equivalence.py: a run recorded before a refactor against the
same run now (equal greedy tokens and argmax ids, max |Δ log-prob| within a tolerance), with the
log-probs stored as base64 float32."""

from __future__ import annotations

import base64

import numpy as np


def encode(a) -> str:
    return base64.b64encode(np.ascontiguousarray(a, "<f4").tobytes()).decode()


def decode(s: str):
    return np.frombuffer(base64.b64decode(s), "<f4")


def compare_run(want: dict, got: dict, tol: float) -> dict:
    """One (model, method, layout): equal tokens and argmax ids, max |Δ log-prob|, and ok."""
    if "error" in want:
        return {"ok": True, "before": "error", "after": "error" if "error" in got else "ran", "error": want["error"],
                **({"error_now": got["error"]} if "error" in got and got["error"] != want["error"] else {})}
    if "error" in got:
        return {"ok": False, "before": "ran", "after": "error", "error": got["error"]}
    delta = max(float(np.abs(decode(got[k]) - decode(want[k])).max()) for k in ("target_logprob", "argmax_logprob"))
    same = got["tokens"] == want["tokens"] and got["argmax"] == want["argmax"]
    bits = all(got[k] == want[k] for k in ("target_logprob", "argmax_logprob"))
    return {"ok": same and delta <= tol, "tokens_equal": got["tokens"] == want["tokens"],
            "argmax_equal": got["argmax"] == want["argmax"], "max_abs_dlogprob": delta, "bit_identical": bits and same}


def compare(reference: dict, current: dict, tol: float) -> dict:
    """Every run of ``current`` against ``reference``. A scanned run the reference could not make
    (an error there) that runs now is held to the reference's unrolled run of the same method."""
    rows = {}
    for model, methods in current["models"].items():
        for label, entry in methods.items():
            for layout, got in entry.items():
                if layout == "method":
                    continue
                want = reference["models"][model][label]
                if "error" in want[layout] and "error" not in got and "error" not in want.get("unrolled", {"error": ""}):
                    row = {**compare_run(want["unrolled"], got, tol), "before": "error", "after": "ran", "against": "unrolled",
                           "error": want[layout]["error"]}
                else:
                    row = compare_run(want[layout], got, tol)
                other = want.get("scanned" if layout == "unrolled" else "unrolled", {"error": ""})
                if "tokens_equal" in row and "error" not in other:  # a diagnosis: does a path now compute as the other did?
                    cross = compare_run(other, got, tol)
                    row["vs_before_other_layout"] = {k: cross[k] for k in ("tokens_equal", "max_abs_dlogprob", "bit_identical")}
                rows[f"{model} {label} {layout}"] = row
    failed = sorted(k for k, r in rows.items() if not r["ok"])
    return {"tol": tol, "runs": len(rows), "failed": failed, "bit_identical": sum(bool(r.get("bit_identical")) for r in rows.values()),
            "max_abs_dlogprob": max([r.get("max_abs_dlogprob", 0.0) for r in rows.values()], default=0.0), "results": rows}


def describe(row: dict) -> str:
    """One line for a compared run."""
    text = f"tokens_equal={row['tokens_equal']} max|Δlogp|={row['max_abs_dlogprob']:.3g}" if "tokens_equal" in row else ""
    if row.get("before") == "ran":
        return f"ran before, error now: {row['error']}"
    if "error" in row:
        held = ", held to the unrolled run" if "against" in row else ""
        text += f" (error before: {row['error']}; now: {row.get('error_now', row['after'])}{held})"
    return text.strip()
