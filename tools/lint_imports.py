"""Runs import-linter's `lint-imports` on popjax with the layer contract in pyproject.toml.

Why a wrapper: ``models/`` and ``convert/`` are top-level folders installed as ``popjax.models``
and ``popjax.convert`` (setuptools ``package-dir``), and import-linter (grimp) finds a package's
modules by walking the one folder of its top-level package. So this assembles the package as
it is installed — ``popjax/`` plus ``models/`` and ``convert/`` linked in — in a temporary
folder, and runs ``lint-imports`` there in a Python that sees that folder instead of the
editable install (``-S``: no site hooks; site-packages is put on the path after it).

    python tools/lint_imports.py        # exit status and output of lint-imports
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINKED = {"models": ROOT / "models", "convert": ROOT / "convert"}


def assemble(into: Path) -> Path:
    """A folder holding ``popjax/`` as installed: links to every entry of popjax/ plus models/ and convert/."""
    package = into / "popjax"
    package.mkdir()
    for entry in (ROOT / "popjax").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, source in LINKED.items():
        (package / name).symlink_to(source)
    return into


def run(extra: list[str] | None = None) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="popjax-lint-") as tmp:
        staged = assemble(Path(tmp))
        path = os.pathsep.join([str(staged), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
        code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
        return subprocess.run(
            [sys.executable, "-S", "-c", code, str(ROOT / "pyproject.toml"), "--no-cache", *(extra or [])],
            cwd=staged, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True,
        )


if __name__ == "__main__":
    result = run(sys.argv[1:])
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    sys.exit(result.returncode)
