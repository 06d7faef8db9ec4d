"""Analyses of a model under a method that are not evaluations of its output: FLOPs and bytes
per decode step (``flops``), memory plans for meshes (``memory_plan``), per-layer prefill vs
decode importance (``layer_importance``), and what the TPU compiler makes of a step
(``tpu_compile``; the HBM bytes of its optimized HLO, ``hbm_traffic`` over ``hlo_text``)."""
