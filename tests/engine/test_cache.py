"""popjax.cache: keyed atomic entries, verification, sweeping of dead builders, list/clear.

No JAX: the package popjax/cache/ is loaded by its path, here and in the subprocesses, as the bottom layer
it is (importing nothing of popjax), so a child process starts in a fraction of a second."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

CACHE_DIR = Path(__file__).resolve().parents[2] / "popjax" / "cache"
LOAD = (
    "import importlib.util, sys\n"
    f"spec = importlib.util.spec_from_file_location('popjax_cache_under_test', {str(CACHE_DIR / '__init__.py')!r}, "
    f"submodule_search_locations=[{str(CACHE_DIR)!r}])\n"
    "cache = importlib.util.module_from_spec(spec); sys.modules[spec.name] = cache; spec.loader.exec_module(cache)\n"
)
# the package popjax/cache/ under its own name: its relative imports resolve inside it, not popjax
_spec = importlib.util.spec_from_file_location("popjax_cache_under_test", CACHE_DIR / "__init__.py",
                                               submodule_search_locations=[str(CACHE_DIR)])
cache = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cache  # dataclasses look their module up there
_spec.loader.exec_module(cache)

FIELDS = {"model": "3f2a9c0d1e" * 4, "statistic": {"name": "wanda_sp", "version": 1}, "tokens": 16384}


def writer(payload: bytes, calls: list | None = None):
    def make(directory: Path) -> None:
        if calls is not None:
            calls.append(directory)
        (directory / "sub").mkdir()
        (directory / "sub" / "data.bin").write_bytes(payload)
        (directory / "meta.txt").write_text("hello")

    return make


def temp_dirs(kind_dir: Path) -> list[str]:
    return sorted(n for n in os.listdir(kind_dir) if ".tmp-" in n)


def run_child(body: str, root: Path, *args: str) -> subprocess.Popen:
    """A python process with this checkout's popjax/cache/ loaded as ``cache`` (no popjax import)."""
    prelude = f"import time, os; from pathlib import Path\n{LOAD}root = Path({str(root)!r})\n"
    return subprocess.Popen([sys.executable, "-c", prelude + body, *args], stdout=subprocess.PIPE, text=True)


def test_bottom_layer_imports_nothing_heavy():
    code = LOAD + "print(sorted(m for m in sys.modules if m.split('.')[0] in ('popjax', 'jax', 'orbax', 'numpy')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_round_trip(tmp_path):
    calls = []
    path = cache.get_or_make("calibration", FIELDS, writer(b"x" * 1000, calls), name="wanda_sp v1", root=tmp_path)
    assert path.parent == tmp_path / "calibration" and path.name.startswith("wanda_sp_v1-")
    assert (path / "sub" / "data.bin").read_bytes() == b"x" * 1000 and (path / "meta.txt").read_text() == "hello"
    record = json.loads((path / cache.RECORD).read_text())
    assert record["kind"] == "calibration" and record["key"] == FIELDS and record["size"] == 1005
    assert record["checksum"].startswith("sha256:") and [f[0] for f in record["files"]] == ["meta.txt", "sub/data.bin"]
    shuffled = dict(reversed(list(FIELDS.items())))
    again = cache.get_or_make("calibration", shuffled, writer(b"y", calls), name="wanda_sp v1", root=tmp_path)
    assert again == path and len(calls) == 1  # key order does not matter; nothing made twice
    assert cache.lookup("calibration", FIELDS, name="wanda_sp v1", root=tmp_path) == path
    assert cache.lookup("calibration", {**FIELDS, "tokens": 1}, name="wanda_sp v1", root=tmp_path) is None
    assert cache.check_entry(path) is None
    assert temp_dirs(path.parent) == []


def test_other_key_fields_are_made_again(tmp_path, caplog):
    calls = []
    first = cache.get_or_make("calibration", FIELDS, writer(b"a", calls), root=tmp_path)
    second = cache.get_or_make("calibration", {**FIELDS, "tokens": 8192}, writer(b"b", calls), root=tmp_path)
    assert second != first and len(calls) == 2 and (second / "sub" / "data.bin").read_bytes() == b"b"
    # a record whose key fields do not match its name (a hash collision, a hand edit) is not trusted
    record = json.loads((first / cache.RECORD).read_text())
    (first / cache.RECORD).write_text(json.dumps({**record, "key": {**FIELDS, "tokens": 1}}))
    with caplog.at_level(logging.WARNING, logger=cache.log.name):
        assert cache.get_or_make("calibration", FIELDS, writer(b"c", calls), root=tmp_path) == first
    assert len(calls) == 3 and (first / "sub" / "data.bin").read_bytes() == b"c"
    assert [r.getMessage() for r in caplog.records if "other key fields" in r.getMessage()] != []


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "extra", "record"])
def test_corrupt_entry_warns_once_and_is_made_again(tmp_path, caplog, damage):
    calls = []
    path = cache.get_or_make("kv_calibration", FIELDS, writer(bytes(range(256)) * 4, calls), root=tmp_path)
    data = path / "sub" / "data.bin"
    if damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[100] ^= 0x01
        data.write_bytes(bytes(raw))
    elif damage == "truncate":
        data.write_bytes(data.read_bytes()[:-1])
    elif damage == "delete":
        data.unlink()
    elif damage == "extra":
        (path / "stray").write_text("?")
    else:
        (path / cache.RECORD).write_text('{"format": 1, "key": ')
    assert cache.check_entry(path) is not None
    with caplog.at_level(logging.WARNING, logger=cache.log.name):
        again = cache.get_or_make("kv_calibration", FIELDS, writer(bytes(range(256)) * 4, calls), root=tmp_path)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage(), [r.getMessage() for r in warnings]
    assert "\n" not in warnings[0].getMessage()
    assert again == path and len(calls) == 2 and cache.check_entry(path) is None
    assert data.read_bytes() == bytes(range(256)) * 4 and temp_dirs(path.parent) == []


def test_manifest_verification_for_large_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(cache.entries, "FULL_VERIFY_MAX_BYTES", 10)  # every entry here counts as large
    path = cache.get_or_make("converted", FIELDS, writer(b"z" * 4096), root=tmp_path)
    data = path / "sub" / "data.bin"
    recorded = data.stat().st_mtime_ns
    # an edit that changes the mtime is re-hashed and caught
    data.write_bytes(b"q" * 4096)
    assert cache.check_entry(path, "auto") == "fails its checksum (corrupt)"
    # a copy that only changed mtimes is re-hashed once, then its recorded mtimes are put back
    data.write_bytes(b"z" * 4096)
    os.utime(data, ns=(recorded, recorded + 5_000_000_000))
    assert cache.check_entry(path, "auto") is None and data.stat().st_mtime_ns == recorded
    # silent same-size damage with the mtime intact: only a full check finds it (popjax cache verify)
    with open(data, "r+b") as fh:
        fh.write(b"Z")
    os.utime(data, ns=(recorded, recorded))
    assert cache.check_entry(path, "manifest") is None and cache.check_entry(path, "none") is None
    assert cache.check_entry(path, "full") == "fails its checksum (corrupt)"
    data.write_bytes(b"z")
    assert "truncated" in cache.check_entry(path, "auto")


def test_make_failure_leaves_nothing(tmp_path):
    def boom(directory):
        (directory / "half").write_text("x")
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        cache.get_or_make("lowrank", FIELDS, boom, root=tmp_path)
    assert cache.lookup("lowrank", FIELDS, root=tmp_path) is None and temp_dirs(tmp_path / "lowrank") == []
    with pytest.raises(cache.CacheError, match="entry.json"):
        cache.get_or_make("lowrank", FIELDS, lambda d: (d / cache.RECORD).write_text("{}"), root=tmp_path)
    with pytest.raises(cache.CacheError, match="JSON"):
        cache.get_or_make("lowrank", {"a": object()}, boom, root=tmp_path)
    with pytest.raises(cache.CacheError, match="kind"):
        cache.get_or_make("../x", FIELDS, boom, root=tmp_path)


KILLED_CHILD = """
def make(d):
    (d / "part").write_bytes(b"x" * 1000)
    print("ready", flush=True)
    time.sleep(60)
cache.get_or_make("converted", {"n": 1}, make, name="model", root=root)
"""


@pytest.mark.parametrize("next_fill", ["same key", "other key"])
def test_killed_builder_is_swept(tmp_path, next_fill):
    kind_dir = tmp_path / "converted"
    child = run_child(KILLED_CHILD, tmp_path)
    try:
        assert child.stdout.readline().strip() == "ready"
        [tmp] = temp_dirs(kind_dir)
        assert tmp.startswith(f".{cache.entry_key({'n': 1}, 'model')}.tmp-{child.pid}-")
        # while its builder lives, another fill of the kind leaves its temp dir alone
        cache.get_or_make("converted", {"n": 2}, writer(b"b"), root=tmp_path)
        assert temp_dirs(kind_dir) == [tmp]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        child.stdout.close()
    assert temp_dirs(kind_dir) == [tmp]  # SIGKILL: nothing cleaned up by the dead process
    if next_fill == "other key":  # any fill of the kind sweeps
        cache.get_or_make("converted", {"n": 3}, writer(b"c"), root=tmp_path)
        assert temp_dirs(kind_dir) == []
    path = cache.get_or_make("converted", {"n": 1}, writer(b"a"), name="model", root=tmp_path)
    assert (path / "sub" / "data.bin").read_bytes() == b"a" and temp_dirs(kind_dir) == []


def test_sweep_without_a_lock_uses_pid_and_age(tmp_path):
    kind_dir = tmp_path / "converted"
    kind_dir.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    (kind_dir / f".gone.tmp-{int(dead.stdout)}-abc123").mkdir()  # a dead pid, no lock file
    (kind_dir / f".alive.tmp-{os.getpid()}-abc123").mkdir()  # a live pid: kept
    (kind_dir / ".legacy-model.tmp-k2j4h5g6").mkdir()  # old mkdtemp debris without a pid: by age
    (kind_dir / ".legacy-new.tmp-aaaa1111").mkdir()
    day_old = time.time() - 25 * 3600
    os.utime(kind_dir / ".legacy-model.tmp-k2j4h5g6", (day_old, day_old))
    cache.get_or_make("converted", FIELDS, writer(b"x"), root=tmp_path)
    assert temp_dirs(kind_dir) == [f".alive.tmp-{os.getpid()}-abc123", ".legacy-new.tmp-aaaa1111"]


CONCURRENT_CHILD = """
if sys.argv[1] == "nolock":
    cache.entries.fcntl = None  # no flock (some network filesystems): both make it, the rename decides
go = root / "go"
def make(d):
    print("made", flush=True)
    (root / f"made-{os.getpid()}").touch()
    while sys.argv[1] == "nolock" and len(list(root.glob("made-*"))) < 2:  # both make before either renames
        time.sleep(0.005)
    with open(d / "data.bin", "wb") as fh:
        for i in range(10):
            fh.write(bytes([i]) * 100_000)
            fh.flush()
            time.sleep(0.03)
while not go.exists():
    time.sleep(0.005)
print(cache.get_or_make("calibration", {"same": "key"}, make, name="stat", root=root / "cache"), flush=True)
"""


@pytest.mark.parametrize("mode", ["lock", "nolock"])
def test_two_processes_fill_the_same_key(tmp_path, mode):
    children = [run_child(CONCURRENT_CHILD, tmp_path, mode) for _ in range(2)]
    try:
        time.sleep(0.3)  # both started and polling
        (tmp_path / "go").touch()
        outputs = [child.communicate(timeout=30)[0].split() for child in children]
    finally:
        for child in children:
            child.kill()
            child.communicate()
    assert all(child.returncode == 0 for child in children), outputs
    paths = {out[-1] for out in outputs}
    made = sum(out.count("made") for out in outputs)
    assert len(paths) == 1, outputs
    assert made == (1 if mode == "lock" else 2)  # with the lock the second process waits and reuses
    kind_dir = tmp_path / "cache" / "calibration"
    entries = [p for p in kind_dir.iterdir() if not p.name.startswith(".")]
    assert entries == [Path(paths.pop())] and temp_dirs(kind_dir) == []
    assert (entries[0] / "data.bin").read_bytes() == b"".join(bytes([i]) * 100_000 for i in range(10))
    assert cache.check_entry(entries[0]) is None


def test_list_format_and_clear(tmp_path):
    a = cache.get_or_make("calibration", FIELDS, writer(b"x" * 3000), name="wanda", root=tmp_path)
    b = cache.get_or_make("kv_calibration", {"skip": [3, 4]}, writer(b"y" * 10), root=tmp_path)
    c = cache.get_or_make("kv_calibration", {"skip": [5]}, writer(b"y" * 20), root=tmp_path)
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / "model.gguf").write_bytes(b"not an entry")
    entries = cache.list_entries(tmp_path)
    assert [(e.kind, e.path, e.size) for e in entries] == sorted(
        [("calibration", a, 3005), ("kv_calibration", b, 15), ("kv_calibration", c, 25)])
    assert entries[0].key_fields == FIELDS and entries[0].age < timedelta(minutes=1)
    table = cache.format_entries(entries)
    assert a.name in table and "2.9 KiB" in table and "statistic.name=wanda_sp" in table and "skip=[3, 4]" in table
    assert table.splitlines()[-1] == "total: 3 entries, 3.0 KiB"
    assert cache.format_entries([]) == "total: 0 entries, 0 B"
    # age an entry by its record, as if made ten days ago
    record = json.loads((b / cache.RECORD).read_text())
    (b / cache.RECORD).write_text(json.dumps({**record, "created": time.time() - 10 * 86400}))
    b_bytes = 15 + (b / cache.RECORD).stat().st_size
    assert cache.clear(older_than=cache.parse_age("7d"), root=tmp_path) == (1, b_bytes)
    assert not b.exists() and a.exists() and c.exists()
    lock = tmp_path / "calibration" / ".stale.lock"
    lock.touch()
    removed, freed = cache.clear(kinds=["kv_calibration"], root=tmp_path)
    assert removed == 1 and freed >= 25 and not c.exists() and a.exists()
    assert lock.exists()  # only the kinds asked for
    assert cache.clear(root=tmp_path)[0] == 1 and cache.list_entries(tmp_path) == [] and not lock.exists()
    assert (tmp_path / "downloads" / "model.gguf").exists()  # not an entry: never touched
    assert cache.list_entries(tmp_path / "nowhere") == []


def test_clear_counts_bytes(tmp_path):
    path = cache.get_or_make("lowrank", FIELDS, writer(b"w" * 5000), root=tmp_path)
    record_size = (path / cache.RECORD).stat().st_size
    assert cache.clear(root=tmp_path) == (1, 5005 + record_size)
    assert cache.clear(root=tmp_path) == (0, 0)


def test_parse_age():
    assert cache.parse_age("30m") == timedelta(minutes=30)
    assert cache.parse_age("12h") == timedelta(hours=12)
    assert cache.parse_age(" 7d") == timedelta(days=7)
    assert cache.parse_age("2w") == timedelta(weeks=2)
    assert cache.parse_age("1.5d") == timedelta(hours=36)
    for bad in ("3x", "", "d", "7", "-1d", "7 days", "1e9w"):
        with pytest.raises(ValueError) as err:
            cache.parse_age(bad)
        assert repr(bad) in str(err.value) and "m, h, d or w" in str(err.value)
    assert str(err.value).startswith("--older-than ")


def test_clear_missing_root(tmp_path, monkeypatch):
    missing = tmp_path / "no-cache-here"
    with pytest.raises(cache.CacheError, match="no popjax cache at .*no-cache-here") as err:
        cache.clear(root=missing)
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)
    monkeypatch.setenv("POPJAX_CACHE", str(missing))
    assert cache.cache_root() == missing
    with pytest.raises(cache.CacheError, match=str(missing)):
        cache.clear()
    monkeypatch.setenv("POPJAX_CACHE", "")
    assert cache.cache_root() == Path.home() / ".cache" / "popjax"
