"""``popjax cache list`` and ``popjax cache clear`` through ``popjax.cli.main``, on a cache of its
own (``POPJAX_CACHE`` in a temporary folder, never the session's shared one), and their errors."""

from __future__ import annotations

import json
import re
import time

import jax
import pytest

from popjax import cache
from popjax.cli import main


@pytest.fixture
def root(tmp_path, monkeypatch):
    """An empty cache root of this test's own; the JAX compilation cache that main() points into
    it is pointed back afterwards."""
    previous = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("POPJAX_CACHE", str(tmp_path / "cache"))
    yield tmp_path / "cache"
    jax.config.update("jax_compilation_cache_dir", previous)


def _entry(kind: str, n: int, size: int = 100, age_days: float = 0.0):
    def make(directory):
        (directory / "payload.bin").write_bytes(b"x" * size)

    path = cache.get_or_make(kind, {"n": n}, make, name=f"{kind}{n}")
    if age_days:
        record = path / cache.RECORD
        fields = json.loads(record.read_text())
        record.write_text(json.dumps({**fields, "created": time.time() - age_days * 86400}))
    return path


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["cache", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_list_an_empty_and_a_filled_cache(root, capsys):
    code, out, _ = _run(capsys, "list")
    assert code == 0 and out.splitlines() == [f"popjax cache: {root}", "total: 0 entries, 0 B"]
    _entry("calibration", 1)
    _entry("calibration", 2)
    _entry("converted", 3, size=2048, age_days=3)
    code, out, _ = _run(capsys, "list")
    lines = out.splitlines()
    assert code == 0 and lines[0] == f"popjax cache: {root}" and lines[1].split()[:4] == ["KIND", "KEY", "SIZE", "AGE"]
    assert [line.split()[0] for line in lines[2:5]] == ["calibration", "calibration", "converted"]
    assert "converted3-" in lines[4] and "2.0 KiB" in lines[4] and " 3d " in lines[4]
    assert lines[-1] == "total: 3 entries, 2.2 KiB"


def test_clear_by_age_kind_and_all(root, capsys):
    old = _entry("calibration", 1, age_days=10)
    new = _entry("calibration", 2)
    converted = _entry("converted", 3)
    code, out, _ = _run(capsys, "clear", "--older-than", "7d")
    assert code == 0 and re.fullmatch(rf"removed 1 entry, freed \d+ B from {re.escape(str(root))}\n", out)  # payload + record
    assert not old.exists() and new.exists() and converted.exists()
    code, out, _ = _run(capsys, "clear", "--kind", "converted")
    assert code == 0 and out.startswith("removed 1 entry") and new.exists() and not converted.exists()
    code, out, _ = _run(capsys, "clear")
    assert code == 0 and out.startswith("removed 1 entry,") and not new.exists()
    assert cache.list_entries() == []
    code, out, _ = _run(capsys, "clear")
    assert code == 0 and out == f"removed 0 entries, freed 0 B from {root}\n"


def test_bad_input_is_one_line_and_exit_2(root, capsys):
    code, out, err = _run(capsys, "clear")  # no cache folder at all
    assert code == 2 and out == ""
    assert err == f"popjax: error: no popjax cache at {root} (set POPJAX_CACHE or run a command that fills it)\n"
    _entry("calibration", 1)
    for age in ("3x", "7 days", "-1d", ""):
        code, _, err = _run(capsys, "clear", f"--older-than={age}")
        assert code == 2 and err == (f"popjax: error: --older-than {age!r} is not an age; use a number followed by "
                                     "m, h, d or w, e.g. 7d\n")
    code, _, err = _run(capsys, "clear", "--kind", "calibratoin")
    assert code == 2 and err.startswith("popjax: error: --kind 'calibratoin': ") and "its kinds: calibration" in err
    assert err.count("\n") == 1
    assert [e.kind for e in cache.list_entries()] == ["calibration"]  # nothing was removed by the bad requests
