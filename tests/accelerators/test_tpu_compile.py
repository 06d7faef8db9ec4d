"""TPU as a compile target (popjax.analysis.tpu_compile, `popjax compile`): the engine's programs
compile with the real TPU compiler (libtpu, no TPU) on meshes of TPU topologies, for every
registry method and every model family; memory and cost come from XLA:TPU; bad input fails in
one line. JAX stays on its CPU backend throughout."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import types

import jax
import pytest

from popjax.analysis.hlo_text import parse_module
from popjax.analysis.topologies import CHIPS, GiB, LibTPUMissing, resolve_topology
from popjax.analysis.tpu_compile import check_fit, resolve_model, tpu_compile
from popjax.analysis.tpu_report import format_report
from popjax.cli import main
from popjax.methods import METHODS
from popjax.models.config import ModelConfig
from popjax.sharding import abstract_params, make_mesh
from tests.conftest import tiny_program_env
from tests.accelerators.targets import BASE, FAMILIES, MOSAIC_CALL, SHAPES, config
from tests.gguf_files import write_metadata_only

# Compiles for a TPU or a GPU, or runs Pallas kernels in interpret mode: the full suite checks these, the
# quick loop between edits (-m "not slow") does not.
pytestmark = pytest.mark.slow

pytest.importorskip("libtpu")

CORE = ("pop", "static", "teal")  # online, offline-selection and calibrated-data methods (dense: the baseline)


def _weights_per_device(cfg: ModelConfig, model: int, itemsize: int = 2) -> float:
    """The model's weights at ``itemsize`` bytes each, split ``model`` ways."""
    shapes = jax.tree_util.tree_leaves(abstract_params(cfg, make_mesh((1, 1)), "bfloat16"))
    return sum(math.prod(leaf.shape) for leaf in shapes) * itemsize / model


def _check_record(record: dict, report: dict) -> None:
    """What every compiled method reports: memory from XLA:TPU that fits, positive step cost,
    the estimate = batch / (bytes / bandwidth), and the weights it holds as arguments."""
    bandwidth = report["topology"]["hbm_bandwidth_per_device"]
    for name, program in record["programs"].items():
        assert program["argument"] > 0 and program["generated_code"] > 0 and program["fits"], (record["method"], name)
        assert program["peak"] >= program["argument"] - program["alias"], (record["method"], name)
    assert record["programs"]["decode_step"]["argument"] >= record["arguments"]["weights"]
    step = record["decode_step"]
    assert step["flops"] > 0 and step["bytes_accessed"] > 0 and step["ideal_bytes_per_device"] > 0
    assert step["estimated_tokens_per_s"] == pytest.approx(report["batch"] * bandwidth / step["bytes_accessed"])
    # the HBM bytes leave out what the cost analysis adds for staging weights into VMEM
    assert 0 < step["hbm_bytes"] < step["bytes_accessed"]
    assert step["hbm_estimated_tokens_per_s"] == pytest.approx(report["batch"] * bandwidth / step["hbm_bytes"])
    # XLA:TPU's own optimal_seconds: positive on these tiny programs (None where it is not: the 8B's)
    assert step["optimal_seconds"] > 0
    assert step["xla_estimated_tokens_per_s"] == pytest.approx(report["batch"] / step["optimal_seconds"])


def test_core_methods_compile_for_a_v5e_slice(tmp_path):
    cfg = config()
    report = tpu_compile(cfg, "v5e:2x2", CORE, [0.4], mesh=(1, 4), hlo_dir=tmp_path, **SHAPES)
    assert report["jax_backend"] == "cpu"  # compiling for TPU left JAX on its CPU backend
    assert report["topology"] == {"name": "v5e:2x2", "chip": "v5e", "chips": 4, "devices": 4, "processes": 1,
                                  "hbm_per_device": 16 * GiB, "hbm_bandwidth_per_device": 819e9}
    records = {r["name"]: r for r in report["records"]}
    assert list(records) == ["dense", *CORE] and set(records["dense"]["programs"]) == {"prefill", "decode_step"}
    for record in records.values():
        _check_record(record, report)
    dense = records["dense"]
    # the weights split over model=4: a quarter of every split matrix per device (norms replicated)
    assert _weights_per_device(cfg, 4) <= dense["arguments"]["weights"] < 1.1 * _weights_per_device(cfg, 4)
    # static reads fewer weights per step than dense in the TPU program too, and no method
    # state beyond its compact copy; its ideal bytes follow the ratio
    assert records["static"]["decode_step"]["bytes_accessed"] < dense["decode_step"]["bytes_accessed"]
    for name in ("pop", "static"):
        assert records[name]["vs_dense"]["ideal_bytes"] < 1.0, name
    # TEAL through the Mosaic kernel: two custom calls per layer (gate/up, then down); a row it
    # reads is whole lines of 128 lanes (1024 for d = 64 here), so its ideal is above dense on
    # this tiny model, and below it at real widths (docs/kernels.md, "TEAL's wiring")
    assert records["teal"]["kernel"] == "pallas-tpu"
    # its copies are method data the device holds beside the weights (the step's own arguments
    # leave the FFN weights out: it does not read them), counted in what must fit
    teal = records["teal"]["arguments"]
    assert teal["method_data"] > 0 and records["teal"]["held"] == sum(teal.values())
    assert (tmp_path / "teal-0.4.step.hlo.txt").read_text().count(MOSAIC_CALL) == 2 * cfg.num_hidden_layers
    assert records["dense"]["vs_dense"]["estimated_speedup"] == 1.0
    assert records["pop"]["arguments"]["method_state"] > 0  # POP's partition state travels with the carry
    # "auto" bound for the TPU: the Mosaic kernel, a custom call per layer inside the shard_map every device runs
    assert records["pop"]["kernel"] == "pallas-tpu"
    assert (tmp_path / "pop-0.4.step.hlo.txt").read_text().count(MOSAIC_CALL) == cfg.num_hidden_layers
    table = format_report(report)
    assert "est tok/s" in table and "estimate" in table and "teal" in table


def test_a_larger_context_adds_only_the_kv_its_decode_step_reads():
    # `popjax compile --context 1024` against 8192 on the 8B says the same at full size
    # (docs/tpu.md): the cache grows 8x, the step's HBM bytes only by the slots it reads
    cfg = config()
    steps = {}
    for context in (256, 2048):
        report = tpu_compile(cfg, "v5e:1x1", ["dense"], [0.4], batch=1, context=context, prompt=32, decode_loop=False,
                             prefill=False, with_dense=False)
        record = report["records"][0]
        steps[context] = (record["decode_step"]["hbm_bytes"], record["kv_slots_read"], record["cache_slots"])
    (small, read_small, slots_small), (large, read_large, slots_large) = steps[256], steps[2048]
    per_slot = 2 * cfg.kv_dim * 2 * cfg.num_hidden_layers  # k and v, bf16, every layer
    assert slots_large > 4 * slots_small and read_large > read_small
    grown, kv_read = large - small, (read_large - read_small) * per_slot
    # the attention reads whole 256-slot blocks: the slots read, up to a block more per layer
    assert kv_read - 256 * per_slot <= grown <= kv_read + 256 * per_slot, (grown, kv_read)
    # the counted step is mid-generation (half the new tokens written): half the cache's growth, not all of it
    assert grown < 0.6 * (slots_large - slots_small) * per_slot


@pytest.mark.slow  # every registry method: one TPU compile each (about 20 s on 2 cores)
def test_every_registry_method_compiles_its_decode_step(tmp_path):
    """Every method's decode step (its prefill lowered for the carry, not compiled: the core
    methods' prefills compile above and in the family test), on one v5e chip; those with a
    ``kernel`` bound to Mosaic's (dynamic POP and CATS: one call per layer; LaRoSa: its folded
    gate/up, then down; gate-scored and shortlisted POP: their up rows, then their down rows;
    low-rank POP: gate, up and down rows; per-layer bands (uniform here): the zone's down rows)."""
    specs = sorted(set(METHODS) - {"dense", "prefill-only", *CORE}) + ["prefill-only+pop:skip=1",
                                                                          "prefill-only:kv=calibrated:skip=1"]
    cfg = config()
    report = tpu_compile(cfg, "v5e:1x1", specs, [0.3], with_dense=False, prefill=False, hlo_dir=tmp_path, **SHAPES)
    bound = {r["name"]: r["kernel"] for r in report["records"]}
    for name in ("dynamic", "cats", "wina", "principal-teal", "larosa", "pop-gate", "pop-shortlist", "dynamic-shortlist",
                 "pop-lowrank", "pop-bands"):
        assert bound[name] == "pallas-tpu", name
    for name, per_layer in (("dynamic", 1), ("cats", 1), ("larosa", 2), ("pop-gate", 2), ("pop-shortlist", 2), ("dynamic-shortlist", 2),
                            ("pop-lowrank", 3), ("pop-bands", 1)):
        calls = (tmp_path / f"{name}-0.3.step.hlo.txt").read_text().count(MOSAIC_CALL)
        assert calls == per_layer * cfg.num_hidden_layers, (name, calls)
    names = {r["name"] for r in report["records"]}
    assert names | {"dense", *CORE} >= set(METHODS), sorted(set(METHODS) - names - {"dense", *CORE})
    for record in report["records"]:
        assert set(record["programs"]) == {"decode_step"}
        _check_record(record, report)
    assert format_report(report).splitlines()[3].split()[7] == "n/c"  # the prefill column: not compiled


@pytest.mark.parametrize("family, weights, mesh, scan", [
    ("llama", "int8", (1, 4), False),
    ("qwen3", "float", (1, 4), True),
    ("qwen3_moe", "float", (1, 4), False),
    ("gemma3", "float", (2, 2), False),
    ("qwen2_vl", "float", (1, 4), False),
])
def test_every_family_compiles(family, weights, mesh, scan):
    """POP on each family (its text programs), int8 weights, the scanned model and a (2, 2) mesh
    (batch 2 over data=2) once each."""
    batch = 2 if mesh[0] == 2 else 1
    report = tpu_compile(config(family), "v5e:2x2", ["pop"], [0.3], mesh=mesh, weights=weights, scan_layers=scan,
                         with_dense=False, **dict(SHAPES, batch=batch))
    (record,) = report["records"]
    assert record["name"] == "pop" and report["mesh"] == {"data": mesh[0], "model": mesh[1]}
    _check_record(record, report)
    if weights == "int8":  # one byte per linear weight (norms and scales on top), against bf16's two
        assert record["arguments"]["weights"] < 0.6 * _weights_per_device(config(family), mesh[1])
    if scan:  # XLA counts the layer loop's body once: the step cost is the 1- and 2-layer extrapolation
        step = record["decode_step"]
        assert step["scan_body_bytes_accessed"] < step["bytes_accessed"]
        # the scanned program's own HBM count walks its layer loop, every trip (a body counted once
        # would be about half the unrolled step's here); at this size its copies of the cache cost more
        assert step["hbm_bytes"] >= step["unrolled_hbm_bytes"]


def test_scanned_pop_moves_about_the_unrolled_steps_bytes():
    """A scanned step reads POP's compact copies at each layer, as the unrolled one does. Two
    things made it move 3.4× the unrolled bytes here (406 GiB against 9.3 on the 8B): a batch of
    one re-emitting its unchanged per-sequence state (a new stack per step, and XLA:TPU copied the
    whole stack in every layer trip), and compact copies of n_R = 6519 channels, which XLA:TPU
    re-laid out for the loop, a whole copy per step (now padded to a multiple of 8). A third,
    the kernel's candidate rows sliced out of the stack per layer (1.43× here), is gone since the
    scan holds them whole (`kernels.held_rows`): 1.19×."""
    cfg = config(hidden_size=512, intermediate_size=2048, num_attention_heads=4, num_key_value_heads=2)
    report = tpu_compile(cfg, "v5e:1x1", ["pop"], [0.4], scan_layers=True, with_dense=False, prefill=False, **SHAPES)
    step = report["records"][0]["decode_step"]
    # what is left at this size: XLA:TPU stages the layer's retained down copy into VMEM twice per
    # layer trip (two slice-starts of it in the compiled loop)
    assert step["unrolled_hbm_bytes"] <= step["hbm_bytes"] <= 1.3 * step["unrolled_hbm_bytes"]


def test_pop_compiles_with_the_mosaic_kernel_on_one_chip(tmp_path):
    """POP's "auto" kernel is bound for the TPU, not for this CPU host: the decode step XLA:TPU
    compiles calls the Pallas kernel (a Mosaic custom call per layer; block POP's, the block
    kernel), and "xla" calls none."""
    report = tpu_compile(config(), "v5e:1x1", ["pop", "pop:kernel=xla", "pop:block=8"], [0.4], with_dense=False,
                         hlo_dir=tmp_path, prefill=False, **SHAPES)
    assert {r["method"]: r["kernel"] for r in report["records"]} == {"pop": "pallas-tpu", "pop(kernel=xla)": "xla",
                                                                      "pop(block=8)": "pallas-tpu"}
    for record in report["records"]:
        _check_record(record, report)
    assert (tmp_path / "pop-0.4.step.hlo.txt").read_text().count(MOSAIC_CALL) == 2
    assert (tmp_path / "pop(kernel=xla)-0.4.step.hlo.txt").read_text().count(MOSAIC_CALL) == 0
    block = (tmp_path / "pop(block=8)-0.4.step.hlo.txt").read_text()
    assert block.count(MOSAIC_CALL) == 2 and "block_matvec" in block
    # the rows each kernel reads in part stay in HBM: left to choose, XLA:TPU stages these small
    # copies whole into VMEM before the call (kernels.ffn_tpu.in_hbm)
    for name in ("pop", "pop(block=8)"):
        assert _kernel_weight_spaces((tmp_path / f"{name}-0.4.step.hlo.txt").read_text()) == [0, 0], name


def _kernel_weight_spaces(hlo: str) -> list[int]:
    """The memory space (0: HBM) of the last operand, the weights, of every Pallas call in ``hlo``."""
    computations, _ = parse_module(hlo)
    return [comp.instructions[ins.operands[-1]].leaves[0].space for comp in computations.values()
            for ins in comp.instructions.values() if MOSAIC_CALL in ins.attrs]


def test_v5p_and_v4_slices_resolve_with_their_chips():
    v5p, v4 = resolve_topology("v5p:2x2x1"), resolve_topology("v4:2x2x1")
    assert (v5p.chip, v5p.chips, len(v5p.devices)) == (CHIPS["v5p"], 4, 4)  # one megacore device per chip
    assert (v4.chip, v4.chips, len(v4.devices)) == (CHIPS["v4"], 4, 8)  # v4: each TensorCore a device
    assert v4.hbm_per_device == 16 * GiB and v4.bandwidth_per_device == 600e9
    assert resolve_topology("v5e:1x1").chips == 1 and resolve_topology("v5e:4x4").processes == 4


def test_models_resolve_from_a_name_a_config_or_a_directory(tmp_path):
    assert resolve_model("llama-3.1-8b").num_hidden_layers == 32
    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, **FAMILIES["qwen3"])))
    assert resolve_model(str(tmp_path)) == resolve_model(str(tmp_path / "config.json")) == config("qwen3")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"model directory .* holds no config\.json"):
        resolve_model(str(tmp_path / "empty"))
    # a GGUF's metadata, written by the test helper from the fields of a HF Gemma3TextConfig
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    gemma = types.SimpleNamespace(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                                  rms_norm_eps=1e-6, final_logit_softcapping=None, sliding_window=8,
                                  rope_parameters={"full_attention": rope, "sliding_attention": rope})
    cfg = resolve_model(str(write_metadata_only(gemma, tmp_path / "tiny.gguf")))
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers) == ("gemma3_text", 32, 2)


def test_bad_input_fails_in_one_line(monkeypatch):
    for name in ("v9z:2x2", "v5e:3x3"):  # unknown to libtpu: the error lists valid forms
        with pytest.raises(ValueError, match=rf"topology '{name}' is not one libtpu resolves.*valid forms: .*v5e:2x4"):
            resolve_topology(name)
    with pytest.raises(ValueError, match=r"topology 'tpu-v5e' is not GENERATION:SHAPE; valid forms: .*v5p:2x2x1"):
        resolve_topology("tpu-v5e")
    with pytest.raises(ValueError, match=r"mesh 2x4 \(8 devices\) does not cover topology v5e:2x2 \(4 devices\); "
                                         r"valid meshes: 1x4, 2x2, 4x1"):
        tpu_compile(config(), "v5e:2x2", [], mesh=(2, 4), **SHAPES)
    with pytest.raises(ValueError, match=r"weights='int4' must be 'float' or 'int8'"):
        tpu_compile(config(), "v5e:2x2", [], weights="int4", **SHAPES)
    with pytest.raises(ValueError, match=r"prefill=False needs a mesh of one device .*mesh 1x4 has 4"):
        tpu_compile(config(), "v5e:2x2", [], prefill=False, **SHAPES)
    monkeypatch.setitem(sys.modules, "libtpu", None)  # as if not installed: the error names the extra
    with pytest.raises(LibTPUMissing, match=r'pip install -e "\.\[tpu\]"'):
        resolve_topology("v5e:2x2")


def test_a_program_that_does_not_fit_is_reported_and_refused_on_request():
    # 2^27 × 64 bf16 embedding rows (tied head): 16 GiB of weights alone on one v5e chip; XLA:TPU
    # refuses to compile it, and the report says so (the table, check_fit / --require-fit)
    huge = config(vocab_size=2**27, tie_word_embeddings=True)
    report = tpu_compile(huge, "v5e:1x1", [], **SHAPES)
    (record,) = report["records"]
    assert not record["fits"] and record["programs"] == {} and "Ran out of memory" in record["error"]
    assert "does NOT fit: RESOURCE_EXHAUSTED" in format_report(report)
    with pytest.raises(ValueError, match=r"dense: does not fit a v5e device \(topology v5e:1x1, mesh 1x1\): XLA:TPU: "
                                         r"RESOURCE_EXHAUSTED: Ran out of memory"):
        check_fit(report)


@pytest.mark.slow  # a CLI process and two worker processes (each imports popjax and JAX)
def test_cli_compiles_and_writes_json_and_plot(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(BASE, **FAMILIES["llama"])))
    out, plot = tmp_path / "out.json", tmp_path / "out.png"
    env = {k: v for k, v in tiny_program_env().items() if not k.startswith("TPU_") and k != "ALLOW_MULTIPLE_LIBTPU_LOAD"}
    env.pop("JAX_PLATFORMS")  # JAX picks its backend itself: libtpu installed, no TPU -> the CPU, quietly
    cmd = [sys.executable, "-m", "popjax.cli", "compile", "--topology", "v5e:2x2", "--model", str(path), "--method",
           "dense,static", "--ratio", "0.4", "--mesh", "1x4", "--context", "64", "--no-decode-loop", "--jobs", "2",
           "--json", str(out), "--plot", str(plot)]  # two worker processes: --jobs
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(r["name"], r["ratio"]) for r in report["records"]] == [("dense", 0.0), ("static", 0.4)]
    assert report["jax_backend"] == "cpu" and report["command"].startswith("popjax compile --topology v5e:2x2")
    assert plot.stat().st_size > 10_000 and "est tok/s" in result.stdout
    assert "TPU_ACCELERATOR_TYPE" not in result.stderr and "TPU_WORKER_HOSTNAMES" not in result.stderr  # start-up is quiet
    assert main(cmd[3:8] + ["--mesh", "3x3"]) == 2  # in this process: the same one line, no second start-up
    assert capsys.readouterr().err.strip().splitlines() == [
        "popjax: error: mesh 3x3 (9 devices) does not cover topology v5e:2x2 (4 devices); valid meshes: 1x4, 2x2, 4x1"]


PARENT_THAT_DIES = """
import concurrent.futures, multiprocessing, os, time
from popjax.analysis.tpu_compile import exit_with_parent
if __name__ == "__main__":
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=exit_with_parent)
    print(pool.submit(os.getpid).result(), flush=True)
    pool.submit(time.sleep, 120)  # the worker is busy when its parent dies
    os._exit(0)  # killed: no shutdown of the pool
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` is alive (not gone, not a zombie nobody reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads a process's state from /proc")
def test_compile_workers_exit_when_their_parent_dies():
    """`popjax compile --jobs N`'s workers (`exit_with_parent`) do not outlive a killed parent: a
    busy worker exits within seconds of its parent's death (an orphan would also hold the
    parent's stdout open: ``subprocess.run`` then times out)."""
    out = subprocess.run([sys.executable, "-c", PARENT_THAT_DIES], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    worker = int(out.stdout.split()[0])
    deadline = time.monotonic() + 20
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(worker), f"worker {worker} outlived its parent"
