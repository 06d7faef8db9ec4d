"""Runs untrusted generated code in a separate Python process with a timeout and resource limits.

The evaluating process never executes generated code. The child runs in isolated mode (-I) in
an empty temporary directory, in its own session so that a timeout kills everything it started,
and sets limits on address space, CPU time and file size on itself before it runs the program.
(Setting them in the child, not through ``preexec_fn``, keeps the fork free of Python code,
which can deadlock a multithreaded parent such as JAX.) This is a best-effort sandbox for
benchmark code, not a security boundary against hostile code running as root.
"""

from __future__ import annotations

import dataclasses
import os
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


_BOOTSTRAP = """
import resource, runpy, sys
for limit, value in ((resource.RLIMIT_AS, {memory}), (resource.RLIMIT_CPU, {cpu}),
                     (resource.RLIMIT_FSIZE, 16 << 20), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
runpy.run_path(sys.argv[1], run_name="__main__")
"""


def run_python(code: str, timeout_s: float = 10.0, memory_mb: int = 1024) -> RunResult:
    """Executes ``code`` in a fresh interpreter; passed means exit status 0 within the limits."""
    with tempfile.TemporaryDirectory(prefix="popjax-exec-") as tmp:
        program = Path(tmp) / "program.py"
        program.write_text(code)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "HOME": tmp}
        bootstrap = _BOOTSTRAP.format(memory=memory_mb << 20, cpu=int(timeout_s) + 1)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", bootstrap, str(program)],
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
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
