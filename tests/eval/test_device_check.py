"""``popjax device-check``: the dry run (tiny shapes on CPU, Pallas in interpret mode) writes the
files the device run writes, and the budget stops it early with every file still written. No
time is asserted: structure, bytes and the kernel-vs-XLA difference are."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest

from popjax.bench import device_check, row_gather
from popjax.cli import main
from popjax.kernels import compiling_for

NAMES = {"device.json", "decode-float.json", "decode-int8.json", "row_gather.json", "check.json"}


def read(out):
    return {p.name: json.loads(p.read_text()) for p in out.iterdir()}


def check_dry_run(out, methods: set[str]) -> dict:
    files = read(out)
    assert set(files) == NAMES and len(files) <= device_check.MAX_FILES
    assert files["device.json"]["versions"]["jax"] and files["device.json"]["devices"][0]["platform"] == "cpu"
    assert files["check.json"]["stopped_by_budget"] is False
    for weights in ("float", "int8"):
        decode = files[f"decode-{weights}.json"]
        assert decode["complete"] and not decode["skipped"] and decode["model"]["synthetic"]
        assert {(r["method"], r["kernel"]) for r in decode["records"]} == {
            (name, k) for name, _, ks in device_check.METHODS if name in methods | {"dense"} for k in ks}
        for r in decode["records"]:
            assert "error" not in r, r
            assert r["step_s"] > 0 and len(r["step_s_samples"]) == device_check.DRY_PLAN.steps
            assert r["gb_s"] == pytest.approx(r["bytes_per_step"] / r["step_s"] / 1e9)
            assert r["kernel_resolved"] == ("pallas-interpret" if r["kernel"] == "pallas" else "xla")
        dense = next(r for r in decode["records"] if r["method"] == "dense")
        # analytic bytes: a method that keeps 60% of the channels for the whole batch reads fewer than dense
        # (per-row selections may read more at batch 2: their union plus the kernel's per-row masks)
        assert all(r["bytes_per_step"] < dense["bytes_per_step"] for r in decode["records"] if r["method"] in ("pop", "static"))
        kernels = {r["method"] for r in decode["records"] if r["kernel"] == "pallas"}
        assert len(decode["diffs"]) == len(kernels)
        for diff in decode["diffs"]:
            assert "error" not in diff, diff
            assert diff["finite"] and diff["max_abs_logprob_diff"] <= 1e-3, diff
    gather = files["row_gather.json"]
    assert gather["complete"] and gather["kernel"] == "pallas-interpret"
    assert len(gather["points"]) == len(device_check.DRY_PLAN.gather.rows)
    assert len(gather["fits"]) == 1 and gather["fits"][0]["points"] == len(gather["points"])
    return files


def test_dry_run_writes_every_file(tmp_path):
    out = tmp_path / "check"
    assert main(["device-check", "--dry-run", "--out", str(out), "--methods", "pop", "--budget-s", "3000"]) == 0
    check_dry_run(out, {"pop"})


def test_budget_stops_early_and_still_writes(tmp_path):
    """A budget spent before the first measurement: the weights are never drawn, every file is
    still written, each listing what it left out."""
    out = tmp_path / "check"
    assert main(["device-check", "--dry-run", "--out", str(out), "--budget-s", "0.01"]) == 0
    files = read(out)
    assert set(files) == NAMES and files["check.json"]["stopped_by_budget"] is True
    jobs = sum(len(ks) for _, _, ks in device_check.METHODS) * len(device_check.DRY_PLAN.batches)
    for weights in ("float", "int8"):
        decode = files[f"decode-{weights}.json"]
        assert not decode["complete"] and decode["records"] == [] and len(decode["skipped"]) == jobs
    assert not files["row_gather.json"]["complete"] and files["row_gather.json"]["points"] == []


def test_budget_ends_mid_run(tmp_path, monkeypatch):
    """The budget runs out after three checks (a clock that does not depend on this machine's
    speed): the measurements begun are kept, the rest are listed as skipped, and every file exists."""
    checks = iter(range(10**6))
    monkeypatch.setattr(device_check.Budget, "over", lambda self, reserve=0.0: next(checks) >= 3)
    out = tmp_path / "check"
    with jax.default_device(jax.devices("cpu")[0]), compiling_for("cpu"):
        summary = device_check.run_device_check(out, 60.0, dataclasses.replace(device_check.DRY_PLAN, methods=("pop",)))
    files = read(out)
    assert set(files) == NAMES and summary["stopped_by_budget"] is True
    float_, int8 = files["decode-float.json"], files["decode-int8.json"]
    # batch 2 in float: dense, POP through XLA and through the kernel; the diff after them was cut
    assert [(r["method"], r["kernel"]) for r in float_["records"]] == [("dense", "xla"), ("pop", "xla"), ("pop", "pallas")]
    assert float_["complete"] and float_["diffs"] == []
    assert int8["records"] == [] and len(int8["skipped"]) == 3 and not int8["complete"]
    assert not files["row_gather.json"]["complete"]


@pytest.mark.parametrize("argv, message", [
    (["--budget-s", "0"], r"--budget-s 0.0 is invalid"),
    (["--methods", "pop,glass"], r"'glass' is not a method of the check; choose from dense, pop"),
    (["--weights", "int4"], r"'int4' is not a weight format"),
])
def test_bad_flags_fail_in_one_line(tmp_path, capsys, argv, message):
    assert main(["device-check", "--dry-run", "--out", str(tmp_path / "x"), *argv]) == 2
    assert __import__("re").search(message, capsys.readouterr().err)


def test_per_row_cost_fit_recovers_a_line():
    fit = row_gather.fit_line([1000, 4000, 16000], [2e-5 + 1e-9 * n for n in (1000, 4000, 16000)])
    assert fit["per_call_s"] == pytest.approx(2e-5) and fit["per_row_s"] == pytest.approx(1e-9) and fit["r2"] == pytest.approx(1.0)
    assert row_gather.fit_line([1000, 1000], [1.0, 2.0]) is None
    with pytest.raises(ValueError, match="row_bytes 3000 is not a multiple of 2048"):
        row_gather.GatherGrid(row_bytes=(3000,))
