"""The device the kernels size for (`popjax.kernels.chips`: VMEM of a TPU, SMs and shared memory
of a GPU, from ``device_kind``; unknown kinds the smallest known figures, one warning), and the
layer index of every stacked view clamped into the stack (Pallas checks no bounds).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from popjax.kernels import block_slab, chips, ffn_gpu, ffn_layout, ffn_tpu, held_rows
from popjax.kernels.ffn_layout import InputRows

MiB = 1 << 20


@pytest.fixture
def kind(monkeypatch):
    """Sets the device kind the kernels see (what ``jax.devices()[0].device_kind`` says on a
    TPU or a GPU machine); fresh one-warning records."""
    monkeypatch.setattr(chips, "_warned", set())

    def set_kind(name: str) -> None:
        monkeypatch.setattr(chips, "device_kind", lambda: name)
    return set_kind


@pytest.mark.parametrize("device_kind, chip, vmem", [
    ("TPU v4", "v4", 16), ("TPU v5 lite", "v5e", 128), ("TPU v5e", "v5e", 128), ("TPU v5", "v5p", 64), ("TPU v5p", "v5p", 64),
    ("TPU v6 lite", "v6e", 128), ("TPU7x", "v7x", 64)])
def test_tpu_from_device_kind(kind, device_kind, chip, vmem):
    kind(device_kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert chips.tpu_chip() is chips.TPU_CHIPS[chip]
    assert chips.tpu_chip().vmem_bytes == vmem * MiB
    assert chips.tpu_chip(interpret=True).name == "v5e"  # interpret mode sizes as the tests always have


def test_a_host_without_an_accelerator_sizes_as_interpret_mode(kind):
    """A CPU lowering TPU or GPU kernels with no target device named (the compile tests) sizes
    for a v5e and an H100, as before, without a warning."""
    kind("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert chips.tpu_chip().name == "v5e" and chips.gpu_spec() is chips.INTERPRET_GPU


def test_the_table_is_jaxs():
    """The VMEM figures are jax's own chip table (the module docstring's source)."""
    versions = {"v4": "TPU_V4", "v5e": "TPU_V5E", "v5p": "TPU_V5P", "v6e": "TPU_V6E", "v7x": "TPU_7X"}
    for name, chip in chips.TPU_CHIPS.items():
        info = pltpu.get_tpu_info_for_chip(getattr(pltpu.ChipVersion, versions[name]), 1)
        assert chip.vmem_bytes == info.vmem_capacity_bytes, name
        assert chip.default_scoped_vmem <= chip.vmem_bytes


def test_vmem_limit_follows_the_device(kind):
    """A kernel's limit and refusal are the traced-for chip's: 100 MiB fits a v6e's 128 MiB, not
    a v5p's 64; the floor is the chip's default scoped VMEM (v6e 32 MiB, v5p 16)."""
    kind("TPU v6 lite")
    assert ffn_tpu.vmem_limit(100 * MiB, None, "k") == 102 * MiB
    assert ffn_tpu.vmem_limit(1 * MiB, None, "k") == 32 * MiB
    kind("TPU v5")
    assert ffn_tpu.vmem_limit(1 * MiB, None, "k") == 16 * MiB
    with pytest.raises(ValueError, match=r"^k needs 100.0 MiB of VMEM, over v5p's 64 MiB; use a smaller block, chunk or batch$"):
        ffn_tpu.vmem_limit(100 * MiB, None, "k")
    assert ffn_tpu.vmem_limit(100 * MiB, "v5e", "k") == 102 * MiB  # a chip named outright wins


def test_unknown_kinds_get_the_smallest_figures_and_one_warning(kind):
    kind("TPU v99")
    with pytest.warns(RuntimeWarning, match="'TPU v99' is not a TPU popjax knows") as record:
        assert chips.tpu_chip() is chips.UNKNOWN_TPU
        assert chips.tpu_chip() is chips.UNKNOWN_TPU
    assert len(record) == 1
    assert chips.UNKNOWN_TPU.vmem_bytes == min(c.vmem_bytes for c in chips.TPU_CHIPS.values())
    kind("Some GPU 9000")
    with pytest.warns(RuntimeWarning, match="not a GPU popjax knows") as record:
        assert chips.gpu_spec() is chips.UNKNOWN_GPU and chips.gpu_spec() is chips.UNKNOWN_GPU
    assert len(record) == 1
    with pytest.raises(ValueError, match=r"chip='v3' is not a known TPU"):
        chips.tpu_chip("v3")


@pytest.mark.parametrize("device_kind, sms, smem_kib", [
    ("NVIDIA H100 80GB HBM3", 132, 227), ("NVIDIA H200", 132, 227), ("NVIDIA H100 PCIe", 114, 227),
    ("NVIDIA A100-SXM4-80GB", 108, 163)])
def test_gpu_from_device_kind(kind, device_kind, sms, smem_kib):
    """Two split-K programs per SM; a program's staged tiles within a block's shared memory."""
    kind(device_kind)
    spec = chips.gpu_spec()
    assert (spec.sms, spec.smem_per_block) == (sms, smem_kib * 1024)
    assert ffn_gpu.target_programs(False) == 2 * sms
    assert ffn_gpu.target_programs(True) == 264  # interpret mode: an H100's, as before
    ffn_gpu.check_smem(64, jnp.float32, jnp.float32, False)  # the largest batch, f32: 128 KiB


def test_smem_bound_refuses_in_one_line(kind, monkeypatch):
    kind("NVIDIA A100-SXM4-80GB")
    # x [64, 128] f32 and two [32, 128] f32 weight tiles, two stages
    assert ffn_gpu.program_smem_bytes(64, jnp.float32, jnp.float32) == 2 * (64 * 128 * 4 + 2 * 32 * 128 * 4)
    assert ffn_gpu.program_smem_bytes(3, jnp.bfloat16, jnp.int8) == 2 * (16 * 128 * 2 + 2 * 32 * 128)
    monkeypatch.setattr(ffn_gpu, "STAGES", 3)
    with pytest.raises(ValueError, match=r"stage 192 KiB of shared memory per program, over A100's 163 KiB per block"):
        ffn_gpu.check_smem(64, jnp.float32, jnp.float32, False)


# ------------------------------------------------------------------ layer index clamped in stacked views

S, F, D, BLOCK = 3, 16, 24, 4


def _stacks(seed: int = 0):
    rng = np.random.default_rng(seed)
    gate_up = rng.normal(size=(S, 2, F, D)).astype(np.float32)
    down = rng.normal(size=(S, D, F)).astype(np.float32)
    x = jnp.asarray(rng.normal(size=(2, D)).astype(np.float32))
    return gate_up, down, x


@pytest.mark.slow  # Pallas interpret mode
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_out_of_range_layers_read_the_edge_layers(platform):
    """A layer index past the stack (or below 0) reads the last (first) layer, never past the
    stack: the block kernel over a stacked slab (`block_slab.slab_view`) and the gate-given
    channel kernel over stacked up/down rows (`ffn_layout.stack_view`), in interpret mode."""
    gate_up, down, x = _stacks()
    slab = block_slab.stacked_block_layout(jnp.asarray(gate_up), jnp.asarray(down), BLOCK)
    rows = ffn_layout.stacked_up_down_layout(jnp.asarray(gate_up[:, 1]), jnp.asarray(down))
    kernels = ffn_tpu if platform == "tpu" else ffn_gpu
    blocks, ids = jnp.asarray([0, 2, 3], jnp.int32), jnp.arange(F, dtype=jnp.int32)
    gate = jnp.asarray(np.random.default_rng(1).normal(size=(2, F)).astype(np.float32))

    def block(layer):
        return np.asarray(kernels.block_ffn(x, slab, blocks, layer=jnp.int32(layer), interpret=True))

    def channels(layer):
        return np.asarray(kernels.gather_ffn(x, rows, ids, gate=gate, layer=jnp.int32(layer), interpret=True))

    for read in (block, channels):
        last, first = read(S - 1), read(0)
        assert not np.allclose(last, first)  # the layers differ: a wrong layer would show
        np.testing.assert_array_equal(read(S), last)
        np.testing.assert_array_equal(read(S + 5), last)
        np.testing.assert_array_equal(read(-1), first)


def test_held_rows_offsets_stay_in_the_stack():
    """A batch's held rows ([S, B, ...] flattened, `held_rows.per_row`): a layer past the stack
    names the last layer's rows of each row, not another stack's."""
    batch, k = 2, 8
    values = jnp.zeros((S, batch, k, 1, 128), jnp.float32)
    for layer, want in ((S + 2, S - 1), (-4, 0), (1, 1)):
        rows = held_rows.per_row(InputRows(values, None, jnp.int32(layer)), batch)
        np.testing.assert_array_equal(rows.layer, want * batch + np.arange(batch))


def test_every_stacked_view_clamps():
    """The offsets the views give a kernel stay within the stack for any traced layer index."""
    gate_up, down, _ = _stacks()
    slab = block_slab.stacked_block_layout(jnp.asarray(gate_up), jnp.asarray(down), BLOCK)
    rows = ffn_layout.stacked_up_down_layout(jnp.asarray(gate_up[:, 1]), jnp.asarray(down))
    nb = F // BLOCK
    for layer, want in ((S, S - 1), (100, S - 1), (-1, 0), (1, 1)):
        offset = jax.jit(lambda l: block_slab.slab_view(slab, l)[1])(jnp.int32(layer))
        assert int(offset) == want * nb
        offset = jax.jit(lambda l: ffn_layout.stack_view(rows, l, S)[3])(jnp.int32(layer))
        assert int(offset) == want * F
