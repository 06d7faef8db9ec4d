"""Safe ``kernel="auto"`` (`popjax.kernels.fallback`, docs/kernels.md "When a kernel does not
build"): a Pallas kernel that does not build at a method's shapes makes "auto" generate through
XLA, with one warning and a record of what ran, and releases the weight copies only the kernel
read; "pallas" raises in one line; on this CPU "auto" is XLA and builds nothing "xla" does not.

The failure is forced: a kernel builder replaced by a primitive whose lowering raises (what a
Mosaic or Triton refusal is to the trial), and "auto" made to pick Pallas' interpret mode on
this CPU, which the trial then builds as it builds a TPU's or a GPU's kernels.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir

import popjax
from popjax import kernels, requests
from popjax.analysis.tpu_compile import tpu_compile
from popjax.analysis.tpu_report import format_report
from popjax.generation import generate_ids
from popjax.kernels import fallback, matvec_tpu
from tests.accelerators.kernel_paths import placeholder_thresholds
from tests.accelerators.targets import MOSAIC_CALL, SHAPES, config
from tests.conftest import random_prompts

pytestmark = pytest.mark.slow  # Pallas interpret mode and the engine's programs, twice

FORCED = "Mosaic failed to compile gather_matvec: forced failure at lowering"

_broken = Primitive("popjax_forced_kernel_failure")
_broken.def_abstract_eval(lambda x, *, n: jax.core.ShapedArray((x.shape[0], n), x.dtype))


def _refuse(ctx, x, *, n):
    raise RuntimeError(f"{FORCED}\nwhat a compiler says next")


mlir.register_lowering(_broken, _refuse)


def broken_matvec(x, rows, ids, *, out_features, **_):
    """A matvec kernel builder whose result lowers for no platform (a compiler's refusal)."""
    return _broken.bind(x, n=out_features)


@pytest.fixture
def fresh_records(monkeypatch):
    """Fresh trial, fallback and request records (they live as long as the process)."""
    monkeypatch.setattr(fallback, "_TRIALS", {})
    monkeypatch.setattr(fallback, "_FALLBACKS", {})
    monkeypatch.setattr(requests, "_CHECKED", set())


@pytest.fixture
def auto_picks_pallas(monkeypatch, fresh_records):
    """"auto" resolves to Pallas (interpret mode) on this CPU and interpret mode is tried as a
    compiled kernel is."""
    monkeypatch.setitem(kernels._PALLAS_BACKENDS, "cpu", "pallas-interpret")
    monkeypatch.setattr(fallback, "TRIED", (*fallback.TRIED, "pallas-interpret"))
    monkeypatch.setitem(fallback._PLATFORMS, "pallas-interpret", "cpu")


def _prompts(model):
    return random_prompts(np.random.default_rng(0), (9, 6), model.config.vocab_size)


def _fallback_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "falls back to XLA" in str(w.message)]


def test_auto_falls_back_to_xla_once(tiny_model, auto_picks_pallas, monkeypatch):
    """POP's gather_matvec does not build: "auto" generates XLA's tokens, warns once (naming the
    method, the kernel and the compiler's first line), records "xla (fallback: ...)" for the
    bench and compile JSON (`fallback.ran`), and a second generate neither re-tries nor warns."""
    model, prompts = tiny_model, _prompts(tiny_model)
    want = np.asarray(generate_ids(model, prompts, 6, method=popjax.POP(ratio=0.4, kernel="xla"), ignore_eos=True)[0])
    auto = popjax.POP(ratio=0.4)
    assert auto.bind(model.config).kernel == "pallas-interpret"  # the fixture: "auto" picks the kernel
    monkeypatch.setattr(matvec_tpu, "gather_matvec", broken_matvec)
    with pytest.warns(RuntimeWarning) as record:
        got = np.asarray(generate_ids(model, prompts, 6, method=auto, ignore_eos=True)[0])
    np.testing.assert_array_equal(got, want)
    (message,) = _fallback_warnings(record)
    assert message.startswith("pop(ratio=0.4): kernel='auto' falls back to XLA") and "gather_matvec" in message
    assert FORCED in message and "what a compiler says next" not in message
    assert fallback.ran(auto.bind(model.config)) == f"xla (fallback: gather_matvec: {FORCED})"
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        again = np.asarray(generate_ids(model, prompts, 6, method=auto, ignore_eos=True)[0])
    np.testing.assert_array_equal(again, want)
    assert not _fallback_warnings(later)


def test_explicit_pallas_raises_in_one_line(tiny_model, auto_picks_pallas, monkeypatch):
    """kernel="pallas" has no fallback: the request names the method, the kernel and the line."""
    monkeypatch.setattr(matvec_tpu, "gather_matvec", broken_matvec)
    with pytest.raises(fallback.KernelUnavailable) as err:
        generate_ids(tiny_model, _prompts(tiny_model), 4, method=popjax.POP(ratio=0.4, kernel="pallas"), ignore_eos=True)
    text = str(err.value)
    assert text.startswith("pop(ratio=0.4, kernel=pallas): kernel='pallas' was asked for") and "gather_matvec" in text
    assert FORCED in text and "use kernel='auto'" in text and "\n" not in text


def test_a_fallback_releases_the_kernels_copies(tiny_model, auto_picks_pallas, monkeypatch):
    """TEAL's kernel reads input-major copies of the FFN (`LoadedModel.derived`); when its
    masked_matvec does not build, "auto" generates XLA's tokens and the model holds no copy
    that XLA's TEAL would not (one warning)."""
    cfg = tiny_model.config
    teal = placeholder_thresholds(cfg, popjax.TEAL(ratio=0.4))
    plain = dataclasses.replace(tiny_model)  # the same weights, no derived copies (`LoadedModel._derived`)
    want = np.asarray(generate_ids(plain, _prompts(plain), 4, method=dataclasses.replace(teal, kernel="xla"), ignore_eos=True)[0])
    xla_copies = plain.derived_names()
    model = dataclasses.replace(tiny_model)
    monkeypatch.setattr(matvec_tpu, "masked_matvec", lambda x, rows, active, *, out_features, **_: _broken.bind(x, n=out_features))
    with pytest.warns(RuntimeWarning) as record:
        got = np.asarray(generate_ids(model, _prompts(model), 4, method=teal, ignore_eos=True)[0])
    np.testing.assert_array_equal(got, want)
    assert len(_fallback_warnings(record)) == 1 and "masked_matvec" in _fallback_warnings(record)[0]
    assert model.derived_names() == xla_copies
    model.release_derived(keep=frozenset())  # a second generate builds no copy for the kernel (`requests.settled`)
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        again = np.asarray(generate_ids(model, _prompts(model), 4, method=teal, ignore_eos=True)[0])
    np.testing.assert_array_equal(again, want)
    assert not _fallback_warnings(later) and model.derived_names() == xla_copies


def _kernel_methods(model):
    """Every registry method with a ``kernel`` that binds without calibrating (TEAL and CATS with
    placeholder thresholds, WINA with its column norms), with kernel="auto"."""
    cfg = model.config
    return [popjax.POP(ratio=0.4), popjax.POP(ratio=0.4, block=8), popjax.Dynamic(ratio=0.4), popjax.Dynamic(ratio=0.4, block=8),
            popjax.Static(ratio=0.4, block=8).prepare(model), placeholder_thresholds(cfg, popjax.TEAL(ratio=0.4)),
            placeholder_thresholds(cfg, popjax.CATS(ffn_sparsity=0.5)), popjax.WINA(ratio=0.4).prepare(model)]


def _bytes(tree) -> list[tuple[tuple[int, ...], str]]:
    return [(tuple(a.shape), str(a.dtype)) for a in jax.tree_util.tree_leaves(tree)]


def test_auto_adds_no_memory_on_this_cpu(tiny_model):
    """On a CPU "auto" is XLA and its data is XLA's, array for array, building no derived copy;
    where the kernel will run (programs compiled for a TPU) TEAL's "auto" holds its copies, so
    the comparison tells the two apart."""
    assert kernels.choose("auto") == "xla"
    for auto in _kernel_methods(tiny_model):
        xla = dataclasses.replace(auto, kernel="xla")
        a_model, x_model = dataclasses.replace(tiny_model), dataclasses.replace(tiny_model)
        assert auto.bind(tiny_model.config) == xla.bind(tiny_model.config), auto.name
        assert _bytes(auto.data(a_model)) == _bytes(xla.data(x_model)), auto.name
        assert a_model.derived_names() == x_model.derived_names(), auto.name
    teal = placeholder_thresholds(tiny_model.config, popjax.TEAL(ratio=0.4))
    with kernels.compiling_for("tpu"):
        on_tpu = dataclasses.replace(tiny_model)
        assert sum(a.size for a in jax.tree_util.tree_leaves(teal.data(on_tpu))) > \
            sum(a.size for a in jax.tree_util.tree_leaves(dataclasses.replace(teal, kernel="xla").data(tiny_model) or {}))
        assert on_tpu.derived_names()


def test_trial_is_cached_per_shape(auto_picks_pallas, monkeypatch):
    """A kernel is built once per (kernel, device kind, shapes, static arguments): a second call
    at the same shapes does not build it again, another batch does."""
    built = []
    monkeypatch.setattr(fallback, "_build", lambda *a: built.append(a[0]))
    for shape in ((2, 4), (2, 4), (3, 4)):
        fallback.trial("k", "pallas-interpret", lambda x: x, (jnp.ones(shape),), static=5)
    assert built == ["k", "k"]
    fallback.trial("k", "xla", lambda x: x, (jnp.ones((5, 4)),))  # not a compiled kernel: never built
    assert built == ["k", "k"]


def test_popjax_compile_records_the_fallback(fresh_records, monkeypatch, tmp_path):
    """`popjax compile` for a v5e: POP's kernel is tried for the TPU (lowered alone) and does not
    build; "auto" compiles POP through XLA (no Mosaic call in its step), warns once and records
    what ran in the JSON; "pallas" is refused in one line."""
    pytest.importorskip("libtpu")
    monkeypatch.setattr(matvec_tpu, "gather_matvec", broken_matvec)
    with pytest.warns(RuntimeWarning) as record:
        report = tpu_compile(config(), "v5e:1x1", ["pop"], [0.4], with_dense=False, hlo_dir=tmp_path, prefill=False, **SHAPES)
    (pop,) = report["records"]
    assert pop["kernel"] == f"xla (fallback: gather_matvec: {FORCED})" and pop["fits"]
    assert len(_fallback_warnings(record)) == 1
    assert (tmp_path / "pop-0.4.step.hlo.txt").read_text().count(MOSAIC_CALL) == 0
    assert f"ran through XLA instead of a Pallas kernel: pop: xla (fallback: gather_matvec: {FORCED})" in format_report(report)
    with pytest.raises(fallback.KernelUnavailable, match="kernel='pallas' was asked for") as err:
        tpu_compile(config(), "v5e:1x1", ["pop:kernel=pallas"], [0.4], with_dense=False, prefill=False, **SHAPES)
    assert FORCED in str(err.value) and "\n" not in str(err.value)
