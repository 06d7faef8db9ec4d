"""Memory plans of the published configs (docs/scale_out.md). Run with fake CPU devices:
XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python benchmarks/plan_models.py OUT.json [MODEL ...] [--scan-layers]
--scan-layers plans the scanned model (layers under lax.scan): what makes the 80-layer 70B compile."""
import json
import sys

import popjax
from popjax.analysis.memory_plan import DEVICES, fits, format_plan, memory_plan, resolve_config
from popjax.sharding import make_mesh

METHODS = {
    "dense": popjax.Dense(),
    "static 0.2": popjax.Static(0.2),
    "POP 0.2 shared, global": popjax.POP(0.2),
    "POP 0.2 per_sequence, global": popjax.POP(0.2, aggregate="per_sequence"),
    "POP 0.2 shared, per_shard": popjax.POP(0.2, partition="per_shard"),
    "POP 0.2 per_sequence, per_shard": popjax.POP(0.2, aggregate="per_sequence", partition="per_shard"),
    "POP 0.2 shared, per_shard, gather": popjax.POP(0.2, partition="per_shard", weights="gather"),
    "POP 0.2 per_sequence, per_shard, gather": popjax.POP(0.2, aggregate="per_sequence", partition="per_shard", weights="gather"),
    "POP 0.2 shared, global, gather": popjax.POP(0.2, weights="gather"),
}
scan = "--scan-layers" in sys.argv[1:]
args = [a for a in sys.argv[1:] if a != "--scan-layers"]
out, models = args[0], args[1:] or ["llama-3.1-8b"]
try:  # plans already in OUT are kept and not recomputed
    results = json.load(open(out))
except FileNotFoundError:
    results = []
done = {(p["config"], p["label"], p.get("scan_layers", False)) for p in results}
for name in models:
    for label, method in METHODS.items():
        if (name, label, scan) in done:
            continue
        plan = memory_plan(resolve_config(name), make_mesh((1, 8)), method, 8, 4096, 2048, "bfloat16", scan_layers=scan)
        plan.update(config=name, label=label, fits={k: fits(plan, v) for k, v in DEVICES.items()})
        print(format_plan(plan), plan["fits"], flush=True)
        results.append(plan)
        json.dump(results, open(out, "w"), indent=1)
