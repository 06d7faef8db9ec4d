"""``import popjax`` leaves the environment alone: libtpu's variables (`popjax.libtpu_env.VARIABLES`)
are set only where libtpu is about to start (JAX's TPU backend start, ``popjax compile``), so a
GPU or CPU run's environment is the user's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from popjax import libtpu_env

# prints which of libtpu's variables JAX's own import set, and which `import popjax` then added
# (JAX's import sets TPU_SKIP_MDS_QUERY itself on a machine without TPU chips: jax/_src/cloud_tpu_init.py)
IMPORT = """
import json, os, sys
import jax
from popjax.libtpu_env import VARIABLES
jax_set = {v for v in VARIABLES if v in os.environ}
import popjax
popjax_set = {v for v in VARIABLES if v in os.environ} - jax_set
if sys.argv[1] == "start":
    jax.devices()  # JAX's first backend start
started = {v for v in VARIABLES if v in os.environ} - jax_set
print(json.dumps({"jax": sorted(jax_set), "import": sorted(popjax_set), "started": sorted(started)}))
"""


def _run(start: bool, platforms: str | None) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in libtpu_env.VARIABLES and k != "JAX_PLATFORMS"}
    if platforms is not None:
        env["JAX_PLATFORMS"] = platforms
    result = subprocess.run([sys.executable, "-c", IMPORT, "start" if start else "import"], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_import_sets_no_tpu_variable():
    report, _ = _run(start=False, platforms=None)
    assert report["import"] == [] and report["started"] == []
    assert set(report["jax"]) <= {"TPU_SKIP_MDS_QUERY"}  # JAX's, not popjax's


def test_a_cpu_run_sets_none_even_after_the_backend_starts():
    report, _ = _run(start=True, platforms="cpu")  # JAX never loads libtpu: nothing to prepare
    assert report["import"] == [] and report["started"] == []


def test_a_libtpu_start_is_prepared_and_quiet():
    if not libtpu_env.libtpu_installed():
        pytest.skip("libtpu is not installed (the tpu extra): JAX's backend start never loads it")
    if libtpu_env._tpu_attached():
        pytest.skip("a TPU VM: the TPU runtime's own values stand")
    report, stderr = _run(start=True, platforms=None)  # JAX's default platforms: it loads libtpu
    assert report["import"] == []
    assert set(report["started"]) == set(libtpu_env.VARIABLES) - set(report["jax"])
    assert "TPU_ACCELERATOR_TYPE" not in stderr and "TPU_WORKER_HOSTNAMES" not in stderr  # no metadata warnings


def test_prepare_keeps_what_the_user_set(monkeypatch):
    monkeypatch.setattr(libtpu_env, "_tpu_attached", lambda: False)
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v6e-8")
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    libtpu_env.prepare_libtpu_env()
    assert os.environ["TPU_ACCELERATOR_TYPE"] == "v6e-8" and os.environ["TPU_WORKER_HOSTNAMES"] == "localhost"
    monkeypatch.setattr(libtpu_env, "_tpu_attached", lambda: True)  # a TPU VM: its runtime's own values stand
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES")
    libtpu_env.prepare_libtpu_env()
    assert "TPU_WORKER_HOSTNAMES" not in os.environ
