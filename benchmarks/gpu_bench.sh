#!/usr/bin/env bash
# The benchmark on a GPU machine, in bf16. Needs nothing from the network: jax with CUDA and the
# project (pip install -e .) must already be installed there, and the default model must be in
# the cache ($POPJAX_CACHE, carried over from this machine). Results land in $OUT (default results/).
set -euo pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
python -c "import jax; d = jax.devices()[0]; assert d.platform == 'gpu', f'no GPU: {jax.devices()}'; print(d)"
popjax bench --dtype bfloat16 --batches 1,8 --max-new-tokens 128 --no-transformers \
  --json "$OUT/bench_gpu.json" | tee "$OUT/bench_gpu.md"
