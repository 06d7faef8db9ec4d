"""``popjax plan``: per-device memory from XLA's ahead-of-time compile of the engine's programs
(no weights allocated) agrees with what a real model and its decode state actually allocate; the
CLI makes fake CPU devices for a mesh; bad input fails clearly."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import popjax
from popjax import engine
from popjax.analysis.memory_plan import check_hosts, memory_plan, parse_mesh, published_configs, resolve_config
from popjax.analysis.shape_fitted import ShapeModel, shape_fitted
from popjax.cli import build_parser, main
from popjax.methods import METHODS, POP, MethodError, PrefillOnly, parse_method_spec
from popjax.methods.prefill_only.skip import skipped_layers
from popjax.models.config import ConfigError, ModelConfig
from popjax.requests import GenerationRequest
from popjax.sharding import make_mesh
from tests.conftest import TINY_BASE, tiny_program_env

TINY = dict(TINY_BASE, model_type="llama", architectures=["LlamaForCausalLM"], num_key_value_heads=2,
            tie_word_embeddings=False, rope_theta=10000.0)


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


@pytest.mark.parametrize("method", [popjax.Dense(), popjax.POP(0.3, aggregate="per_sequence")], ids=["dense", "pop"])
def test_plan_agrees_with_the_allocated_model_and_state(method, tiny_checkpoints, config_file):
    directory, _ = tiny_checkpoints("llama-gqa")
    model = popjax.load(directory, cache=False)
    cfg = resolve_config(str(config_file))
    assert cfg.hidden_size == model.config.hidden_size and cfg.intermediate_size == model.config.intermediate_size
    batch, prompt, new = 4, 32, 32
    plan = memory_plan(cfg, make_mesh((1, 1)), method, batch, prompt + new, prompt, "float32")
    request = GenerationRequest.create(model, [[5] * prompt] * batch, new, method=method)
    carry, _ = request.start(model)
    x = plan["xla_per_device"]
    assert x["weights"] == pytest.approx(_nbytes(model.params), rel=0.10)
    assert x["kv_cache"] == pytest.approx(_nbytes(carry.state.caches), rel=0.10)
    assert x["method_state"] == pytest.approx(_nbytes(carry.state.method_states), rel=0.10)
    planned = x["weights"] + x["kv_cache"] + x["method_state"]
    assert planned == pytest.approx(_nbytes(model.params) + _nbytes(carry), rel=0.10)
    assert x["decode"]["alias"] == pytest.approx(_nbytes(carry), rel=0.10)  # the donated carry is updated in place
    assert plan["analytic_per_device"]["kv_cache"] == x["kv_cache"]
    assert plan["decode_step_cost"]["flops"] > 0 and plan["decode_step_cost"]["bytes_accessed"] > 0


@pytest.mark.slow  # compiles the scanned and the unrolled programs for their cost analyses
@pytest.mark.parametrize("method", [popjax.Dense(), popjax.POP(0.3, aggregate="per_sequence")], ids=["dense", "pop"])
def test_scanned_plan_matches_the_unrolled_plan(method):
    # 3 layers, so the decode cost extrapolated from 1 and 2 unrolled layers is a real prediction
    cfg = ModelConfig.from_hf_dict(dict(TINY, num_hidden_layers=3))
    unrolled = memory_plan(cfg, make_mesh((1, 1)), method, 2, 64, 16, "float32")
    scanned = memory_plan(cfg, make_mesh((1, 1)), method, 2, 64, 16, "float32", scan_layers=True)
    assert (unrolled["scan_layers"], scanned["scan_layers"]) == (False, True)
    for key in ("weights", "kv_cache", "method_state"):  # the stacked leaves hold the same bytes
        assert scanned["xla_per_device"][key] == unrolled["xla_per_device"][key], key
    assert scanned["xla_per_device"]["method_state"] > 0 or isinstance(method, popjax.Dense)
    assert scanned["analytic_per_device"] == unrolled["analytic_per_device"]
    cost, reference = scanned["decode_step_cost"], unrolled["decode_step_cost"]
    assert cost["flops"] == pytest.approx(reference["flops"], rel=1e-3)
    assert cost["bytes_accessed"] == pytest.approx(reference["bytes_accessed"], rel=1e-3)
    assert cost["scan_body_flops"] < 0.8 * cost["flops"]  # XLA counts the scan's body once: why it is extrapolated


def test_scanned_plan_refuses_per_layer_widths():
    widths = dict(TINY, intermediate_sizes=[96, 64])
    cfg = ModelConfig.from_hf_dict(widths)
    with pytest.raises(ValueError, match=r"intermediate_sizes=\[96, 64\].*unrolled"):
        memory_plan(cfg, make_mesh((1, 1)), popjax.Dense(), 1, 64, 16, "float32", scan_layers=True)


@pytest.mark.slow  # starts the CLI in a process with 8 fake devices
def test_cli_plans_a_mesh_on_fake_devices(config_file, tmp_path):
    out = tmp_path / "plan.json"
    env = tiny_program_env()
    cmd = [sys.executable, "-m", "popjax.cli", "plan", "--model", str(config_file), "--mesh", "2x2", "--batch", "2",
           "--context", "64", "--prompt", "16", "--dtype", "float32", "--method", "pop", "--ratio", "0.3", "--hosts", "4",
           "--json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(out.read_text())
    assert plan["devices"] == 4 and plan["mesh"] == {"data": 2, "model": 2}
    cfg = resolve_config(str(config_file))
    single = memory_plan(cfg, make_mesh((1, 1)), popjax.POP(0.3), 2, 64, 16, "float32")
    # vocabulary, heads and FFN channels split over model=2: about half the weights per device
    assert plan["xla_per_device"]["weights"] < 0.6 * single["xla_per_device"]["weights"]
    assert plan["xla_per_device"]["kv_cache"] == single["xla_per_device"]["kv_cache"] // 4  # batch/2, kv heads/2
    assert "decode peak" in result.stdout
    # four hosts of one chip each: a host reads only its chip's blocks (about half the weights
    # with model=2) while loading; converting holds the whole model on process 0
    hosts = plan["per_host"]
    assert (hosts["hosts"], hosts["chips_per_host"]) == (4, 1)
    assert 0.4 * hosts["host_ram_converting"] < hosts["host_ram_loading"] < 0.6 * hosts["host_ram_converting"]
    assert "host RAM loading" in result.stdout


# every method that fits arrays on a loaded model before it can bind (analysis/shape_fitted.py)
OFFLINE = [f"{name}:ratio=0.3" for name in ("teal", "cats", "wanda-sp", "flap", "glass", "larosa", "principal-teal:rank=2",
                                            "wina", "pop-bands", "pop-lowrank:rank=4", "static:block=16:block_order=calibrated")]
OFFLINE.append("prefill-only:kv=calibrated")


def test_cli_plans_teal_from_shapes_alone(config_file, tmp_path, capsys):
    """``popjax plan --method teal`` plans with shape-fitted placeholder thresholds, as ``popjax
    compile`` does (a plan needs shapes, not a calibration); it used to fail 'TEAL has no thresholds'."""
    out = tmp_path / "plan.json"
    code = main(["plan", "--model", str(config_file), "--context", "64", "--prompt", "16", "--dtype", "float32",
                 "--method", "teal", "--ratio", "0.3", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    plan = json.loads(out.read_text())
    assert plan["plan"] != "DensePlan" and "TEAL" in plan["method"]
    assert plan["xla_per_device"]["decode_peak"] > 0 and "decode peak" in capsys.readouterr().out


@pytest.mark.slow  # compiles the three programs of every offline method
@pytest.mark.parametrize("spec", OFFLINE)
def test_cli_plans_every_offline_method(spec, config_file, tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", "--model", str(config_file), "--context", "64", "--prompt", "16", "--dtype", "float32",
                 "--method", spec, "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["decode_step_cost"]["bytes_accessed"] > 0


def test_offline_methods_need_no_calibration_to_bind_a_plan():
    """Every offline method in `OFFLINE` refuses to bind unfitted (so the CLI test above checks the
    placeholders, not a method that needs none), and every method the registry holds plans."""
    cfg = resolve_config("llama-3.1-8b")
    for spec in OFFLINE:
        method = parse_method_spec(spec)
        if spec.startswith(("prefill-only", "static")):  # they bind, but their data needs the fit
            with pytest.raises(MethodError):
                method.data(ShapeModel(cfg, "bfloat16"))
        else:
            with pytest.raises(MethodError):
                method.bind(cfg)
        shape_fitted(method, cfg).bind(cfg)
    for name in METHODS:
        shape_fitted(parse_method_spec(name), cfg).bind(cfg)


def test_plan_and_compile_help_state_the_real_defaults(capsys, monkeypatch):
    """The defaults `popjax plan --help` and `popjax compile --help` state are the code's: each
    method's own aggregate mode, POP's gamma, Prefill-Only's kv, the CLI defaults."""
    monkeypatch.setenv("COLUMNS", "4000")  # argparse wraps at the terminal's width, and at hyphens
    parser = build_parser()
    helps = {}
    for command in ("plan", "compile"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        helps[command] = " ".join(capsys.readouterr().out.split())
    for name, cls in METHODS.items():
        field = {f.name: f for f in dataclasses.fields(cls)}.get("aggregate")
        if field is not None:  # "per_sequence for ..., pop, ..."
            stated = re.search(rf"(\w+) for [\w\s,-]*(?<![\w-]){re.escape(name)}(?![\w-])", helps["plan"].split("--aggregate AGGREGATE ")[-1])
            assert stated and stated.group(1) == field.default, (name, field.default)
    assert "shared (default)" not in helps["plan"]
    assert f"default {popjax.POP().gamma}" in helps["plan"] and "independent (default)" in helps["plan"]
    assert PrefillOnly().kv == "independent" and POP().partition == "global" and POP().weights == "compact"
    assert "(default last third)" in helps["plan"] and skipped_layers(PrefillOnly().skip, 9) == (6, 7, 8)
    plan_args = parser.parse_args(["plan", "--model", "x"])
    assert (plan_args.context, plan_args.mesh, plan_args.dtype, plan_args.method) == (4096, "1x1", "bfloat16", "dense")
    assert "default context/2, at least context - 4096" in helps["plan"] and "default context/2, at least context - 4096" in helps["compile"]
    assert engine.CAPACITY_BUCKETS[-1] == 4096  # the "4096" both helps state
    compile_args = parser.parse_args(["compile", "--model", "x"])
    assert (compile_args.topology, compile_args.method, compile_args.ratio, compile_args.context, compile_args.weights) == (
        "v5e:2x4", ["dense"], [0.4], 1024, "float")


def test_bad_input_fails_clearly(config_file, tmp_path):
    with pytest.raises(ValueError, match="'3x'"):
        parse_mesh("3x")
    with pytest.raises(ValueError, match="published config"):
        resolve_config("llama-9000")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(TINY, model_type="gpt2")))
    with pytest.raises(ConfigError, match="gpt2"):
        resolve_config(str(bad))
    cfg = resolve_config(str(config_file))
    with pytest.raises(ValueError, match="context"):
        memory_plan(cfg, make_mesh((1, 1)), popjax.Dense(), 1, 64, 64)
    with pytest.raises(ValueError, match=r"--hosts 3 must be a positive divisor of the mesh's 4 devices \(valid: \[1, 2, 4\]\)"):
        check_hosts(3, 4)


@pytest.mark.slow  # two CLI processes
def test_cli_refuses_bad_input_in_one_line(config_file, tmp_path):
    """`popjax plan` exits 2 with one line: a mesh that does not divide the model, and a scanned
    plan of a model whose layers differ in width."""
    cmd = [sys.executable, "-m", "popjax.cli", "plan", "--model", str(config_file), "--mesh", "1x3", "--context", "64"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=tiny_program_env(), timeout=300)
    assert result.returncode == 2 and "3" in result.stderr and "error" in result.stderr
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TINY, intermediate_sizes=[96, 64])))
    cmd = [sys.executable, "-m", "popjax.cli", "plan", "--model", str(path), "--context", "64", "--scan-layers"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=tiny_program_env(), timeout=300)
    assert result.returncode == 2 and "intermediate_sizes=[96, 64]" in result.stderr


def test_published_configs_are_supported():
    assert {"llama-3.1-8b", "llama-3.1-70b", "qwen3-8b", "qwen3-32b"} <= set(published_configs())
    for name in published_configs():
        assert resolve_config(name).num_hidden_layers >= 16
