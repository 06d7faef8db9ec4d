"""popjax as an lm-evaluation-harness model: scores against a plain forward pass, local tasks run
offline end to end (Python API and ``popjax lm-eval``), pruning changes scores, bad model args."""

from __future__ import annotations

import json

import lm_eval
import numpy as np
import pytest
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows

import popjax
from popjax.eval.lm_eval_adapter import PopjaxLM
from tests.reference.lm import log_softmax

@pytest.fixture(scope="module")
def dense_lm(model):
    return PopjaxLM(source=model, batch_size=4)


def _instances(kind, args_list):
    return [Instance(kind, {}, args, i) for i, args in enumerate(args_list)]


def _forward_score(model, context, targets):
    """Σ log p(targets | context) and whether each target is the argmax, from one forward pass."""
    logits = np.asarray(popjax.forward(model, [list(context) + list(targets)]))[0]
    rows = logits[len(context) - 1 : len(context) - 1 + len(targets)]
    logp = log_softmax(rows)
    return float(sum(logp[j, t] for j, t in enumerate(targets))), bool((rows.argmax(-1) == targets).all())


# continuations of 5-8 tokens and short contexts: one compile bucket (B 4, N 8, T 32) serves all
REQUESTS = [("The cat", " sat on"), ("Hello world.", " Bye!"), ("", "abcde"), ("x = ", "12;\n")]


def test_popjax_is_registered_with_lm_eval():
    assert get_model("popjax") is PopjaxLM


def test_dense_loglikelihood_equals_forward_pass(dense_lm, model):
    out = dense_lm.loglikelihood(_instances("loglikelihood", REQUESTS), disable_tqdm=True)
    tok = model.tokenizer
    for (context, continuation), (score, greedy) in zip(REQUESTS, out):
        if context:  # as lm-eval's HFLM: trailing spaces join the continuation, encode jointly, split
            stripped = context.rstrip()
            context, continuation = stripped, context[len(stripped) :] + continuation
            ctx = tok.encode(context)
            targets = tok.encode(context + continuation)[len(ctx) :]
        else:  # empty context: the BOS token conditions the continuation
            ctx, targets = [tok.bos_token_id], tok.encode(continuation)
        expected, expected_greedy = _forward_score(model, ctx, targets)
        assert score == pytest.approx(expected, abs=1e-4)
        assert greedy == expected_greedy


def test_is_greedy_on_the_argmax_continuation(dense_lm, model):
    context = model.tokenizer.encode("Once upon")
    greedy = []
    for _ in range(6):
        logits = np.asarray(popjax.forward(model, [context + greedy]))[0, -1]
        greedy.append(int(logits.argmax()))
    other = greedy[:5] + [(greedy[5] + 1) % model.config.vocab_size]
    out = dense_lm._loglikelihood_tokens([(None, context, greedy), (None, context, other)] * 2, disable_tqdm=True)
    (score, is_greedy), (_, other_greedy) = out[:2]
    assert is_greedy and not other_greedy
    assert score == pytest.approx(_forward_score(model, context, greedy)[0], abs=1e-4)


def test_dense_rolling_loglikelihood_equals_forward_windows(model):
    lm = PopjaxLM(source=model, batch_size=4, max_length=16)
    text = "All the world's a stage, and all the men and women merely players."
    (score,) = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]), disable_tqdm=True)
    expected, windows = 0.0, 0
    for inputs, predicted in get_rolling_token_windows(model.tokenizer.encode(text), 1, 16, 1):
        logp = log_softmax(np.asarray(popjax.forward(model, [inputs]))[0])
        offset = len(inputs) - len(predicted)
        expected += sum(logp[offset + j, t] for j, t in enumerate(predicted))
        windows += 1
    assert windows > 2  # the text spans several windows
    assert score == pytest.approx(expected, abs=1e-3)


def test_pruning_changes_scores_and_per_sequence_scores_ignore_the_batch(dense_lm, model):
    pop = PopjaxLM(source=model, method="pop", ratio=0.4, batch_size=4)
    assert pop.method.aggregate == "per_sequence"  # the adapter's default
    instances = _instances("loglikelihood", REQUESTS)
    dense = np.array([s for s, _ in dense_lm.loglikelihood(instances, disable_tqdm=True)])
    pruned = np.array([s for s, _ in pop.loglikelihood(instances, disable_tqdm=True)])
    assert np.abs(dense - pruned).max() > 1e-3
    # the same request among other batch-mates (same shapes, so no new compile)
    mates = pop.loglikelihood([instances[0]] + [instances[2]] * 3, disable_tqdm=True)
    assert mates[0][0] == pytest.approx(pruned[0], abs=1e-5)


def test_uniform_shapes_pad_requests_to_one_compile_with_the_same_scores(model):
    """uniform_shapes pads every request to the call's largest buckets (one compile per method):
    per-sequence POP's scores do not move, and a long context no longer splits the batch."""
    requests = REQUESTS + [("A much longer context, " * 6, " and more")]
    instances = _instances("loglikelihood", requests)
    plain = PopjaxLM(source=model, method="pop", ratio=0.4, batch_size=8)
    uniform = PopjaxLM(source=model, method="pop", ratio=0.4, batch_size=8, uniform_shapes="True")
    assert uniform.uniform_shapes and not plain.uniform_shapes
    expected = [s for s, _ in plain.loglikelihood(instances, disable_tqdm=True)]
    got = [s for s, _ in uniform.loglikelihood(instances, disable_tqdm=True)]
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_shared_aggregate_batches_only_equal_length_continuations(model):
    """In the paper's batch-shared mode a 7-token and a 5-token continuation are never batched
    together, so the shorter one's padding cannot enter the longer one's decode statistics."""
    shared = PopjaxLM(source=model, method="pop", ratio=0.4, aggregate="shared", batch_size=4)
    together = shared.loglikelihood(_instances("loglikelihood", REQUESTS[:2]), disable_tqdm=True)
    alone = shared.loglikelihood(_instances("loglikelihood", REQUESTS[:1]), disable_tqdm=True)
    assert together[0][0] == alone[0][0]


# two choices of ≤ 4 tokens each: the command's --limit 2 then runs the same shapes as 4 docs
MC_DOCS = [
    {"question": "2 + 2 =", "choices": ["4", "22"], "answer": 0},
    {"question": "The sky is", "choices": ["red", "sky"], "answer": 1},
    {"question": "Cats say", "choices": ["moo", "mew"], "answer": 1},
    {"question": "Ice is", "choices": ["hot", "icy"], "answer": 1},
]
GEN_DOCS = [{"prompt": "Say hi", "answer": "hi"}, {"prompt": "Count: 1 2", "answer": " 3"}]


def write_tasks(directory) -> None:
    """A multiple-choice and a generation task over local JSON lines, as a user would write them."""
    directory.mkdir(exist_ok=True)
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (directory / "toy_mc.yaml").write_text(
        "task: toy_mc\n" + common.format(directory / "mc.jsonl")
        + 'output_type: multiple_choice\ndoc_to_text: "Q: {{question}}\\nA:"\n'
        + "doc_to_choice: choices\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n"
    )
    (directory / "toy_gen.yaml").write_text(
        "task: toy_gen\n" + common.format(directory / "gen.jsonl")
        + 'output_type: generate_until\ndoc_to_text: "{{prompt}}:"\ndoc_to_target: answer\n'
        + 'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 6\n'
        + "metric_list:\n  - metric: exact_match\n"
    )


def _expected_generations(model, prompts, method):
    """Greedy continuations cut at the task's stop strings, straight from popjax."""
    ids, _ = popjax.generate_ids(model, [model.tokenizer.encode(p) for p in prompts], max_new_tokens=6, method=method)
    texts = [model.tokenizer.decode(row, skip_special_tokens=True) for row in ids]
    return [text.split("\n")[0].split(".")[0] for text in texts]


def test_local_tasks_run_offline_through_simple_evaluate(converted, model, tmp_path):
    write_tasks(tmp_path / "tasks")
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    out = lm_eval.simple_evaluate(
        model="popjax",
        model_args=f"source={converted},method=pop,ratio=0.2,gamma=0.1,batch_size=4",
        tasks=["toy_mc", "toy_gen"],
        task_manager=manager,
        bootstrap_iters=0,
    )
    acc = out["results"]["toy_mc"]["acc,none"]
    assert acc in {0.0, 0.25, 0.5, 0.75, 1.0}
    assert 0.0 <= out["results"]["toy_gen"]["exact_match,none"] <= 1.0
    # the scores lm-eval saw are the adapter's, request by request
    pop = PopjaxLM(source=model, method="pop", ratio=0.2, gamma=0.1)
    mc = sorted(out["samples"]["toy_mc"], key=lambda s: s["doc_id"])
    direct = pop.loglikelihood(_instances("loglikelihood", [a for s in mc for a in s["arguments"]]), disable_tqdm=True)
    for k, (sample, doc) in enumerate(zip(mc, MC_DOCS)):
        mine = [score for score, _ in direct[2 * k : 2 * k + 2]]
        np.testing.assert_allclose(mine, [r[0][0] for r in sample["resps"]], atol=1e-5)
        assert float(np.argmax(mine) == doc["answer"]) == sample["acc"]
    assert acc == np.mean([s["acc"] for s in mc])
    gen = sorted(out["samples"]["toy_gen"], key=lambda s: s["doc_id"])
    expected = _expected_generations(model, [d["prompt"] + ":" for d in GEN_DOCS], pop.method)
    assert [s["resps"][0][0] for s in gen] == expected


def test_lm_eval_command_writes_results(converted, tmp_path, capsys):
    from popjax.cli import main

    write_tasks(tmp_path / "tasks")
    path = tmp_path / "out" / "lm_eval.json"
    code = main([
        "lm-eval", "--tasks", "toy_mc", "--include-path", str(tmp_path / "tasks"), "--model", str(converted),
        "--method", "pop", "--ratio", "0.2", "--limit", "2", "--batch-size", "4", "--bootstrap-iters", "0",
        "--json", str(path),
    ])
    assert code == 0
    record = json.loads(path.read_text())
    assert record["results"]["toy_mc"]["sample_len"] == 2
    assert 0.0 <= record["results"]["toy_mc"]["acc,none"] <= 1.0
    assert record["method"] == repr(popjax.POP(ratio=0.2, aggregate="per_sequence"))
    assert "toy_mc" in capsys.readouterr().out  # lm-eval's table


def test_lm_eval_command_rejects_an_unknown_task(tmp_path, capsys):
    from popjax.cli import main

    write_tasks(tmp_path / "tasks")
    code = main(["lm-eval", "--tasks", "toy_mc,no_such_task", "--include-path", str(tmp_path / "tasks"),
                 "--no-builtin-tasks"])
    assert code == 2
    assert "no_such_task" in capsys.readouterr().err


def test_unknown_model_args_are_named_with_the_valid_ones(model, converted):
    with pytest.raises(ValueError, match=r"\['colour'\].*'source'.*'gamma'"):
        PopjaxLM(source=model, method="pop", ratio=0.2, colour="red")
    with pytest.raises(ValueError, match=r"\['bogus'\]"):
        lm_eval.simple_evaluate(model="popjax", model_args=f"source={converted},bogus=3", tasks=["toy_mc"])
    with pytest.raises(ValueError, match=r"\['ratio'\].*method='dense'"):
        PopjaxLM(source=model, ratio=0.2)
    with pytest.raises(popjax.MethodError, match="'nope'.*valid methods"):
        PopjaxLM(source=model, method="nope")
    with pytest.raises(ValueError, match="batch_size=0"):
        PopjaxLM(source=model, batch_size=0)
    with pytest.raises(ValueError, match="max_length=100000"):
        PopjaxLM(source=model, max_length=100000)


def test_default_aggregates_make_scores_batch_independent_where_the_method_allows():
    from popjax.eval.lm_eval_adapter import build_method

    teal = build_method("teal", {"ratio": 0.2})
    assert teal.aggregate == "per_token" and teal.batch_independent
    bwap = build_method("bwap", {"ratio": 0.2})  # aggregates over the batch in every mode
    assert bwap.aggregate == "max" and not bwap.batch_independent
    shared = build_method("pop", {"ratio": 0.2, "aggregate": "shared"})
    assert shared.aggregate == "shared" and not shared.batch_independent
    composed = build_method("prefill-only+pop", {"ratio": 0.2, "kv": "none"})
    assert composed.mlp_method.aggregate == "per_sequence" and composed.batch_independent
    with pytest.raises(ValueError, match=r"\['colour'\].*'kv'.*'ratio'"):
        build_method("prefill-only+pop", {"colour": "red"})


def test_lengths_and_models_the_adapter_cannot_score(model, tiny_checkpoints):
    short = PopjaxLM(source=model, max_length=16)
    with pytest.raises(ValueError, match="continuation of 17 tokens exceeds max_length=16"):
        short._loglikelihood_tokens([(None, [1], list(range(3, 20)))], disable_tqdm=True)
    request = Instance("generate_until", {}, ("Hi", {"until": ["\n"], "max_gen_toks": 16}), 0)
    with pytest.raises(ValueError, match="max_gen_toks=16 must be in"):
        short.generate_until([request], disable_tqdm=True)
    directory, _ = tiny_checkpoints("llama-gqa")  # no tokenizer files
    with pytest.raises(ValueError, match="has no tokenizer"):
        PopjaxLM(source=popjax.load(directory, cache=False))


def test_lm_eval_command_checks_the_task_directory(tmp_path, capsys):
    from popjax.cli import main

    assert main(["lm-eval", "--tasks", "toy_mc", "--include-path", str(tmp_path / "missing")]) == 2
    assert "missing is not a directory" in capsys.readouterr().err
    assert main(["lm-eval", "--tasks", "toy_mc", "--no-builtin-tasks"]) == 2
    assert "--no-builtin-tasks needs --include-path" in capsys.readouterr().err


def test_lm_eval_command_names_a_bad_model_arg(converted, tmp_path, capsys):
    from popjax.cli import main

    write_tasks(tmp_path / "tasks")
    code = main(["lm-eval", "--tasks", "toy_mc", "--include-path", str(tmp_path / "tasks"),
                 "--model", str(converted), "--method", "pop", "--model-args", "bogus=1"])
    assert code == 2
    assert "bogus" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.real_model
def test_default_model_scores_with_its_bpe_tokenizer():
    """The real tokenizer merges spaces into words: the joint-encoding split must still match a
    forward pass, and the model must prefer the right answer."""
    model = popjax.load()
    lm = PopjaxLM(source=model, batch_size=4)
    requests = [("The capital of France is", " Paris"), ("The capital of France is", " Berlin"),
                ("Water freezes at 0 degrees ", "Celsius"), ("", "Hello there")]
    out = lm.loglikelihood(_instances("loglikelihood", requests), disable_tqdm=True)
    for (context, continuation), (score, _) in zip(requests, out):
        if context:
            stripped = context.rstrip()
            ctx = lm.tok_encode(stripped)
            targets = lm.tok_encode(context + continuation)[len(ctx) :]
        else:
            ctx, targets = [lm.prefix_token_id], lm.tok_encode(continuation)
        assert score == pytest.approx(_forward_score(model, ctx, targets)[0], abs=1e-3)
    assert out[0][0] > out[1][0]  # Paris over Berlin
