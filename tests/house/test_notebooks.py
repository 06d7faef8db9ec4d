"""The notebooks run top to bottom (small sizes) and their plots render: on the real default
model cut to two layers (conftest.short_default_model_dir), which a cell the test adds after the
setup cell hands to `popjax.load()` for the default source (other named sources, the quickstart's
Gemma 3 270M, load whole); the notebooks in git load the whole model."""

from __future__ import annotations

import base64
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import tiny_program_env

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_notebooks_exist_and_are_stripped():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_pop_dynamics.ipynb", "03_method_comparison.ipynb",
                                          "04_vision_language.ipynb"]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path.name} has outputs in git"


@pytest.mark.slow  # the notebooks run on the real default model
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_plots_render(path, tmp_path, monkeypatch, short_default_model_dir):
    monkeypatch.setenv("POPJAX_NOTEBOOK_SMALL", "1")  # the kernel inherits the environment
    for name, value in tiny_program_env().items():  # two layers compile faster unoptimised (conftest.py)
        monkeypatch.setenv(name, value)
    nb = nbformat.read(path, as_version=4)
    setup = next(i for i, cell in enumerate(nb.cells) if cell.cell_type == "code")
    assert "import popjax" in nb.cells[setup].source  # the setup cell, then the two-layer model
    nb.cells.insert(setup + 1, nbformat.v4.new_code_cell(  # the default source only: other named sources load as named
        f"_load = popjax.load\npopjax.load = lambda source=popjax.DEFAULT_MODEL, *a, **k: "
        f"_load({str(short_default_model_dir)!r} if source == popjax.DEFAULT_MODEL else source, *a, **k)"))
    NotebookClient(nb, timeout=1200, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    pngs = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "image/png" in data:
                target = tmp_path / f"{path.stem}_{len(pngs)}.png"
                target.write_bytes(base64.b64decode(data["image/png"]))
                pngs.append(target)
            assert output.get("output_type") != "error", output
    assert pngs, f"{path.name} rendered no plot"
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000
