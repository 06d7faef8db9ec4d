"""The README's and the docs' headline speed tables, generated from the results/ JSON that the
benchmark commands write, so a number in the text is always the one in its result file.

    python tools/readme_numbers.py            # rewrite the generated blocks in place
    python tools/readme_numbers.py --check    # exit 1 (and show the diff) if a block is stale

A generated block sits between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->``
in a markdown file; ``BLOCKS`` says which file holds which block and how it is rendered.
tests/house/test_readme_numbers.py runs ``--check``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
BENCH = "results/int8/bench_cpu.json"
BENCH_COMMAND = ("popjax bench --weights float,int8 --methods static,pop --ratios 0.4 --batches 1,8 --repeats 3 "
                 "--json results/int8/bench_cpu.json")


def _load(path: str) -> dict:
    return json.loads((ROOT / path).read_text())


def _rate(records: list[dict], method: str, weights: str, batch: int) -> float | None:
    for r in records:
        if r["method"] == method and r.get("weights", "float") == weights and r["batch"] == batch:
            return float(r["decode_tokens_per_s"])
    return None


def speed_table(bench: dict) -> str:
    """Decode tokens/s per method, weight format and batch, and each against dense fp32 and
    against dense in its own format; the transformers peers of the same run below."""
    records = bench["records"]
    batches = sorted({r["batch"] for r in records})
    formats = [w for w in ("float", "int8") if any(r.get("weights", "float") == w for r in records)]
    rows = []
    seen = []
    for r in records:
        key = (r["method"], r.get("ratio", 0.0), r.get("weights", "float"))
        if key not in seen:
            seen.append(key)
    head = "| method | weights | " + " | ".join(f"tok/s @ batch {b} (× dense same weights)" for b in batches) + " |"
    rows.append(head)
    rows.append("|" + "---|" * (2 + len(batches)))
    for method, ratio, weights in seen:
        name = method if method == "dense" else f"{method} {ratio:.0%}"
        cells = []
        for b in batches:
            rate, dense = _rate(records, method, weights, b), _rate(records, "dense", weights, b)
            cells.append("—" if rate is None else f"{rate:.1f} ({rate / dense:.2f}×)" if dense else f"{rate:.1f}")
        rows.append(f"| {name} | {'fp32' if weights == 'float' else weights} | " + " | ".join(cells) + " |")
    peers = {"transformers": bench.get("transformers")}
    peers.update((bench.get("peers") or {}))
    for label, peer in peers.items():
        if not peer or "by_batch" not in peer:
            continue
        cells = [f"{peer['by_batch'][str(b)]['decode_tokens_per_s']:.1f}" if str(b) in peer["by_batch"] else "—" for b in batches]
        rows.append(f"| {peer.get('engine', label)} (peer) | — | " + " | ".join(cells) + " |")
    machine = f"{bench['bandwidth_gb_s']:.1f} GB/s measured GEMV bandwidth"
    note = (f"SmolLM2-135M-Instruct, {bench['max_new_tokens']} new tokens, best of {bench['repeats']}, one run on a "
            f"2-core CPU ({machine}); formats: {', '.join(formats)}. From `{BENCH}`, made by `{BENCH_COMMAND}`.")
    return "\n".join(rows) + "\n\n" + note


TPU_STEPS = ("results/kernels/whole_step_v6e_bf16.json", "results/kernels/whole_step_v6e_bf16_teal.json",
             "results/kernels/whole_step_v6e_bf16_wina_principal.json", "results/kernels/whole_step_v6e_bf16_dynamic_cats.json",
             "results/kernels/whole_step_v6e_bf16_shortlist.json", "results/kernels/whole_step_v6e_bf16_larosa_block_dynamic.json",
             "results/kernels/whole_step_v6e_bf16_presets.json")


def method_label(spec: str) -> str:
    """A record's method spec without its ``kernel`` option (the table's own column says which
    ran): "dynamic(block=128, kernel=xla)" -> "dynamic(block=128)", "pop(kernel=xla)" -> "pop"."""
    return re.sub(r"\(\)$", "", re.sub(r"(, )?kernel=[\w-]+(, )?", lambda m: ", " if m.group(1) and m.group(2) else "", spec))


def _step_name(record: dict, kernel: str) -> str:
    """A whole-step record's row name: "dense", or the method (its kernel option left out) and
    what its selected rows ran through (``kernel`` for a Pallas kernel, else "XLA")."""
    if record["name"] == "dense":
        return "dense"
    return f"{method_label(record['method'])}, {kernel if record['kernel'] != 'xla' else 'XLA'}"


def tpu_table(reports: list[dict], ratio: float = 0.4) -> str:
    """Llama-3.1-8B's decode step on one v6e as XLA:TPU compiles it (compile-only), per method at
    ``ratio``: the bytes the compiled step moves to and from HBM (counted from its optimized HLO)
    and the tokens/s estimated from them, against dense; the cost analysis's bytes and its ratio
    beside them; the ideal ratio (dense from the first report; every report compiles the same
    dense step)."""
    rows = ["| method (40%) | HBM bytes per step | est. tok/s | vs dense (estimate) | cost-model bytes | vs dense "
            "(cost model) | ideal vs dense |", "|---|---|---|---|---|---|---|"]
    # block-granular variants compile the same step as their channel methods here (docs/kernels.md)
    records = [reports[0]["records"][0]] + [r for rep in reports for r in rep["records"]
                                             if r["ratio"] == ratio and "block=" not in r["method"]]
    for r in records:
        step, vs = r["decode_step"], r["vs_dense"]
        rows.append(f"| {_step_name(r, 'Pallas kernel')} | {step['hbm_bytes'] / 2**30:.2f} GiB | {step['hbm_estimated_tokens_per_s']:.1f} | "
                    f"**{vs['hbm_estimated_speedup']:.2f}×** | {step['bytes_accessed'] / 2**30:.2f} GiB | "
                    f"{vs['estimated_speedup']:.2f}× | {vs['ideal_speedup']:.2f}× |")
    note = (f"Llama-3.1-8B, bf16, batch 1, context {reports[0]['context']}, one v6e (1638 GB/s), compiled by libtpu on a "
            "CPU. HBM bytes: what the compiled step reads from and writes to HBM, counted from its optimized HLO "
            "(`popjax.analysis.hbm_traffic`); cost-model bytes: XLA:TPU's cost analysis, which also counts the staging "
            "of weights into VMEM; tokens/s an **estimate** (HBM bytes over HBM bandwidth), not a measurement. From "
            + ", ".join(f"`{p}`" for p in TPU_STEPS) + "; commands in docs/kernels.md.")
    return "\n".join(rows) + "\n\n" + note


def whole_step_table(paths: list[str]) -> str:
    """The decode step as XLA:TPU compiles it, one row per record of each report in ``paths``
    (dense once, from the first): what a device holds, the HBM bytes the compiled step moves (from
    its optimized HLO) against the ideal, the tokens/s estimated from them against dense, and the
    cost analysis's bytes and ratio beside them."""
    reports = [_load(p) for p in paths]
    rows = ["| weights, chip | method | ratio | held GiB (weights + copies) | HBM GiB per step | ideal GiB | HBM / ideal "
            "| est. tok/s | vs dense (estimate) | cost-model GiB | vs dense (cost model) | ideal vs dense |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, rep in enumerate(reports):
        chip = f"{'int8' if rep['weights'] == 'int8' else 'bf16'}, {rep['topology']['chip']}"
        first_of_chip = i == 0 or rep["topology"]["chip"] != reports[i - 1]["topology"]["chip"] or rep["weights"] != reports[i - 1]["weights"]
        for r in rep["records"] if first_of_chip else rep["records"][1:]:
            step, vs, held = r["decode_step"], r["vs_dense"], r["arguments"]
            copies = f" + {held['method_data'] / 2**30:.2f}" if held.get("method_data", 0) >= 0.005 * 2**30 else ""
            rows.append(f"| {chip} | {_step_name(r, 'Mosaic kernel')} | {r['ratio']:g} | {held['weights'] / 2**30:.2f}{copies} | {step['hbm_bytes'] / 2**30:.2f} "
                        f"| {step['ideal_bytes_per_device'] / 2**30:.2f} | {step['hbm_bytes'] / step['ideal_bytes_per_device']:.3f} "
                        f"| {step['hbm_estimated_tokens_per_s']:.1f} | {vs['hbm_estimated_speedup']:.2f}× | {step['bytes_accessed'] / 2**30:.2f} "
                        f"| {vs['estimated_speedup']:.2f}× | {vs['ideal_speedup']:.2f}× |")
    note = ("Llama-3.1-8B, batch 1, context 1024, compiled by libtpu on a CPU. HBM GiB: what the compiled step moves to "
            "and from HBM, counted from its optimized HLO (`popjax.analysis.hbm_traffic`); est. tok/s: an **estimate**, "
            "HBM bytes over the chip's HBM bandwidth, not a measurement; cost-model GiB: XLA:TPU's bytes accessed, which "
            "count weights staged into VMEM on top. From " + ", ".join(f"`{p}`" for p in paths) + ".")
    return "\n".join(rows) + "\n\n" + note


def scanned_table(path: str) -> str:
    """A scanned-layer report (``--scan-layers``): per method, the HBM bytes of the scanned step
    against the unrolled step's (1- and 2-layer extrapolation) and the ideal, the estimate vs
    dense, and the temporaries of the decode step and loop."""
    rep = _load(path)
    rows = ["| method | scanned HBM GiB | unrolled HBM GiB | ideal GiB | scanned vs dense (estimate) | temporaries, step / loop |",
            "|---|---|---|---|---|---|"]
    for r in rep["records"]:
        step, temp = r["decode_step"], {k: p["temp"] / 2**30 for k, p in r["programs"].items()}
        rows.append(f"| {_step_name(r, 'its kernel')} | {step['hbm_bytes'] / 2**30:.2f} | {step['unrolled_hbm_bytes'] / 2**30:.2f} "
                    f"| {step['ideal_bytes_per_device'] / 2**30:.2f} | {r['vs_dense']['hbm_estimated_speedup']:.2f}× "
                    f"| {temp['decode_step']:.2f} / {temp['decode_loop']:.2f} GiB |")
    note = (f"Llama-3.1-8B, bf16, batch {rep['batch']}, context {rep['context']}, one {rep['topology']['chip']}, scanned layers, "
            "compiled by libtpu on a CPU; HBM bytes counted from the optimized HLO, the speed-up an **estimate** (HBM "
            f"bytes over bandwidth), not a measurement. From `{path}`.")
    return "\n".join(rows) + "\n\n" + note


KERNEL_STEPS = {  # docs/kernels.md's whole-step tables: block name -> the reports they render
    "kernels-pop": ["results/kernels/whole_step_v6e_bf16.json", "results/kernels/whole_step_v5e_int8.json"],
    "kernels-teal": ["results/kernels/whole_step_v6e_bf16_teal.json", "results/kernels/whole_step_v6e_bf16_wina_principal.json",
                     "results/kernels/whole_step_v5e_int8_teal.json"],
    "kernels-larosa": ["results/kernels/whole_step_v6e_bf16_larosa_block_dynamic.json"],
    "kernels-dynamic-cats": ["results/kernels/whole_step_v6e_bf16_dynamic_cats.json"],
    "kernels-shortlist": ["results/kernels/whole_step_v6e_bf16_shortlist.json"],
    "kernels-presets": ["results/kernels/whole_step_v6e_bf16_presets.json"],
}

# block name -> (file, renderer of its body)
CAPACITY = "results/engine/capacity_decode.json"


def capacity_table(result: dict) -> str:
    """The same greedy tokens (ended by a stop id) with the cache sized for 56 to 4000 new tokens:
    generate's wall time and its speed against the smallest; then the decode loop's per-step
    cost at 64 and 4096 slots, batch 1 and 8."""
    rows = ["| max_new_tokens (the cache's capacity) | " + " | ".join(str(r["max_new_tokens"]) for r in result["generate"]) + " |",
            "|---|" + "---|" * len(result["generate"]),
            f"| generate, {result['generate'][0]['tokens']} tokens (ms) | " + " | ".join(f"{r['generate_ms']:.0f}" for r in result["generate"]) + " |",
            "| speed vs 56 | " + " | ".join(f"{r['speed_vs_56']:.2f}×" for r in result["generate"]) + " |"]
    # the fixed part (the 8-token run less 8 steps) is in the JSON; on this machine it is within the noise of zero
    split = ["| batch | cache for | ms per decode step (64 vs 8 tokens) |", "|---|---|---|"]
    split += [f"| {r['batch']} | {r['capacity']} new tokens | {r['per_step_ms']:.1f} |" for r in result["step_split"]]
    ratio = result["per_step_ratio_4096_vs_64"]
    note = (f"SmolLM2-135M-Instruct, fp32, one quiet run on the 2-core CPU; per step at 4096 against 64 slots: "
            + ", ".join(f"{v:.2f}× at batch {b}" for b, v in ratio.items())
            + f" (within 10% is the promise). From `{CAPACITY}`, made by `{result['command']}`.")
    return "\n".join(rows) + "\n\n" + "\n".join(split) + "\n\n" + note


BLOCKS: dict[str, tuple[str, Callable[[], str]]] = {
    "readme-speed": ("README.md", lambda: speed_table(_load(BENCH))),
    "performance-speed": ("docs/performance.md", lambda: speed_table(_load(BENCH))),
    "readme-tpu": ("README.md", lambda: tpu_table([_load(p) for p in TPU_STEPS])),
    **{name: ("docs/kernels.md", lambda paths=paths: whole_step_table(paths)) for name, paths in KERNEL_STEPS.items()},
    "tpu-scanned": ("docs/tpu.md", lambda: scanned_table("results/kernels/whole_step_v6e_bf16_scanned.json")),
    "performance-capacity": ("docs/performance.md", lambda: capacity_table(_load(CAPACITY))),
}


def render(text: str, name: str, body: str) -> str:
    """``text`` with block ``name``'s body replaced; ValueError if the file has no such block."""
    start, end = f"<!-- generated: {name} -->", f"<!-- end generated: {name} -->"
    pattern = re.compile(rf"{re.escape(start)}\n.*?{re.escape(end)}", re.S)
    if not pattern.search(text):
        raise ValueError(f"no generated block {name!r} ({start} ... {end})")
    return pattern.sub(lambda _: f"{start}\n{body}\n{end}", text, count=1)


def stale_blocks() -> list[tuple[str, str, str]]:
    """(block name, current text, generated text) of every block whose text differs."""
    out = []
    for name, (path, make) in BLOCKS.items():
        text = (ROOT / path).read_text()
        want = render(text, name, make())
        if want != text:
            out.append((name, text, want))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated block differs from its results")
    args = parser.parse_args(argv)
    stale = stale_blocks()
    if args.check:
        for name, text, want in stale:
            path = BLOCKS[name][0]
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), want.splitlines(True), path, f"{path} (generated)"))
        if stale:
            print(f"stale generated blocks: {[name for name, _, _ in stale]}; run python tools/readme_numbers.py")
        return 1 if stale else 0
    for name, _, _ in stale:  # rendered again from the file as it is now: one file may hold several blocks
        path = ROOT / BLOCKS[name][0]
        path.write_text(render(path.read_text(), name, BLOCKS[name][1]()))
        print(f"updated {name} in {BLOCKS[name][0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
