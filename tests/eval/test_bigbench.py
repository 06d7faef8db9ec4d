"""BIG-bench multiple choice: prompts as BIG-bench builds them, shots reproducible, choice scores
against a plain forward pass and against one teacher-forced row per choice, the metrics, the
lm-eval route, the sdist streamed into the cache, ``popjax eval`` and its errors."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest

import popjax
from popjax.cli import build_parser, main
from popjax.cli.eval_bigbench import check_bigbench
from popjax.eval import bigbench as bb
from popjax.eval.bigbench_score import choice_logprobs, compile_counts, encode_pair, evaluate_task, lm_eval_scores
from popjax.eval.teacher import teacher_forced

from tests.reference.lm import log_softmax

COLORS = {
    "name": "colors", "description": "toy", "keywords": [], "canary": "x", "metrics": ["multiple_choice_grade"],
    "preferred_score": "multiple_choice_grade", "task_prefix": "Pick one.",
    "examples": [
        {"input": "Sky?", "target_scores": {"d4": 0, "a1": 1, "c3": 0, "b2": 0}},
        {"input": "Grass?", "target_scores": {"a1": 0, "b2": 1, "c3": 0, "d4": 0}},
        {"input": "Sun?", "target_scores": {"a1": 0, "b2": 0, "c3": 0, "d4": 1}},
        {"input": "Rose?", "target_scores": {"a1": 0, "b2": 0, "c3": 1, "d4": 0}},
        {"input": "Sun?", "target_scores": {"a1": 0, "b2": 0, "c3": 0, "d4": 1}},  # a duplicate: BIG-bench drops it
    ],
}
PLAUSIBLE = {
    "name": "plausible", "description": "toy", "keywords": [], "canary": "x", "metrics": ["multiple_choice_grade"],
    "preferred_score": "multiple_choice_grade", "append_choices_to_input": False,
    "example_input_prefix": "\nStatement: ", "example_output_prefix": "\nPlausible? ",
    "examples": [{"input": f"Player {i} scored", "target_scores": {"yes": int(i % 3 == 0), "no": int(i % 3 != 0)}} for i in range(9)],
}
FREE = {"name": "free", "description": "toy", "keywords": [], "canary": "x", "metrics": ["exact_str_match"],
        "preferred_score": "exact_str_match", "examples": [{"input": "1+1=", "target": "2"}]}


def write_tasks(root) -> str:
    """The three toy tasks, and a container task with two subtasks, as BIG-bench lays them out."""
    for data in (COLORS, PLAUSIBLE, FREE):
        (root / data["name"]).mkdir(parents=True, exist_ok=True)
        (root / data["name"] / "task.json").write_text(json.dumps(data))
    parent = root / "family"
    for sub, data in (("alpha", COLORS), ("beta", PLAUSIBLE)):
        (parent / sub).mkdir(parents=True, exist_ok=True)
        (parent / sub / "task.json").write_text(json.dumps({**data, "name": sub}))
    (parent / "task.json").write_text(json.dumps({"name": "family", "description": "toy", "keywords": [], "canary": "x"}))
    return str(root)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("bigbench"))


def test_prompts_follow_bigbench_format(root):
    task = bb.load_task("bigbench:colors", root)
    assert task.examples == 4 and task.max_shots() == 3 and task.chance == pytest.approx(0.25)
    first = bb.build_queries(task)[0]
    # RandomState(42).permutation of the 4 sorted choices is [1, 3, 0, 2]; default prefixes
    assert first.prompt == "Pick one.\nQ: Sky?\n  choice: b2\n  choice: d4\n  choice: a1\n  choice: c3\nA: "
    assert first.choices == ("d4", "a1", "c3", "b2") and first.scores == (0, 1, 0, 0)
    q = bb.build_queries(bb.load_task("plausible", root))[1]
    assert q.prompt == "\nStatement: Player 1 scored\nPlausible? " and q.choices == ("yes", "no")
    assert [p[0] for p in bb.load_task("family", root).parts] == ["family/alpha", "family/beta"]
    assert bb.load_task("family/beta", root).examples == 9
    assert bb.list_tasks(root) == ["colors", "family", "plausible"]


def test_shots_and_limit_are_reproducible_and_drawn_from_other_examples(root):
    task = bb.load_task("plausible", root)
    two = bb.build_queries(task, shots=2, limit=5, seed=7)
    assert two == bb.build_queries(task, shots=2, limit=5, seed=7)
    assert two != bb.build_queries(task, shots=2, limit=5, seed=8)
    for q in two:
        *shots, query = q.prompt.split("\n\nStatement: ")
        shown = [s.removeprefix("\nStatement: ").split("\n")[0] for s in shots]
        own = query.split("\n")[0]
        assert len(shown) == 2 and own not in shown and len(set(shown)) == 2  # other examples, no repeats
        assert all(s.endswith(("? yes", "? no")) for s in shots)  # each shot ends with one of its targets
    zero = bb.build_queries(task, limit=4)
    assert len(zero) == 4 and len({q.prompt for q in zero}) == 4
    assert len(bb.build_queries(bb.load_task("family", root), limit=4)) == 4  # 2 per subtask


def test_bad_input_fails_with_one_clear_line(root):
    with pytest.raises(ValueError, match=r"unknown BIG-bench task 'colours'; close names: colors"):
        bb.load_task("bigbench:colours", root)
    with pytest.raises(ValueError, match="'free' has no multiple-choice examples .* exact_str_match"):
        bb.load_task("free", root)
    with pytest.raises(ValueError, match="unknown subtask 'family/gamma'"):
        bb.load_task("family/gamma", root)
    with pytest.raises(ValueError, match="--shots 4 is more than BIG-bench task 'colors' allows: at most 3"):
        bb.build_queries(bb.load_task("colors", root), shots=4)
    for argv, message in ((["--tasks", "bigbench:colours"], "close names: colors"),
                          (["--tasks", "bigbench:free"], "no multiple-choice examples"),
                          (["--tasks", "bigbench:colors", "--shots", "9"], "at most 3")):
        args = build_parser().parse_args(["eval", *argv, "--bigbench-dir", root])
        with pytest.raises(ValueError, match=message):  # checked before any model loads
            check_bigbench(args, [argv[1].removeprefix("bigbench:")])


def test_metrics_follow_bigbench_and_lm_eval():
    q = bb.Query("p", ("aa", "b", "cccc"), (0.0, 1.0, 0.5), "t")
    assert bb.grade(q, np.array([-3.0, -1.0, -2.0])) == 1.0
    assert bb.grade(q, np.array([-1.0, -5.0, -1.5])) == 0.0
    assert bb.norm_correct(q, np.array([-1.9, -1.0, -3.6])) == 0.0  # per character: -0.95, -1.0, -0.9 -> "cccc"
    # ties: BIG-bench picks among the maxima by sha256(scores) mod their count (here 2 of 3 -> index 3)
    assert bb.bigbench_argmax(bb.normalized(np.array([-2.0, -0.5, -0.5, -0.5]))) == 3
    assert bb.bigbench_argmax(bb.normalized(np.array([-1.0, -1.0, -4.0]))) == 0
    lo, hi = bb.wilson_interval(0.5, 100)
    assert (round(lo, 4), round(hi, 4)) == (0.4038, 0.5962)
    assert bb.wilson_interval(1.0, 10) == pytest.approx((0.7225, 1.0), abs=1e-4) and bb.wilson_interval(0.0, 10)[0] == 0.0


def _reference_logprob(model, prompt: str, choice: str) -> float:  # noqa: F811
    """Σ log p(choice tokens | prompt) from one dense forward pass and a NumPy log-softmax."""
    context, target = encode_pair(model.tokenizer, prompt, choice)
    logits = np.asarray(popjax.forward(model, [context + target]))[0]
    logp = log_softmax(logits[len(context) - 1 : len(context) - 1 + len(target)])
    return float(sum(logp[i, t] for i, t in enumerate(target)))


def test_choice_scores_equal_references_with_one_prefill_per_prompt(model, root):  # noqa: F811
    task = bb.load_task("colors", root)
    queries = bb.build_queries(task, shots=1)
    dense = choice_logprobs(model, popjax.Dense(), queries, batch_size=2)
    for q, got in zip(queries, dense):
        np.testing.assert_allclose(got, [_reference_logprob(model, q.prompt, c) for c in q.choices], atol=2e-4)
    pop = popjax.POP(ratio=0.3, aggregate="per_sequence")
    scored = choice_logprobs(model, pop, queries, batch_size=2)
    for q, got in zip(queries, scored):  # the vmapped choices equal one teacher-forced row per choice
        pairs = [encode_pair(model.tokenizer, q.prompt, c) for c in q.choices]
        want = [-teacher_forced(model, pop, [p], np.array([t]))[0].sum() for p, t in pairs]
        np.testing.assert_allclose(got, want, atol=2e-4)
    assert max(np.abs(a - b).max() for a, b in zip(dense, scored)) > 1e-3  # pruning changes the scores
    before = compile_counts()["bigbench_choices"]
    record = evaluate_task(model, pop, task, shots=1, batch_size=2)  # the same shapes: no new program
    assert compile_counts()["bigbench_choices"] == before and record["compiles"] == {}
    assert record["examples"] == 4 and record["acc"] == np.mean([bb.grade(q, s) for q, s in zip(queries, scored)])
    assert 0 <= record["acc_ci"][0] <= record["acc"] <= record["acc_ci"][1] <= 1 and record["examples_per_s"] > 0


def test_each_prompt_is_prefilled_once_for_all_its_choices(model):  # noqa: F811
    """XLA's FLOP estimate of the choice program: 8 one-token choices cost about what 1 does after
    a 200-token prompt (a prefill batched over the choices would cost ~8x)."""
    import jax.numpy as jnp

    from popjax.eval.bigbench_score import _choices_program

    plan = popjax.Dense().bind(model.config)
    tokens = jnp.ones((2, 256), jnp.int32)
    flops = []
    for k in (1, 8):
        compiled = _choices_program.lower(model.graphdef, model.params, plan, tokens, tokens, jnp.ones((k, 2, 1), jnp.int32)).compile()
        cost = compiled.cost_analysis()
        flops.append((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])
    assert flops[1] < 1.3 * flops[0]


def test_lm_eval_route_gives_the_same_numbers(converted, model, root, tmp_path):  # noqa: F811
    task = bb.load_task("plausible", root)
    method = popjax.POP(ratio=0.3, aggregate="per_sequence")
    ours = evaluate_task(model, method, task, shots=1, limit=6, batch_size=4)
    theirs = lm_eval_scores(model, method, task, tmp_path / "tasks", shots=1, limit=6, batch_size=4)
    queries = bb.build_queries(task, shots=1, limit=6)
    mine = choice_logprobs(model, method, queries, batch_size=4)
    for a, b in zip(mine, theirs["logprobs"]):
        np.testing.assert_allclose(a, b, atol=2e-4)
    assert (theirs["acc"], theirs["acc_norm"]) == (ours["acc"], ours["acc_norm"])
    out = tmp_path / "lm_eval.json"  # the command: bigbench:NAME written as a local task, the same draw
    assert main(["lm-eval", "--model", str(converted), "--tasks", "bigbench:plausible", "--bigbench-dir", root, "--bigbench-shots", "1",
                 "--limit", "6", "--method", "pop", "--ratio", "0.3", "--batch-size", "4", "--bootstrap-iters", "0",
                 "--json", str(out)]) == 0
    scores = json.loads(out.read_text())["results"]["bigbench_plausible"]
    assert (scores["acc,none"], scores["acc_norm,none"]) == (ours["acc"], ours["acc_norm"])


def test_tasks_stream_out_of_the_sdist_into_the_cache(tmp_path, monkeypatch):
    """A stand-in sdist in BIG-bench's layout: only the task files reach the cache entry."""
    from popjax.convert import pypi

    archive = tmp_path / "bigbench-1.0.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        for name, data in ((bb.TASKS_PREFIX + "colors/task.json", json.dumps(COLORS)),
                           (bb.TASKS_PREFIX + "colors/README.md", "# colors"),
                           (bb.TASKS_PREFIX + "family/alpha/task.json", json.dumps(COLORS)),
                           (bb.TASKS_PREFIX + "family/task.json", json.dumps({"name": "family"})),
                           ("bigbench-1.0.0/bigbench/api/json_task.py", "")):
            info = tarfile.TarInfo(name)
            info.size = len(data.encode())
            tf.addfile(info, io.BytesIO(data.encode()))
    monkeypatch.setenv("POPJAX_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(pypi, "download_sdist", lambda spec, filename: calls.append(spec) or archive)
    root = bb.default_root()
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != "entry.json")
    assert files == ["colors/task.json", "family/alpha/task.json", "family/task.json"]
    assert bb.default_root() == root and calls == [bb.SPEC]  # once
    assert bb.list_tasks() == ["colors", "family"]
    assert bb.load_task("bigbench:family/alpha").examples == 4
    with pytest.raises(ValueError, match="close names: colors"):
        bb.load_task("color")

    def refused(spec, filename):
        raise RuntimeError(f"could not download {spec} with `pip download`:\nERROR: No matching distribution found for {spec}\n")

    monkeypatch.setenv("POPJAX_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(pypi, "download_sdist", refused)
    with pytest.raises(FileNotFoundError, match=r"could not be downloaded \(ERROR: No matching distribution .*--bigbench-dir$"):
        bb.default_root()


def test_eval_command_runs_bigbench_tasks(converted, root, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "eval.json"
    code = main(["eval", "--model", str(converted), "--tasks", "bigbench:colors,bigbench:plausible", "--bigbench-dir", root,
                 "--methods", "dense,static", "--ratios", "0.3", "--limit", "4", "--batch-size", "4", "--json", str(out)])
    assert code == 0
    records = json.loads(out.read_text())["records"]
    assert [(r["method"], r["task"]) for r in records] == [
        ("dense", "bigbench:colors"), ("dense", "bigbench:plausible"), ("static", "bigbench:colors"), ("static", "bigbench:plausible")]
    assert all(r["examples"] == 4 and r["aggregate"] in (None, "per_sequence") for r in records)
    assert "| dense | 0.00 | bigbench:colors | 4 |" in capsys.readouterr().out
    assert main(["eval", "--tasks", "bigbench:colours", "--bigbench-dir", root]) == 2
    assert "close names: colors" in capsys.readouterr().err


def test_suite_selects_tasks_above_chance_and_ranks_methods(converted, root, tmp_path, monkeypatch, capsys):  # noqa: F811
    """On the tiny random model nothing is above chance by luck alone; a rigged first pass checks
    the rule, the ranks and the outputs."""
    import popjax.eval.bigbench_suite as suite

    real = suite.evaluate_task

    def rigged(model, method, task, *args):
        record = real(model, method, task, *args)
        known = task.name == "plausible"  # dense "knows" this one and no other
        acc = (1.0 if known else 0.0) if method.name == "dense" else 0.5
        record.update(acc=acc, acc_ci=list(bb.wilson_interval(acc, record["examples"])))
        return record

    monkeypatch.setattr(suite, "evaluate_task", rigged)
    out = tmp_path / "suite"
    code = main(["eval", "--model", str(converted), "--suite", "bigbench-mc", "--bigbench-dir", root, "--methods", "dense,static",
                 "--ratios", "0.3", "--limit", "6", "--batch-size", "4", "--json", str(tmp_path / "s.json"), "--out", str(out)])
    assert code == 0
    result = json.loads((tmp_path / "s.json").read_text())
    assert [s["task"] for s in result["selection"] if s["selected"]] == ["bigbench:plausible"]
    assert [(r["label"], r["task"]) for r in result["records"]] == [("dense", "bigbench:plausible"), ("static", "bigbench:plausible")]
    assert [(s["label"], s["mean_rank"]) for s in result["summary"]] == [("dense", 1.0), ("static", 2.0)]
    assert result["enough_tasks"] is False and (out / "bigbench_mc.png").is_file() and (out / "report.md").is_file()
    assert "| dense | 0.00 | 1.000 [" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.real_model
def test_two_real_tasks_on_the_default_model(tmp_path):
    """The sdist's real task files on the default model: BIG-bench's prompt, scores, the lm-eval route."""
    try:
        bb.default_root()
    except FileNotFoundError as err:  # the registry does not serve the sdist (pip's own last line)
        pytest.skip(str(err))
    model = popjax.load()
    sports = bb.load_task("bigbench:sports_understanding")
    assert bb.build_queries(sports, limit=8)[0].prompt.startswith(
        "Determine whether the following statement or statements are plausible or implausible:\nStatement: ")
    for name in ("sports_understanding", "winowhy"):
        record = evaluate_task(model, popjax.Dense(), bb.load_task(name), limit=8)
        assert record["examples"] == 8 and sum(record["compiles"].values()) <= 1 and 0 <= record["acc"] <= 1
    theirs = lm_eval_scores(model, popjax.Dense(), sports, tmp_path, limit=8)
    for a, b in zip(choice_logprobs(model, popjax.Dense(), bb.build_queries(sports, limit=8)), theirs["logprobs"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)  # the real BPE tokenizer splits prompt and choice alike
