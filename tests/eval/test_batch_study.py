"""The batch study (issue 10 item 3) on a tiny random model: records, batch invariance of dense,
BWAP's measured density following its schedule, the plots, the table, the CLI and the errors."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

import popjax
from popjax.cli import batch_study as batch_study_command
from popjax.eval.batch_study import (
    STUDY_METHODS,
    batch_study,
    batch_study_ids,
    check_batches,
    markdown_table,
    plot_study,
    study_methods,
)
from popjax.eval.tasks import NLLSettings, text_windows
from popjax.eval.teacher import teacher_forced
from popjax.methods import MethodError, kept_channels

TEXT = (
    "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
    "You are all resolved rather to die than to famish? Resolved. resolved."
)
BATCHES = (1, 2)
P, N, W = 8, 6, 4
BWAP_SMALL = dict(t_init=2, t_explore=1, t_prune=2)


@pytest.fixture(scope="module")
def model(char_model):
    return char_model


@pytest.fixture(scope="module")
def methods():
    return [
        ("dense", popjax.Dense()),
        ("pop", popjax.POP(0.3, aggregate="shared")),
        ("bwap", popjax.BWAP(0.3, **BWAP_SMALL)),
    ]


@pytest.fixture(scope="module")
def records(model, methods):
    return batch_study(model, methods, TEXT, batch_sizes=BATCHES, windows=W, prompt_tokens=P, decode_tokens=N)


def _get(records, label, b):
    (r,) = [r for r in records if r["label"] == label and r["batch_size"] == b]
    return r


def test_one_record_per_method_and_batch(records):
    assert sorted((r["label"], r["batch_size"]) for r in records) == sorted((m, b) for m in ("dense", "pop", "bwap") for b in BATCHES)
    for r in records:
        assert r["windows"] == W and r["decode_tokens"] == N and r["prompt_tokens"] == P
        assert len(r["nll_by_position"]) == N and len(r["density_by_step"]) == N
        assert np.isfinite(r["nll"]) and r["ppl"] == pytest.approx(np.exp(r["nll"]))
        assert r["density_mean"] == pytest.approx(np.mean(r["density_by_step"]))


def test_dense_is_independent_of_the_batch_and_shared_pop_is_not(records):
    d1, d2 = _get(records, "dense", 1), _get(records, "dense", 2)
    assert abs(d1["nll"] - d2["nll"]) < 1e-5
    np.testing.assert_allclose(d1["nll_by_position"], d2["nll_by_position"], atol=1e-5)
    assert d1["density_source"] == "static" and d1["density_by_step"] == [1.0] * N
    # a shared partition sees its batch-mate: batch 2 must change POP's NLL (the study batches for real)
    assert abs(_get(records, "pop", 1)["nll"] - _get(records, "pop", 2)["nll"]) > 1e-6


def test_study_nll_equals_teacher_forcing_in_batches(model, records):
    from popjax.eval.tasks import NLLSettings, text_windows

    prompts, targets = text_windows(model, TEXT, NLLSettings(P, N, W))
    method = popjax.POP(0.3, aggregate="shared")
    nll = np.concatenate([teacher_forced(model, method, prompts[i : i + 2], targets[i : i + 2])[0] for i in range(0, W, 2)])
    assert _get(records, "pop", 2)["nll"] == pytest.approx(float(nll.mean()), abs=1e-5)


def test_static_density_is_the_plan_budget_and_bwap_density_follows_its_schedule(model, records):
    cfg = model.config
    d, f = cfg.hidden_size, cfg.intermediate_size
    pop_plan = popjax.POP(0.3).bind(cfg)
    pop = _get(records, "pop", 1)
    assert pop["density_source"] == "static"
    np.testing.assert_allclose(pop["density_by_step"], pop_plan.ffn_weights_read(d) / (3 * d * f))
    k = kept_channels(cfg, 0.3)
    assert k < f
    # t_init=2, then cycles of 2 pruned + 1 exploration step: steps 0, 1 and 4 run dense
    want = [1.0, 1.0, k / f, k / f, 1.0, k / f]
    for b in BATCHES:
        r = _get(records, "bwap", b)
        assert r["density_source"] == "aux"
        np.testing.assert_allclose(r["density_by_step"], want, rtol=1e-6)


def test_generation_density_follows_the_same_schedule(model):
    prompts = [list(range(3, 3 + P)), list(range(20, 20 + P))]
    targets = np.array([list(range(40, 40 + N)), list(range(60, 60 + N))])
    (r,) = batch_study_ids(model, [("bwap", popjax.BWAP(0.3, **BWAP_SMALL))], prompts, targets, (2,), density_from="generation")
    k, f = kept_channels(model.config, 0.3), model.config.intermediate_size
    np.testing.assert_allclose(r["density_by_step"], [1.0, 1.0, k / f, k / f, 1.0], rtol=1e-6)  # N − 1 decode steps


def test_fidelity_to_dense(model, records):
    dense = _get(records, "dense", 1)
    assert dense["kl"] < 1e-6 and dense["agreement"] == 1.0
    # shared POP at batch 2: KL of its own teacher-forced log-probabilities, batch by batch
    prompts, targets = text_windows(model, TEXT, NLLSettings(P, N, W))
    kls, same = [], []
    for i in range(0, W, 2):
        _, ref = teacher_forced(model, popjax.Dense(), prompts[i : i + 2], targets[i : i + 2], with_logprobs=True)
        _, got = teacher_forced(model, popjax.POP(0.3, aggregate="shared"), prompts[i : i + 2], targets[i : i + 2],
                                with_logprobs=True)
        ref, got = ref.astype(np.float64), got.astype(np.float64)
        kls.append((np.exp(ref) * (ref - got)).sum(-1))
        same.append(ref.argmax(-1) == got.argmax(-1))
    pop = _get(records, "pop", 2)
    assert pop["kl"] > 1e-4
    np.testing.assert_allclose(pop["kl_by_position"], np.concatenate(kls).mean(0), rtol=1e-3, atol=1e-6)
    assert pop["agreement"] == pytest.approx(np.concatenate(same).mean())


def test_plots_and_table(records, tmp_path):
    paths = plot_study(records, tmp_path)
    assert [p.name for p in paths] == ["density_over_steps.png", "nll_vs_batch.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
    table = markdown_table(records)
    assert "| NLL b=1 | NLL b=2 | ΔNLL b=2−1 | KL b=1 | KL b=2 | target density | density b=1 | density b=2 |" in table
    for label in ("dense", "pop", "bwap"):
        assert f"| {label} |" in table


def test_bad_sizes_fail_clearly(model, methods):
    with pytest.raises(ValueError, match=r"windows=6 must be a positive multiple of every batch size \[1, 4\]"):
        batch_study(model, methods, TEXT, batch_sizes=(1, 4), windows=6, prompt_tokens=P, decode_tokens=N)
    with pytest.raises(ValueError, match=r"windows=4 .* \[2, 3\] \(e.g. 6\)"):
        check_batches(4, (2, 3))
    with pytest.raises(ValueError, match=r"batch_sizes=\[0\]"):
        check_batches(4, (0,))
    with pytest.raises(ValueError, match="density_from='sampled'"):
        batch_study_ids(model, methods, [[3] * P] * 2, np.zeros((2, N), np.int32), (1,), density_from="sampled")


def test_study_methods_and_cli():
    got = dict(study_methods(list(STUDY_METHODS) + ["griffin"], 0.4))
    assert got["pop"].aggregate == "shared" and got["static"].aggregate == "shared" and got["dynamic"].aggregate == "shared"
    assert got["bwap-no-memory"].memory is False and got["bwap-mean"].aggregate == "mean"
    assert got["bwap-every-step"].schedule == "every_step" and got["bwap"] == popjax.BWAP(0.4)
    assert got["teal"].ratio == 0.4 and got["cats"].ratio == 0.4 and got["griffin"].ratio == 0.4
    with pytest.raises(MethodError, match="unknown study method 'nope'"):
        study_methods(["nope"], 0.4)
    parser = argparse.ArgumentParser()
    batch_study_command.register(parser.add_subparsers())
    args = parser.parse_args(["batch-study", "--methods", "bwap,pop", "--batch-sizes", "1,8", "--json", "x.json"])
    assert args.methods == ["bwap", "pop"] and args.batch_sizes == [1, 8] and args.play == "coriolanus"
    assert (args.ratio, args.windows, args.prompt_tokens, args.decode_tokens) == (0.4, 8, 128, 256)
