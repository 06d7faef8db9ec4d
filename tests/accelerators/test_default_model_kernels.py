"""The Pallas kernel path on the real default model (SmolLM2-135M-Instruct, 30 layers): POP with
``kernel="pallas"`` (interpret mode here) makes the same greedy tokens as ``kernel="xla"`` and
log-probabilities within 1e-4 (30 layers of f32 sums in another order: 5.5e-5 apart at most,
measured), per sequence at batch 2 on the scanned model (each layer's kernel reads its rows of
the held stack, each row at its own offset)."""

from __future__ import annotations

import pytest

import popjax
from popjax.loaded import with_scanned_layers
from tests.accelerators.kernel_paths import check_method_kernel

pytestmark = [pytest.mark.slow, pytest.mark.real_model]  # the real default model, Pallas in interpret mode


@pytest.fixture(scope="module")
def default_model():
    return with_scanned_layers(popjax.load())


@pytest.mark.parametrize("method", [popjax.POP(ratio=0.4, kernel="xla"), popjax.ShortlistPOP(ratio=0.4, gamma=0.4, kernel="xla")],
                         ids=["pop", "pop-shortlist"])
def test_pallas_equals_xla_on_the_default_model(default_model, method):
    check_method_kernel(default_model, method, "unrolled", atol=1e-4)  # the model is scanned already
