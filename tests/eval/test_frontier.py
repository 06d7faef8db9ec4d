"""The frontier command (issue 15 part 1) on a tiny random model: records and their NLL/KL against
independent teacher forcing, FFN bytes against the plans and against XLA's cost analysis, the
Pareto fronts (a constructed domination), plots, the report, bench speeds, the CLI and bad input."""

from __future__ import annotations

import dataclasses
import json
import shlex

import numpy as np
import pytest

import popjax
from popjax.cli import main as cli_main
from popjax.eval.frontier import (
    GAMMAS,
    FrontierSettings,
    attach_bench,
    configurations,
    default_specs,
    deployed,
    ffn_bytes_per_token,
    frontier,
    mark_fronts,
    markdown_table,
    nll_batch_size,
    pareto_flags,
    xla_step_bytes,
)
from popjax.eval.frontier_plot import plot_frontier
from popjax.eval.tasks import NLLSettings, online_nll
from popjax.eval.teacher import teacher_forced
from popjax.methods import METHODS, MethodError, kept_channels

TEXT = (
    "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
    "You are all resolved rather to die than to famish? Resolved. resolved."
)
P, N, W, B = 8, 6, 4, 2
NLL = NLLSettings(P, N, W, B)
SPECS = ["static", "pop:gamma=0.2", "bwap:ratio=0.4:t_init=2:t_explore=1:t_prune=2"]  # bwap fixes its ratio: one config
RATIOS = [0.2, 0.4]
# XLA's change from dense for static vs the plan's FFN change: measured 3% apart on this model
# (the rest of the step is identical; small layout/copy differences remain). 10% is the bound.
XLA_TOLERANCE = 0.10


@pytest.fixture(scope="module")
def model(char_model):
    return char_model


@pytest.fixture(scope="module")
def records(model):
    return frontier(model, SPECS, RATIOS, TEXT, FrontierSettings(NLL, xla=False))


@pytest.fixture(scope="module")
def xla_records(model, records):
    """Dense and static with XLA's bytes (the teacher-forced programs are the fixture's, compiled)."""
    return frontier(model, ["static"], RATIOS, TEXT, FrontierSettings(NLL, xla=True))


def _get(records, method, ratio):
    (r,) = [r for r in records if r["method"] == method and r["ratio"] == ratio]
    return r


def test_one_record_per_configuration_with_plan_bytes(model, records):
    assert [(r["method"], r["ratio"]) for r in records] == [("dense", 0.0)] + [(m, q) for m in ("static", "pop") for q in RATIOS] + [("bwap", 0.4)]
    json.dumps(records)  # the JSON the CLI writes
    cfg, d, f, L = model.config, model.config.hidden_size, model.config.intermediate_size, model.config.num_hidden_layers
    dense = records[0]
    assert dense["ffn_bytes_per_token"] == L * 3 * d * f * 4 and dense["kl"] == pytest.approx(0.0, abs=1e-6)
    assert dense["delta_nll_vs_dense"] == 0.0 and dense["xla_bytes_per_step"] is None
    for q in RATIOS:
        k = kept_channels(cfg, q)
        assert _get(records, "static", q)["ffn_bytes_fraction"] == pytest.approx(k / f)
        pop = _get(records, "pop", q)
        m = min(round(0.2 * f / 2), f - k, k)
        assert pop["ffn_bytes_per_token"] == L * 4 * (2 * d * (k - m + 2 * m) + d * k)  # retained + candidates, then down
        assert pop["gamma"] == 0.2 and pop["label"] == "pop(gamma=0.2)" and pop["aggregate"] == "per_sequence"
        for r in (pop, _get(records, "static", q), _get(records, "bwap", 0.4)):
            assert r["kl"] > 1e-6 and np.isfinite(r["nll"]) and len(r["nll_by_position"]) == N
            assert len(r["nll_by_window"]) == r["windows"] and np.mean(r["nll_by_window"]) == pytest.approx(r["nll"], abs=1e-6)
    assert _get(records, "bwap", 0.4)["nll_batch_size"] == 1 and _get(records, "static", 0.4)["nll_batch_size"] == B


def test_nll_and_kl_equal_independent_teacher_forcing(model, records):
    from popjax.eval.tasks import text_windows

    pop = popjax.POP(0.4, gamma=0.2, aggregate="per_sequence")
    assert _get(records, "pop", 0.4)["nll"] == pytest.approx(online_nll(model, pop, TEXT, NLL)["nll"], abs=1e-5)
    prompts, targets = text_windows(model, TEXT, NLL)
    bwap = popjax.BWAP(0.4, t_init=2, t_explore=1, t_prune=2)  # one mask per batch: windows one at a time
    nll = [teacher_forced(model, bwap, prompts[i : i + 1], targets[i : i + 1], with_logprobs=True)[0] for i in range(W)]
    assert _get(records, "bwap", 0.4)["nll"] == pytest.approx(float(np.mean(nll)), abs=1e-5)
    static, kl = popjax.Static(0.2, aggregate="per_sequence"), []
    for i in range(0, W, B):  # the fixture's batches (its compiled programs)
        _, ref = teacher_forced(model, popjax.Dense(), prompts[i : i + B], targets[i : i + B], with_logprobs=True)
        _, got = teacher_forced(model, static, prompts[i : i + B], targets[i : i + B], with_logprobs=True)
        kl.append(np.sum(np.exp(ref) * (ref - got), axis=-1))
    assert _get(records, "static", 0.2)["kl"] == pytest.approx(float(np.mean(kl)), rel=1e-4)


def test_fronts_follow_the_definition(records):
    for q in RATIOS:
        group = [r for r in records if r["ratio"] == q]
        want = pareto_flags([r["ffn_bytes_per_token"] for r in group], [r["nll"] for r in group])
        assert [r["pareto"] for r in group] == want and any(want)
        assert [r["pareto_kl"] for r in group] == pareto_flags([r["ffn_bytes_per_token"] for r in group], [r["kl"] for r in group])
    assert records[0]["ffn_bytes_fraction"] == 1.0  # (a random model's NLL may even drop when pruned)
    assert [r["pareto_overall"] for r in records] == pareto_flags([r["ffn_bytes_per_token"] for r in records], [r["nll"] for r in records])


def test_constructed_domination():
    assert pareto_flags([1, 2, 0.5, 2], [1, 2, 3, 2]) == [True, False, True, False]
    assert pareto_flags([1, 1], [1, 1]) == [True, True]  # equal points do not dominate each other
    rec = lambda m, q, b, nll: {"method": m, "ratio": q, "ffn_bytes_per_token": b, "nll": nll, "kl": nll / 10}  # noqa: E731
    recs = [rec("dense", 0.0, 10, 1.0), rec("a", 0.2, 5, 2.0), rec("b", 0.2, 6, 2.5), rec("c", 0.4, 7, 3.0), rec("d", 0.4, 3, 4.0)]
    mark_fronts(recs)
    assert [r["pareto"] for r in recs] == [True, True, False, True, True]  # b: more bytes and worse NLL than a
    assert [r["pareto_overall"] for r in recs] == [True, True, False, False, True]  # c: dominated by a across ratios
    assert all("pareto_speed" not in r for r in recs)


def test_xla_bytes_track_the_plan_for_static(model, records, xla_records):
    dense = xla_records[0]
    assert dense["xla_bytes_per_step"] > dense["ffn_bytes_per_token"] and dense["xla_delta_vs_dense"] == 0.0  # the whole step
    for r, same in zip(xla_records, [records[0], *records[1:3]]):
        assert (r["method"], r["ratio"], r["nll"]) == (same["method"], same["ratio"], same["nll"])
    for q in RATIOS:
        static = popjax.Static(q, aggregate="per_sequence")
        assert deployed(static) == popjax.Static(q)  # compiled as a batch-1 deployment runs it (shared)
        plan_delta = ffn_bytes_per_token(model, static) - ffn_bytes_per_token(model, popjax.Dense())
        r = _get(xla_records, "static", q)
        assert r["plan_delta_vs_dense"] == plan_delta < 0
        assert abs(r["xla_delta_vs_dense"] - plan_delta) <= XLA_TOLERANCE * abs(plan_delta), (q, r["xla_delta_vs_dense"], plan_delta)
    assert xla_step_bytes(model, popjax.Static(0.4), list(range(3, 3 + P)), N) == _get(xla_records, "static", 0.4)["xla_bytes_per_step"]


def test_plots_table_and_bench(records, xla_records, tmp_path):
    recs = [dict(r) for r in records]
    assert "| static | 0.20 |" in markdown_table(xla_records) and "XLA Δ / plan Δ" in markdown_table(xla_records)
    paths = plot_frontier(recs, tmp_path)
    assert [p.name for p in paths] == ["nll_vs_ffn_bytes.png", "kl_vs_ffn_bytes.png"]
    bench = {"records": [
        {"method": "dense", "ratio": 0.0, "batch": 1, "decode_tokens_per_s": 50.0},
        {"method": "static", "ratio": 0.4, "batch": 1, "decode_tokens_per_s": 90.0},
        {"method": "static", "ratio": 0.4, "batch": 8, "decode_tokens_per_s": 300.0},  # another batch: ignored
        {"method": "pop", "ratio": 0.4, "batch": 1, "decode_tokens_per_s": 70.0},  # default γ = 0.1, not γ = 0.2
    ]}
    assert attach_bench(recs, bench) == 2
    assert _get(recs, "static", 0.4)["decode_tokens_per_s"] == 90.0 and "decode_tokens_per_s" not in _get(recs, "pop", 0.4)
    mark_fronts(recs)
    assert _get(recs, "static", 0.4)["pareto_speed"] and recs[0]["pareto_speed"]
    paths = plot_frontier(recs, tmp_path)
    assert paths[-1].name == "nll_vs_tokens_per_s.png" and all(p.stat().st_size > 1000 for p in paths)
    table = markdown_table(recs).splitlines()
    assert table[0].startswith("| method | ratio | FFN MB/token | × dense FFN | NLL |") and "decode tok/s" in table[0]
    rows = [line.split(" | ") for line in table[2 : 2 + len(recs)]]
    keys = [(float(row[1]), float(row[2])) for row in rows]
    assert keys == sorted(keys) and rows[0][0] == "| dense"  # ordered by ratio, then bytes


def test_byte_budget_filter(model):
    recs = frontier(model, ["static", "dynamic"], [0.4], TEXT, FrontierSettings(NLL, xla=False, max_bytes_fraction=0.5))
    assert [r["method"] for r in recs] == ["dense", "static"]  # dynamic reads 0.78 of dense; dense stays as the reference
    assert recs[1]["xla_bytes_per_step"] is None and "| dynamic |" not in markdown_table(recs)
    with pytest.raises(ValueError, match=r"max_bytes_fraction=0.05 .* the smallest is 0.3333 \(static at ratio 0.4\)"):
        frontier(model, ["static", "dynamic"], [0.4], TEXT, FrontierSettings(NLL, xla=False, max_bytes_fraction=0.05))
    with pytest.raises(ValueError, match=r"max_bytes_fraction=1.5 must be in \(0, 1\]"):
        frontier(model, ["static"], [0.4], TEXT, FrontierSettings(NLL, xla=False, max_bytes_fraction=1.5))


def test_bad_specs_fail_clearly(model):
    with pytest.raises(MethodError, match=r"method spec 'nope:gamma=0.1': unknown method 'nope'; valid methods"):
        configurations(["static", "nope:gamma=0.1"], RATIOS)
    with pytest.raises(MethodError, match=r"method spec 'pop:gamma=5'.*gamma=5 is outside \[0, 1\]"):
        configurations(["pop:gamma=5"], RATIOS)
    with pytest.raises(MethodError, match=r"method spec 'static:rank=3'.*takes no \['rank'\]"):
        configurations(["static:rank=3"], RATIOS)
    with pytest.raises(MethodError, match=r"no method specs given \(methods=\[\]\)"):
        configurations([], RATIOS)
    with pytest.raises(MethodError, match=r"no ratios given \(ratios=\[\]\)"):
        configurations(["static"], [])
    with pytest.raises(MethodError, match=r"ratio=1.5 is outside \[0, 1\)"):
        configurations(["static"], [1.5])
    with pytest.raises(MethodError, match="ratio=0.9 needs an FFN ratio"):
        frontier(model, ["static"], [0.9], TEXT, FrontierSettings(NLL, xla=False))


def test_default_sweep_and_batch_semantics():
    specs, skipped = default_specs()
    assert specs[0] == "dense" and "static" in specs and "prefill-only" in skipped and "layer-level" in skipped["prefill-only"]
    for name, cls in METHODS.items():
        fields = {f.name for f in dataclasses.fields(cls)}
        if "gamma" in fields and name not in skipped:
            assert [s for s in specs if s.split(":")[0] == name] == [f"{name}:gamma={g}" for g in GAMMAS]
    methods = dict((repr(m), m) for _, m in configurations(specs, [0.2]))  # every default spec builds
    assert len(methods) == len(specs)
    by_name = {m.name: m for m in methods.values()}
    assert by_name["static"].aggregate == "per_sequence" and by_name["teal"].aggregate == "per_token"
    assert nll_batch_size(by_name["bwap"], 8) == 1 and nll_batch_size(by_name["teal"], 8) == 8
    assert nll_batch_size(by_name["wanda-sp"], 8) == 8  # a fixed selection: batch-independent
    (_, shared), = configurations(["pop:aggregate=shared"], [0.2])[1:]
    assert shared.aggregate == "shared" and nll_batch_size(shared, 8) == 1  # the spec wins; batch-1 semantics kept


def test_cli_writes_json_report_and_plots(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("popjax.cli.frontier.load", lambda *a, **k: model)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"records": [{"method": "static", "ratio": 0.4, "batch": 1, "decode_tokens_per_s": 90.0}]}))
    out, js = tmp_path / "out", tmp_path / "frontier.json"
    base = ["frontier", "--text-file", str(text), "--nll-prompt-tokens", str(P), "--nll-decode-tokens", str(N),
            "--nll-windows", "2", "--batch-size", "2", "--ratios", "0.4"]
    argv = base + ["--methods", "static", "--no-xla", "--bench", str(bench), "--json", str(js), "--out", str(out)]
    assert cli_main(argv) == 0
    payload = json.loads(js.read_text())
    assert payload["command"] == "popjax " + shlex.join(argv)  # the report and the JSON name the command main() ran and [r["method"] for r in payload["records"]] == ["dense", "static"]
    assert payload["records"][1]["decode_tokens_per_s"] == 90.0 and payload["records"][1]["pareto"]
    report = (out / "report.md").read_text()
    assert "# popjax frontier" in report and "1 of 2 configurations measured" in report
    for name in ("nll_vs_ffn_bytes", "kl_vs_ffn_bytes", "nll_vs_tokens_per_s"):
        assert f"![{name}]({name}.png)" in report and (out / f"{name}.png").is_file()
    capsys.readouterr()
    assert cli_main(base + ["--methods", "static,bogus"]) == 2
    assert "method spec 'bogus': unknown method 'bogus'" in capsys.readouterr().err
    assert cli_main(base + ["--methods", ","]) == 2
    assert "no method specs given" in capsys.readouterr().err
    assert cli_main(base + ["--methods", "static", "--bench", str(tmp_path / "missing.json")]) == 2
    assert "bench file" in capsys.readouterr().err
    bench.write_text(json.dumps({"records": []}))
    assert cli_main(base + ["--methods", "static", "--bench", str(bench)]) == 2
    assert "holds no records with decode_tokens_per_s" in capsys.readouterr().err
    assert cli_main(base + ["--methods", "static", "--no-xla", "--max-bytes-fraction", "0.1"]) == 2
    assert "no configuration reads at most max_bytes_fraction=0.1" in capsys.readouterr().err
