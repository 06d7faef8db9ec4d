"""Analyses of a model under a method that are not evaluations of its output: FLOPs and bytes
per decode step (``flops``), memory plans for meshes (``memory_plan``) and per-layer prefill vs
decode importance (``layer_importance``)."""
