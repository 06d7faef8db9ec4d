"""Memory plans from the TPU compiler beside popjax's analytic plan and XLA:CPU's plan of the same
programs (issue 43, "plans from the compiler"): for each published model on a TPU slice, dense and
POP 40% are planned twice with the same shapes —

* ``popjax plan`` (fake CPU devices): the analytic per-device weights and KV cache, and XLA:CPU's
  memory analysis of the engine's programs (arguments, temporaries, peaks);
* ``popjax compile --topology T``: XLA:TPU's memory analysis of the same programs, compiled by
  libtpu on this CPU-only machine for that slice (no TPU is used);

and one table puts them side by side, with the TPU/CPU and TPU/analytic ratios.

    python benchmarks/tpu_plans.py results/tpu/plans.json [--only NAME,...] [--jobs 2]

Every target compiles the scanned model (``--scan-layers``: an 80-layer model compiles in
minutes; the step cost is extrapolated from 1- and 2-layer compiles). A target already in the
JSON is kept, not recomputed; the JSON is rewritten after each target.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

CONTEXT, RATIO = 4096, 0.4
# name: (model, topology, mesh, weights, batch); the mesh uses every device of the slice, a data
# axis of 2 takes a batch of 2 (Qwen3-30B-A3B has 4 KV heads: its model axis is at most 4)
TARGETS = {
    "llama-3.1-8b v5e:2x4 bf16": ("llama-3.1-8b", "v5e:2x4", "1x8", "float", 1),
    "llama-3.1-8b v5e:2x4 int8": ("llama-3.1-8b", "v5e:2x4", "1x8", "int8", 1),
    "llama-3.1-70b v5p:2x2x2 bf16": ("llama-3.1-70b", "v5p:2x2x2", "1x8", "float", 1),
    "llama-3.1-70b v6e:2x4 bf16": ("llama-3.1-70b", "v6e:2x4", "1x8", "float", 1),
    "gemma-3-27b v5e:2x4 bf16": ("gemma-3-27b", "v5e:2x4", "1x8", "float", 1),
    "qwen3-30b-a3b v5e:2x4 bf16": ("qwen3-30b-a3b", "v5e:2x4", "2x4", "float", 2),
    "qwen3-30b-a3b v5e:2x4 int8": ("qwen3-30b-a3b", "v5e:2x4", "2x4", "int8", 2),  # bf16 weights: 14.2 GiB of 16
    "qwen2-vl-7b v5e:2x2 bf16": ("qwen2-vl-7b", "v5e:2x2", "1x4", "float", 1),
    # 4 hosts of 4 chips: a multi-process slice, compiled from this one process
    "llama-3.1-8b v5e:4x4 bf16": ("llama-3.1-8b", "v5e:4x4", "2x8", "float", 2),
}
METHODS = {"dense": "dense", "pop 0.4": "pop"}


def _popjax(args: list[str], env: dict[str, str] | None = None) -> None:
    proc = subprocess.run([sys.executable, "-m", "popjax.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})
    if proc.returncode:
        raise RuntimeError(f"popjax {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def cpu_plan(model: str, mesh: str, weights: str, batch: int, method: str) -> dict:
    """``popjax plan`` on fake CPU devices: analytic and XLA:CPU per-device bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        ratio = [] if method == "dense" else ["--ratio", str(RATIO)]
        _popjax(["plan", "--model", model, "--mesh", mesh, "--batch", str(batch), "--context", str(CONTEXT),
                 "--method", method, *ratio, "--weights", weights, "--scan-layers", "--json", str(out)])
        plan = json.loads(out.read_text())
    xla, analytic = plan["xla_per_device"], plan["analytic_per_device"]
    return {"analytic": {"weights": analytic["weights"], "kv_cache": analytic["kv_cache"]},
            "xla_cpu": {"weights": xla["weights"], "kv_cache": xla["kv_cache"], "method_state": xla["method_state"],
                        "prefill_peak": xla["prefill_peak"], "decode_peak": xla["decode_peak"]}}


def tpu_plan(model: str, topology: str, mesh: str, weights: str, batch: int) -> dict:
    """``popjax compile`` for the slice: XLA:TPU per-device bytes of dense and POP (one run)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "compile.json"
        _popjax(["compile", "--topology", topology, "--model", model, "--method", "pop", "--ratio", str(RATIO),
                 "--weights", weights, "--batch", str(batch), "--context", str(CONTEXT), "--mesh", mesh,
                 "--scan-layers", "--json", str(out)])
        report = json.loads(out.read_text())
    found = {}
    for record in report["records"]:
        label = "dense" if record["name"] == "dense" else "pop 0.4"
        if "error" in record:  # XLA:TPU refused it: larger than the chip's HBM
            found[label] = {"fits": False, "error": record["error"]}
            continue
        programs = record["programs"]
        found[label] = {
            **record["arguments"], "fits": record["fits"],
            # XLA:CPU's peaks count no generated code: the TPU's are compared without it, and it is kept
            "prefill_peak": programs["prefill"]["peak"] - programs["prefill"]["generated_code"],
            "decode_peak": programs["decode_loop"]["peak"] - programs["decode_loop"]["generated_code"],
            "decode_code": programs["decode_loop"]["generated_code"],
            "compile_seconds": {k: p["compile_seconds"] for k, p in programs.items()}}
    return {"topology": report["topology"], "methods": found}


def plan_target(name: str) -> dict:
    model, topology, mesh, weights, batch = TARGETS[name]
    tpu = tpu_plan(model, topology, mesh, weights, batch)
    rows = {}
    for label, method in METHODS.items():
        cpu = cpu_plan(model, mesh, weights, batch, method)
        rows[label] = {**cpu, "xla_tpu": tpu["methods"].get(label, {"error": "not compiled"})}
    return {"model": model, "topology": tpu["topology"], "mesh": mesh, "weights": weights, "batch": batch,
            "context": CONTEXT, "scan_layers": True, "methods": rows}


def table(results: dict) -> str:
    """Markdown: GiB per device, XLA:TPU against XLA:CPU and the analytic plan."""
    gib = lambda b: f"{b / 2**30:.2f}"
    lines = ["| target | method | weights analytic / CPU / TPU | KV analytic / CPU / TPU | state CPU / TPU | "
             "prefill peak CPU / TPU | decode peak CPU / TPU | TPU / CPU decode peak | fits (TPU) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, target in results.items():
        for label, row in target["methods"].items():
            a, c, t = row["analytic"], row["xla_cpu"], row["xla_tpu"]
            if "error" in t:  # XLA:TPU's "... required for HLO temporaries (35.51G) exceeds available HBM (31.25G)"
                need = re.findall(r"\(([\d.]+G)\)", t["error"])
                refusal = f"no: needs {need[0]} of {need[1]}" if len(need) == 2 else f"no: {t['error'][:80]}"
                lines.append(f"| {name} | {label} | {gib(a['weights'])} / {gib(c['weights'])} / – | – | – | – | "
                             f"{gib(c['decode_peak'])} / – | – | {refusal} |")
                continue
            lines.append(
                f"| {name} | {label} | {gib(a['weights'])} / {gib(c['weights'])} / {gib(t['weights'])} | "
                f"{gib(a['kv_cache'])} / {gib(c['kv_cache'])} / {gib(t['kv_cache'])} | "
                f"{gib(c['method_state'])} / {gib(t['method_state'])} | {gib(c['prefill_peak'])} / {gib(t['prefill_peak'])} | "
                f"{gib(c['decode_peak'])} / {gib(t['decode_peak'])} | {t['decode_peak'] / c['decode_peak']:.3f} | "
                f"{'yes' if t['fits'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--only", default=None, help=f"comma-separated target names of {list(TARGETS)}")
    parser.add_argument("--jobs", type=int, default=1, help="targets planned at once (each compiles on about one core)")
    args = parser.parse_args()
    names = list(TARGETS) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise SystemExit(f"--only: {unknown} not valid; valid: {list(TARGETS)}")
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    todo = [n for n in names if n not in results]
    with concurrent.futures.ProcessPoolExecutor(max(1, args.jobs)) as pool:
        running = {pool.submit(plan_target, name): name for name in todo}
        for done in concurrent.futures.as_completed(running):  # saved as each finishes; a failure is reported, not kept
            name = running[done]
            try:
                results[name] = done.result()
            except RuntimeError as err:
                print(f"failed: {name}: {err}", flush=True)
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1) + "\n")
            print(f"done: {name}", flush=True)
    print(table({n: results[n] for n in names if n in results}))


if __name__ == "__main__":
    main()
