"""``popjax eval --suite piqa-bbh`` on the tiny model and the fixture files: the selection rule,
per-question grades paired against dense, the JSON, the docs section (replaced, not appended,
when made again from the JSON) and the plot."""

from __future__ import annotations

import json
from pathlib import Path


from popjax.cli import main
from popjax.eval import benchmark_table, paired
from popjax.eval.benchmark_report import markdown, update_section

DATA = Path(__file__).parents[1] / "data"


def test_table_selects_pairs_and_writes_json_docs_and_plot(converted, tmp_path, monkeypatch, capsys):
    """On the random tiny model no BBH task is above chance by luck; a rigged first pass (dense
    answers every navigate question) checks the rule, and the pairing uses the real grades."""
    real = benchmark_table.evaluate_task

    def rigged(model, method, task, *args):
        record = real(model, method, task, *args)
        if method.name == "dense" and task.label == "bbh:navigate":
            n = record["examples"]
            record.update(acc=1.0, acc_ci=list(paired.wilson_interval(1.0, n)), grades=[1.0] * n)
        return record

    monkeypatch.setattr(benchmark_table, "evaluate_task", rigged)
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nHand-written text stays.\n")
    out, result_json = tmp_path / "out", tmp_path / "table.json"
    argv = ["eval", "--model", str(converted), "--suite", "piqa-bbh", "--data-dir", str(DATA), "--tasks", "bbh:navigate,bbh:date_understanding",
            "--methods", "dense,static", "--ratios", "0.3", "--limit", "4", "--batch-size", "2", "--json", str(result_json),
            "--out", str(out), "--docs", str(docs)]
    assert main(argv) == 0
    result = json.loads(result_json.read_text())
    assert [(s["task"], s["selected"]) for s in result["selection"]] == [
        ("piqa", True), ("bbh:navigate", True), ("bbh:date_understanding", False)]
    assert [(r["label"], r["task"]) for r in result["records"]] == [
        ("dense", "piqa"), ("dense", "bbh:navigate"), ("static", "piqa"), ("static", "bbh:navigate")]
    assert all(len(r["grades"]) == r["examples"] == 4 for r in result["records"])
    by = {(r["label"], r["task"]): r for r in result["records"]}
    for c in result["comparisons"]:  # each comparison is the paired statistic of the saved grades
        want = paired.paired_comparison(by[("dense", c["task"])]["grades"], by[(c["label"], c["task"])]["grades"])
        assert {k: c[k] for k in want} == json.loads(json.dumps(want))
    navigate = next(c for c in result["comparisons"] if c["task"] == "bbh:navigate")
    assert navigate["b"] == 4 - sum(by[("static", "bbh:navigate")]["grades"]) and navigate["c"] == 0
    assert [s["label"] for s in result["summary"]] == ["dense", "static"] and result["summary"][0]["tasks"] == 2
    assert result["examples_per_s"] > 0 and (out / "piqa_bbh.png").is_file() and (out / "report.md").is_file()
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\nHand-written text stays.\n") and text.count("<!-- piqa-bbh:converted begin -->") == 1
    assert "| static | 0.30 |" in text and "McNemar" in text and "](out/piqa_bbh.png)" in text
    assert "Difference from dense" in capsys.readouterr().out
    # made again from the JSON alone: the same section, replaced in place
    assert main(["eval", "--render", str(result_json), "--docs", str(docs)]) == 0
    again = docs.read_text()
    assert again.count("<!-- piqa-bbh:converted begin -->") == 1 and again.startswith("# Benchmarks\n\nHand-written")
    assert markdown(result) in again


def test_update_section_replaces_only_its_own_section(tmp_path):
    doc = tmp_path / "d.md"
    update_section(doc, "a", "one", "A")
    update_section(doc, "b", "two", "B")
    update_section(doc, "a", "three", "A")
    text = doc.read_text()
    assert "three" in text and "one" not in text and text.index("three") < text.index("two")


def test_table_refuses_bad_input_before_loading(tmp_path, capsys):
    assert main(["eval", "--suite", "piqa-bbh", "--methods", "pop"]) == 2
    assert "needs --data-dir DIR" in capsys.readouterr().err
    assert main(["eval", "--suite", "piqa-bbh", "--data-dir", str(DATA), "--tasks", "bigbench:x"]) == 2
    assert "BBH tasks only" in capsys.readouterr().err
    assert main(["eval", "--suite", "piqa-bbh", "--data-dir", str(tmp_path)]) == 2
    assert "no BBH tasks under" in capsys.readouterr().err
    assert main(["eval", "--suite", "piqa-bbh", "--data-dir", str(DATA), "--methods", "pop,nosuch"]) == 2
    assert "nosuch" in capsys.readouterr().err
    assert main(["eval", "--render", str(tmp_path / "missing.json")]) == 2
    assert "no such JSON" in capsys.readouterr().err
