"""Runs untrusted generated code in a separate Python process with a timeout and resource limits.

The evaluating process never executes generated code. The child runs in isolated mode (-I) in
an empty temporary directory, with limits on address space, CPU time, file size and processes,
in its own session so that a timeout kills everything it started.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class RunResult:
    passed: bool
    reason: str  # "passed", "failed", "timeout"
    stderr_tail: str = ""


def _limits(memory_mb: int, cpu_s: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_python(code: str, timeout_s: float = 10.0, memory_mb: int = 1024) -> RunResult:
    """Executes ``code`` in a fresh interpreter; passed means exit status 0 within the limits."""
    with tempfile.TemporaryDirectory(prefix="popjax-exec-") as tmp:
        program = Path(tmp) / "program.py"
        program.write_text(code)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "HOME": tmp}
        proc = subprocess.Popen(
            [sys.executable, "-I", str(program)],
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_limits(memory_mb, int(timeout_s) + 1),
            start_new_session=True,
        )
        try:
            _, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return RunResult(False, "timeout")
        tail = stderr.decode(errors="replace")[-500:]
        return RunResult(proc.returncode == 0, "passed" if proc.returncode == 0 else "failed", tail)
