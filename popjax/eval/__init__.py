"""Evaluation of pruning methods on real data: online NLL, fidelity to dense, HumanEval pass@1."""

from .harness import EvalSettings, evaluate, markdown_table, plot_records, sweep_methods
from .sandbox import run_python
from .teacher import teacher_forced

__all__ = ["EvalSettings", "evaluate", "markdown_table", "plot_records", "run_python", "sweep_methods", "teacher_forced"]
