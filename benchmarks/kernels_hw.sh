#!/usr/bin/env bash
# The decode benchmark with and without the Pallas decode-FFN kernels on a TPU or GPU machine
# (issue 44, "ready for hardware"): dense, POP 40% through XLA's gathers (kernel=xla) and through
# the Pallas kernels (kernel=pallas; block POP, b = 16, through the block kernel: on the default
# model's f = 1536, b = 128 would choose 1 block of 2), static (and block static, b = 16, through
# XLA's compact copy and through the fused block kernel on a slab), and TEAL 40% through XLA's masks
# and through the kernels (its input-major copies, docs/kernels.md), batch 1 and 8, bf16, on the
# default model. Needs nothing from the network: the README's install (plus jax[tpu] or
# jax[cuda12] of the same jax version) and the default model in the cache ($POPJAX_CACHE, carried
# over from a machine that fetched it). Every record names the kernel that ran ("kernel": xla,
# pallas-tpu or pallas-gpu). Results land in $OUT (default results/kernels):
# kernels_bench_<platform>.json and .md.
set -euo pipefail
OUT=${OUT:-results/kernels}
mkdir -p "$OUT"
PLATFORM=$(python -c "import jax; print(jax.devices()[0].platform)")
case "$PLATFORM" in
  tpu|gpu) ;;
  *) echo "kernels_hw.sh: JAX's devices are $PLATFORM; this script measures the kernels on a TPU or GPU" >&2; exit 2 ;;
esac
timeout 600 popjax bench --dtype bfloat16 --batches 1,8 --ratios 0.4 --max-new-tokens 128 --no-transformers \
  --methods pop:kernel=xla,pop:kernel=pallas,pop:block=16:kernel=pallas,static,static:block=16:kernel=xla,static:block=16:kernel=pallas,teal:kernel=xla,teal:kernel=pallas --suites decode \
  --json "$OUT/kernels_bench_$PLATFORM.json" | tee "$OUT/kernels_bench_$PLATFORM.md"
