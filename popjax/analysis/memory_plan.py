"""``popjax plan``: what a model, mesh, batch, context and method need per device, from XLA itself.

The engine's own programs are lowered and compiled ahead of time against abstract, sharded
shapes (``sharding.abstract_params``: no weight is allocated): ``engine.start`` (prefill plus the
first token; it allocates the full-capacity KV cache) and ``engine.decode_loop`` (its carry
donated, as generation runs it). XLA's memory analysis gives per-device bytes of arguments,
outputs and temporaries; the carry's own shardings (as XLA assigned them) split it into KV cache
and method state. One decode step (``engine.stream_step``) gives FLOPs and bytes accessed from
XLA's cost analysis. Analytic figures stand next to them: weights / model-axis size, the KV
formula 2·B·kv_dim·itemsize·Σ_l S_l / (data · model) — S_l the cache slots of layer l: every slot
for a full layer, the ring of its window for a sliding-window layer, and beside it the same
formula with every layer full (what the model would need without windows) — and
`bench.bytes_per_step`. An offline method without its fits plans with placeholder fits of the right
shapes (`popjax.analysis.shape_fitted`), as `popjax compile` does: a plan needs shapes, not a calibration.

Published configs ship as small JSON files in ``popjax/configs/`` (HF ``config.json`` fields);
any HF ``config.json`` path works as well. On CPU a mesh larger than the visible devices needs
fake devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N``); the CLI
(``popjax/cli/plan.py``) re-runs itself with that flag set, since XLA reads it only at start-up. ``scan_layers=True`` (``--scan-layers``)
plans the scanned model, whose programs hold one layer's code: an 80-layer model compiles where the
unrolled one (80 inlined layer copies) does not finish.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .. import engine, sharding
from ..requests import MAX_STOP_IDS
from ..models.config import ModelConfig
from ..kernels.attention import ring_slots
from ..models.decoder import abstract_model
from ..models.scan import abstract_scanned_model, check_scannable
from ..sampling import SamplingParams
from .flops import bytes_per_step
from .shape_fitted import abstract_data, shape_fitted

CONFIG_DIR = Path(__file__).parent.parent / "configs"  # popjax/configs
GiB = 1024**3


def published_configs() -> list[str]:
    """Names of the shipped configs (``popjax/configs/*.json``)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def resolve_config(model: str) -> ModelConfig:
    """A published config name or a path to an HF ``config.json`` -> ModelConfig (ConfigError
    names an unsupported architecture)."""
    path = CONFIG_DIR / f"{model}.json"
    if not path.is_file():
        path = Path(model)
        if not path.is_file():
            raise ValueError(f"model {model!r} is neither a published config {published_configs()} nor a config.json file")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    return ModelConfig.from_hf_dict(raw)


def parse_mesh(text: str) -> tuple[int, int]:
    """"1x8" -> (1, 8): (data, model)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"mesh {text!r} must be DATAxMODEL with positive integers, e.g. 1x8 or 2x4")
    return int(parts[0]), int(parts[1])


def _shard_bytes(tree: Any) -> int:
    """Per-device bytes of a tree of ShapeDtypeStructs with shardings (the largest shard)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def _with_shardings(tree: Any, shardings: Any) -> Any:
    return jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def _memory(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    return {f.replace("_size_in_bytes", ""): int(getattr(m, f)) for f in fields}


def _cost(compiled) -> dict[str, float]:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {"flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


def _compile(cfg: ModelConfig, mesh, plan, batch: int, prompt: int, capacity: int, dtype: str, scan_layers: bool,
             decode_loop: bool = True, data: Any = None, prefill: bool = True) -> dict[str, Any]:
    """Compiles the engine's programs against abstract sharded params (no weights): ``start``,
    ``decode_loop`` (unless ``decode_loop=False``) and ``stream_step``; returns them with the
    abstract ``params``, the decode ``carry`` (ShapeDtypeStructs in XLA's shardings) and each
    program's compile ``seconds``. ``data``: an offline method's calibrated data, abstract
    (`popjax.analysis.shape_fitted.abstract_data`). The mesh's devices may be another platform's
    (a TPU topology: `popjax.analysis.tpu_compile`). ``prefill=False`` (a one-device mesh only,
    where every sharding is that device; the caller checks) lowers ``start`` for the carry's
    shapes without compiling it."""
    build = abstract_scanned_model if scan_layers else abstract_model  # shapes only, no weights
    graphdef, _ = nnx.split(build(cfg, jnp.dtype(dtype)))
    params = sharding.abstract_params(cfg, mesh, dtype, scan_layers=scan_layers)
    rows = jax.sharding.NamedSharding(mesh, sharding.partition_spec(("batch", None), dict(mesh.shape)))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    tokens = jax.ShapeDtypeStruct((batch, prompt), jnp.int32, sharding=rows)
    scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=replicated)  # noqa: E731
    sampling = SamplingParams(scalar(jnp.float32), scalar(jnp.int32), scalar(jnp.float32))
    stops = jax.ShapeDtypeStruct((MAX_STOP_IDS,), jnp.int32, sharding=replicated)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
    out: dict[str, Any] = {"params": params, "seconds": {}}

    def compile_(name, lowered):
        began = time.perf_counter()
        out[name] = lowered.compile()
        out["seconds"][name] = time.perf_counter() - began

    with jax.set_mesh(mesh):
        lowered = engine.start.lower(graphdef, params, plan, tokens, tokens, key, sampling, stops, scalar(jnp.int32),
                                     capacity=capacity, data=data)
        if prefill:
            compile_("start", lowered)
            shardings = out["start"].output_shardings[0]
        else:  # one device (the caller checks, `tpu_compile`): every leaf on it
            shardings = jax.tree_util.tree_map(lambda _: replicated, lowered.out_info[0])
        # the carry as decode receives it: start's output shapes in the shardings XLA gave them
        carry = out["carry"] = _with_shardings(lowered.out_info[0], shardings)
        if decode_loop:
            compile_("loop", engine.decode_loop.lower(graphdef, params, plan, carry, scalar(jnp.int32), sampling, stops,
                                                      scalar(jnp.int32), capacity=capacity, data=data))
        compile_("step", engine.stream_step.lower(graphdef, params, plan, carry, sampling, stops, scalar(jnp.int32), data=data))
    return out


def _with_layers(cfg: ModelConfig, n: int) -> ModelConfig:
    """``cfg`` cut to its first ``n`` layers (of a scannable config: every layer alike)."""
    moe = cfg.moe
    if moe is not None and moe.sparse_layers:
        moe = dataclasses.replace(moe, sparse_layers=tuple(range(n)))
    kinds = None if cfg.layer_types is None else cfg.layer_types[:n]
    return dataclasses.replace(cfg, num_hidden_layers=n, moe=moe, layer_types=kinds)


def _bind(method, cfg: ModelConfig, dtype: str, mesh) -> tuple[Any, Any]:
    """``method``'s plan for ``cfg`` and its calibrated data as ShapeDtypeStructs replicated over
    ``mesh`` (None when it has none). A plan needs shapes, not a calibration: an offline method
    without its fits (TEAL's thresholds, GLASS's prior, ...) gets placeholder fits of the right
    shapes (`shape_fitted`), as `popjax compile` gives it, so ``popjax plan --method teal`` plans
    what a calibrated TEAL would run."""
    fitted = shape_fitted(method, cfg)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return fitted.bind(cfg), abstract_data(fitted, cfg, dtype, replicated)


def _layer_extrapolated_cost(cfg: ModelConfig, mesh, method, batch: int, prompt: int, capacity: int,
                             dtype: str) -> dict[str, float]:
    """XLA's cost of one unrolled decode step of the L-layer model, from the 1- and 2-layer
    models: cost(1) + (L - 1)·(cost(2) - cost(1)), every layer being alike.

    XLA's cost analysis counts a while loop's body once, so a scanned step reports one layer's
    cost whatever L is. The unrolled step is additive over its identical layers (on a tiny
    config the extrapolation from 1 and 2 layers gave the compiled 4-layer figures to 1e-5)."""
    costs = []
    for n in (1, 2):
        small = _with_layers(cfg, n)
        plan, data = _bind(method, small, dtype, mesh)
        costs.append(_cost(_compile(small, mesh, plan, batch, prompt, capacity, dtype, scan_layers=False,
                                    decode_loop=False, data=data)["step"]))
    one, two = costs
    return {k: one[k] + (cfg.num_hidden_layers - 1) * (two[k] - one[k]) for k in one}


def memory_plan(cfg: ModelConfig, mesh, method, batch: int, context: int, prompt: int | None = None,
                dtype: str = "bfloat16", scan_layers: bool = False, hosts: int = 1) -> dict[str, Any]:
    """Per-device memory and per-step cost of generating with ``method`` on ``mesh``.

    ``context`` is the KV-cache capacity (prompt + generated tokens, an engine capacity bucket);
    ``prompt`` the prefill length (default ``context // 2``, or ``context − 4096`` when the
rest would exceed the largest capacity bucket). ``scan_layers``: plan the scanned
    model (``load(..., scan_layers=True)``, models/scan.py): its layers are stacked on a leading
    [L] axis and run by one ``lax.scan`` step, so a program holds one layer's code and deep models
    compile in minutes; configs the scanned model refuses (per-layer widths, mixed MoE layers)
    raise its ValueError. Memory figures are then the scanned programs'; the decode-step cost is
    extrapolated from unrolled 1- and 2-layer compiles (``_layer_extrapolated_cost``: XLA counts
    a scan's body once). ``hosts``: the mesh's devices split over that many processes
    (`host_memory`). Returns a JSON-ready dict."""
    if scan_layers:
        check_scannable(cfg)  # before any compile: the scanned model's own error
    check_hosts(hosts, mesh.size)
    if batch < 1 or context < 2:
        raise ValueError(f"batch={batch} must be ≥ 1 and context={context} ≥ 2")
    if prompt is None:  # half the context, or more when the rest exceeds the largest capacity bucket
        prompt = max(context // 2, context - engine.CAPACITY_BUCKETS[-1])
    if not 1 <= prompt < context:
        raise ValueError(f"prompt={prompt} must be in [1, context={context})")
    capacity = engine.bucket_for(context - prompt, engine.CAPACITY_BUCKETS, "context - prompt")
    sharding.check_mesh(cfg, mesh)
    sharding.check_batch(batch, mesh)
    if getattr(method, "partition", None) == "per_shard" and method.shards is None:
        method = dataclasses.replace(method, shards=mesh.shape["model"])  # as POP.prepare does for a loaded model
    plan, method_data = _bind(method, cfg, dtype, mesh)
    programs = _compile(cfg, mesh, plan, batch, prompt, capacity, dtype, scan_layers, data=method_data)
    params, carry, start, loop = programs["params"], programs["carry"], programs["start"], programs["loop"]
    step_cost = _cost(programs["step"])
    if scan_layers:
        step_cost = dict(_layer_extrapolated_cost(cfg, mesh, method, batch, prompt, capacity, dtype),
                         scan_body_flops=step_cost["flops"], scan_body_bytes_accessed=step_cost["bytes_accessed"])
    itemsize = jnp.dtype(dtype).itemsize
    data, model_axis = mesh.shape["data"], mesh.shape["model"]
    kv_heads_split = model_axis if cfg.num_key_value_heads % model_axis == 0 else 1
    slots = carry.state.key_valid.shape[1]
    xla = {
        "weights": _shard_bytes(params),
        "kv_cache": _shard_bytes(carry.state.caches),
        "method_state": _shard_bytes(carry.state.method_states),
        "prefill": _memory(start),
        "decode": _memory(loop),
    }
    xla["decode_peak"] = xla["decode"]["argument"] + xla["decode"]["output"] - xla["decode"]["alias"] + xla["decode"]["temp"]
    xla["prefill_peak"] = xla["prefill"]["argument"] + xla["prefill"]["output"] - xla["prefill"]["alias"] + xla["prefill"]["temp"]
    n_params = sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(params))
    weight_bytes = sum(math.prod(leaf.shape) * min(jnp.dtype(leaf.dtype).itemsize, itemsize)  # int8 leaves: 1 byte
                       for leaf in jax.tree_util.tree_leaves(params))
    # a sliding-window layer keeps a ring of its window (kernels/attention.py ring_slots), a full layer every slot
    layer_slots = [slots if cfg.window(i) is None else ring_slots(cfg.window(i), slots) for i in range(cfg.num_hidden_layers)]
    kv_bytes = lambda total_slots: 2 * batch * total_slots * cfg.kv_dim * itemsize // (min(data, batch) * kv_heads_split)
    analytic = {
        "weights": weight_bytes // model_axis,
        "kv_cache": kv_bytes(sum(layer_slots)),
        "kv_cache_without_windows": kv_bytes(cfg.num_hidden_layers * slots),
        "bytes_per_decode_step": bytes_per_step(cfg, plan, batch, slots, itemsize),
        "flops_per_decode_step": 2 * n_params * batch,
    }
    return {
        "model": cfg.model_type, "layers": cfg.num_hidden_layers, "mesh": {"data": data, "model": model_axis},
        "devices": data * model_axis, "batch": batch, "context": context, "prompt": prompt, "cache_slots": slots,
        "sliding_window": cfg.sliding_window, "sliding_layers": len(cfg.sliding_layers),
        "dtype": dtype, "weights": cfg.weights, "method": repr(method), "plan": type(plan).__name__, "scan_layers": scan_layers,
        "xla_per_device": xla, "analytic_per_device": analytic, "decode_step_cost": step_cost,
        # a per-sequence plan that copies weight blocks holds one copy per row (its method state)
        "per_sequence_copies": bool(plan.state_per_sequence and getattr(plan, "compact_weights", False)),
        **({"per_host": host_memory(params, mesh, hosts, weight_bytes)} if hosts > 1 else {}),
    }


def check_hosts(hosts: int, devices: int) -> None:
    if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1 or devices % hosts:
        raise ValueError(f"--hosts {hosts} must be a positive divisor of the mesh's {devices} devices "
                         f"(valid: {[h for h in range(1, devices + 1) if devices % h == 0]})")


def host_memory(params: Any, mesh, hosts: int, weight_bytes: int) -> dict[str, Any]:
    """Per host of a multi-host run over ``mesh``, each host owning a contiguous 1/hosts of its
    devices (JAX lists a multi-process run's devices process by process): its chips, and the
    host RAM its process needs while ``popjax.load`` restores a converted directory: the
    distinct blocks its own devices hold (orbax reads only those; a block several of its chips
    replicate is read once), largest over the hosts. Converting a source instead (process 0,
    once) holds the whole model in host RAM. ``params``: ShapeDtypeStructs with shardings."""
    devices = list(mesh.devices.flat)
    per = len(devices) // hosts
    ram = []
    for h in range(hosts):
        mine = set(devices[h * per : (h + 1) * per])
        total = 0
        for leaf in jax.tree_util.tree_leaves(params):
            blocks = {tuple((s.start, s.stop) for s in index)
                      for device, index in leaf.sharding.devices_indices_map(leaf.shape).items() if device in mine}
            block = math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
            total += len(blocks) * block
        ram.append(total)
    return {"hosts": hosts, "chips_per_host": per, "host_ram_loading": max(ram), "host_ram_converting": weight_bytes}


def fits(plan: dict[str, Any], device_bytes: int) -> bool:
    """Whether the larger of the prefill and decode peaks fits in ``device_bytes``."""
    x = plan["xla_per_device"]
    return max(x["prefill_peak"], x["decode_peak"]) <= device_bytes


def format_plan(p: dict[str, Any]) -> str:
    """A human-readable table (GiB per device)."""
    x, a = p["xla_per_device"], p["analytic_per_device"]
    g = lambda b: f"{b / GiB:8.3f}"  # noqa: E731
    lines = [
        f"{p['model']} ({p['layers']} layers), {p['dtype']}{', int8 weights' if p.get('weights') == 'int8' else ''}, mesh data={p['mesh']['data']} × model={p['mesh']['model']}, "
        f"batch {p['batch']}, context {p['context']} (prompt {p['prompt']}, {p['cache_slots']} cache slots), {p['method']}"
        + (", scanned layers" if p.get("scan_layers") else ""),
        "per device (GiB)           XLA   analytic",
        f"  weights            {g(x['weights'])}   {g(a['weights'])}",
        f"  KV cache           {g(x['kv_cache'])}   {g(a['kv_cache'])}",
        *([f"  KV without windows            {g(a['kv_cache_without_windows'])}   (every layer full: "
           f"{a['kv_cache_without_windows'] / max(a['kv_cache'], 1):.1f}x)"] if p.get("sliding_window") else []),
        f"  method state       {g(x['method_state'])}",
        f"  prefill temps      {g(x['prefill']['temp'])}",
        f"  decode temps       {g(x['decode']['temp'])}",
        f"  prefill peak       {g(x['prefill_peak'])}",
        f"  decode peak        {g(x['decode_peak'])}",
        f"decode step: XLA {p['decode_step_cost']['flops'] / 1e9:.2f} GFLOP, {p['decode_step_cost']['bytes_accessed'] / GiB:.3f} GiB "
        f"accessed per device; analytic (whole model) {a['flops_per_decode_step'] / 1e9:.2f} GFLOP, "
        f"{a['bytes_per_decode_step'] / GiB:.3f} GiB"
        + (" (XLA's: unrolled 1- and 2-layer steps extrapolated to all layers)" if p.get("scan_layers") else ""),
    ]
    if p.get("per_sequence_copies"):
        lines.append(f"  the method state holds one compact weight copy per sequence (aggregate='per_sequence', the "
                     f"default): {x['method_state'] / GiB:.3f} GiB at batch {p['batch']}; if a batch's copies do not fit, "
                     f"aggregate='shared' keeps one per batch (POP: or weights='gather', ids only)")
    if "per_host" in p:
        h = p["per_host"]
        lines += [
            f"per host ({h['hosts']} hosts × {h['chips_per_host']} chips): device memory per chip as above (decode peak "
            f"{g(x['decode_peak']).strip()} GiB, prefill peak {g(x['prefill_peak']).strip()} GiB)",
            f"  host RAM loading   {g(h['host_ram_loading'])}   (the distinct blocks this host's chips hold, read from a converted directory)",
            f"  host RAM converting{g(h['host_ram_converting'])}   (process 0 alone, once: the whole model)",
        ]
    return "\n".join(lines)


DEVICES = {"tpu-v5e": 16 * GiB, "h100": 80 * GiB}  # per-chip memory of the targets the docs discuss
