"""The engine's programs compiled by the real TPU compiler for a TPU slice, on any machine.

``tpu_compile(model, topology="v5e:2x4", methods=("dense", "pop"), ratios=(0.4,), ...)`` builds
the engine's own jitted programs against abstract, sharded arguments (no weights): the prefill
at a prompt bucket with the first token (``engine.start``), one decode step
(``engine.stream_step``) and the decode loop (``engine.decode_loop``), on a mesh of the slice's
devices (`popjax.analysis.topologies`) with popjax's shardings, exactly as `popjax plan` does on
fake CPU devices (`memory_plan._compile`, shared). XLA:TPU compiles them; per program the report
gives the compiler's per-device memory (arguments = weights + KV cache + method state, outputs,
temporaries, generated code) against the chip's HBM and whether it fits, and the compile time.
Per decode step: FLOPs and bytes accessed per device from the compiler's cost analysis, the
bytes the compiled step moves to and from HBM (`popjax.analysis.hbm_traffic`: counted from the
optimized HLO's memory spaces, leaving out the VMEM staging the cost analysis counts on top),
the analytic ideal bytes (`popjax.analysis.flops.bytes_per_step`) beside them, and **estimates**
of decode tokens/s = batch / (bytes per step / HBM bandwidth per device), one from each count:
roofline bounds that assume the step is bound by HBM traffic, not measurements. Every method is
compared with dense (compiled too).

With ``scan_layers`` the memory figures are the scanned programs'; XLA counts a loop body once,
so the decode step's cost is extrapolated from unrolled 1- and 2-layer compiles, as `popjax plan`
does, except its HBM bytes: those are the scanned program's own (the count walks every trip of
the layer loop), the unrolled extrapolation beside them (``unrolled_hbm_bytes``). Offline
methods compile with placeholder fits of the right shapes (`popjax.analysis.shape_fitted`). JAX
stays on its CPU backend throughout.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp

from .. import engine, kernels, sharding
from ..kernels import fallback
from ..convert.readers import gguf_config, open_gguf
from ..files import write_json_atomic
from ..methods import Method, method_label, sweep
from ..models.config import ModelConfig
from ..models.scan import check_scannable
from ..requests import with_kernel
from .flops import bytes_per_step
from .hbm_traffic import hbm_traffic
from .memory_plan import _compile, _cost, _shard_bytes, _with_layers, resolve_config
from .shape_fitted import abstract_data, shape_fitted
from .topologies import Topology, resolve_topology, topology_mesh

log = logging.getLogger(__name__)
PROGRAMS = {"prefill": "start", "decode_step": "step", "decode_loop": "loop"}  # report name -> _compile's key
ESTIMATE = "estimate: batch / (bytes accessed per step / HBM bandwidth), HBM-bound roofline, not a measurement"
HBM_ESTIMATE = ("estimate: batch / (HBM bytes per step / HBM bandwidth), the HBM bytes counted from the optimized "
                "HLO's memory spaces (VMEM staging left out), HBM-bound roofline, not a measurement")
XLA_ESTIMATE = "estimate: batch / XLA:TPU's own optimal_seconds of the step (its cost model), not a measurement"


def resolve_model(source: str | ModelConfig) -> ModelConfig:
    """A ModelConfig, a shipped config name (``popjax/configs``), a ``config.json`` path, a
    Hugging Face directory holding one (no weights needed), or a ``.gguf`` file (its metadata)."""
    if isinstance(source, ModelConfig):
        return source
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {source!r} holds no config.json")
        path = path / "config.json"
    if path.suffix == ".gguf" and path.is_file():
        return gguf_config(open_gguf(path), path)
    return resolve_config(str(path) if path.is_file() else source)


def program_memory(compiled, hbm: int) -> dict[str, Any]:
    """The compiler's per-device memory of one program and whether its peak fits ``hbm`` bytes:
    peak = arguments + outputs − aliased (donated buffers updated in place) + temps + code."""
    m = compiled.memory_analysis()
    out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp", "generated_code")}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"] + out["generated_code"]
    out["fits"] = out["peak"] <= hbm
    return out


def step_cost(compiled, filled: int | None = None) -> dict[str, float | None]:
    """FLOPs and bytes accessed of a compiled program (`memory_plan._cost`), the bytes it moves
    to and from HBM (`hbm_traffic`, from its optimized HLO, its attention reading the ``filled``
    cache slots written at the step counted; None: the whole cache) and, where the compiler gives a
    usable one, its own estimate of the optimal run time in seconds (XLA:TPU's
    ``optimal_seconds``: plausible on small programs, negative on the 8B's steps, then None)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    seconds = float((cost or {}).get("optimal_seconds", 0.0))
    return {**_cost(compiled), "hbm_bytes": hbm_traffic(compiled.as_text(), filled=filled)["bytes"],
            "optimal_seconds": seconds if seconds > 0 else None}


def _extrapolated_step_cost(cfg: ModelConfig, mesh, method: Method, batch: int, prompt: int, capacity: int,
                            dtype: str) -> dict[str, float]:
    """A decode step's cost for all L layers from unrolled 1- and 2-layer compiles:
    cost(1) + (L − 1)·(cost(2) − cost(1)) (XLA counts a scan's body once)."""
    costs = []
    for n in (1, 2):
        small = _with_layers(cfg, n)
        plan, data = _bind_for_tpu(shape_fitted(method, small), small, dtype, mesh)
        costs.append(step_cost(_compile(small, mesh, plan, batch, prompt, capacity, dtype, False,
                                    decode_loop=False, data=data)["step"], counted_slots(prompt, capacity)))
    one, two = costs
    return {k: None if one[k] is None or two[k] is None else one[k] + (cfg.num_hidden_layers - 1) * (two[k] - one[k])
            for k in one}


def _bind_for_tpu(method: Method, cfg: ModelConfig, dtype: str, mesh):
    """``method``'s plan and abstract data with the TPU's kernels, not this host's
    (`kernels.compiling_for`): "auto" is the Pallas (Mosaic) kernel, run by every device of a
    mesh (`kernels.decode_ffn`), and the data holds what that kernel reads (TEAL's copies)."""
    with kernels.compiling_for("tpu"):
        return method.bind(cfg), abstract_data(method, cfg, dtype, _replicated(mesh))


def _compile_or_fall_back(cfg: ModelConfig, mesh, method: Method, plan, data, head: dict[str, Any], batch: int, prompt: int,
                          capacity: int, dtype: str, scan_layers: bool, **options):
    """`memory_plan._compile` of ``plan`` -> (its programs, method, plan, data as compiled). Each
    Pallas kernel is built alone when the program first traces it (`kernels.fallback.trial`);
    where one does not, kernel="auto" compiles the method through XLA instead (one warning;
    ``head`` records what ran) and kernel="pallas" is refused in one line."""
    try:
        return _compile(cfg, mesh, plan, batch, prompt, capacity, dtype, scan_layers, data=data, **options), method, plan, data
    except fallback.KernelUnavailable as err:
        head["kernel"] = fallback.fall_back(method_label(method), getattr(method.ffn_method, "kernel", "auto"), plan, err)
    method = with_kernel(method, "xla")
    plan, data = _bind_for_tpu(shape_fitted(method, cfg), cfg, dtype, mesh)
    head["plan"] = type(plan).__name__
    return _compile(cfg, mesh, plan, batch, prompt, capacity, dtype, scan_layers, data=data, **options), method, plan, data


@contextlib.contextmanager
def _no_persistent_cache() -> Iterator[None]:
    """JAX's persistent cache can store a compile-only TPU executable but not read it back (that
    needs a TPU client: a warning per entry), so these compiles write none."""
    key = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, key)
    jax.config.update(key, 1e12)
    try:
        yield
    finally:
        jax.config.update(key, before)


def _replicated(mesh):
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def counted_slots(prompt: int, capacity: int) -> int:
    """The cache slots a counted decode step's attention reads: the step in the middle of the
    generation (the prompt bucket and half the new tokens written, plus its own), whose bytes are
    the mean step's of a generation that fills the cache. Decode attention reads only what is
    written (`kernels.attention.cached_attention`), so a larger cache costs memory, not bytes."""
    return prompt + capacity // 2 + 1


def ideal_bytes(cfg: ModelConfig, plan, batch: int, slots: int, itemsize: int, mesh_shape: tuple[int, int]) -> dict[str, int]:
    """The analytic bytes one decode step reads (`flops.bytes_per_step`): whole model, and per
    device with the weights split over ``model`` and the KV cache over data rows and KV heads."""
    data, model = mesh_shape
    total = bytes_per_step(cfg, plan, batch, slots, itemsize)
    weights = bytes_per_step(cfg, plan, batch, 0, itemsize)  # no cache slots: weights alone
    kv_split = min(data, batch) * (model if cfg.num_key_value_heads % model == 0 else 1)
    return {"whole_model": total, "per_device": weights // model + (total - weights) // kv_split}


def compile_method(cfg: ModelConfig, topology: Topology, mesh, method: Method, *, batch: int, prompt: int,
                   capacity: int, dtype: str, scan_layers: bool = False, decode_loop: bool = True,
                   prefill: bool = True, hlo_dir: str | Path | None = None) -> dict[str, Any]:
    """One method's programs compiled for ``topology`` on ``mesh`` -> its JSON-ready record
    (``hlo_dir``: write the optimized HLO of each compiled program there,
    ``<label>-<ratio>.{start,step,loop}.hlo.txt``: prefill, decode step, decode loop)."""
    plan, data = _bind_for_tpu(shape_fitted(method, cfg), cfg, dtype, mesh)
    hbm, label = topology.hbm_per_device, method_label(method, exclude=("ratio",))
    ratio = method.reported()["ratio"]
    # what the decode step's selected rows run through on the TPU (`popjax.kernels.RESOLVED`)
    # (or "xla (fallback: ...)" where kernel="auto" met a Pallas kernel that does not build: `_compile_or_fall_back`)
    head = {"method": label, "name": method.name, "ratio": ratio, "plan": type(plan).__name__, "kernel": fallback.ran(plan)}
    try:
        with _no_persistent_cache(), kernels.compiling_for("tpu"):  # traced for the TPU (`sharding.pad_ids`)
            out, method, plan, data = _compile_or_fall_back(cfg, mesh, method, plan, data, head, batch, prompt, capacity, dtype,
                                                            scan_layers, decode_loop=decode_loop, prefill=prefill)
            cost = step_cost(out["step"], counted_slots(prompt, capacity))
            if scan_layers:
                # the HBM count walks every trip of the layer loop: the scanned program's own (what the
                # loop costs beyond the unrolled step: docs/tpu.md), the unrolled extrapolation beside it
                unrolled = _extrapolated_step_cost(cfg, mesh, method, batch, prompt, capacity, dtype)
                cost = dict(unrolled, scan_body_flops=cost["flops"], scan_body_bytes_accessed=cost["bytes_accessed"],
                            hbm_bytes=cost["hbm_bytes"], unrolled_hbm_bytes=unrolled["hbm_bytes"])
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        # XLA:TPU refuses a program larger than the chip's HBM: it does not fit (the compiler says by how much)
        return {**head, "fits": False, "error": str(err).strip().splitlines()[0], "programs": {}}
    programs = {name: dict(program_memory(out[key], hbm), compile_seconds=round(out["seconds"][key], 2))
                for name, key in PROGRAMS.items() if key in out}
    if hlo_dir is not None:
        Path(hlo_dir).mkdir(parents=True, exist_ok=True)
        for key in PROGRAMS.values():
            if key in out:
                (Path(hlo_dir) / f"{label}-{ratio}.{key}.hlo.txt").write_text(out[key].as_text())
    carry, itemsize = out["carry"], jnp.dtype(dtype).itemsize
    slots = carry.state.key_valid.shape[1]
    read = min(counted_slots(prompt, capacity), slots)
    ideal = ideal_bytes(cfg, plan, batch, read, itemsize, (mesh.shape["data"], mesh.shape["model"]))
    seconds = cost["bytes_accessed"] / topology.bandwidth_per_device
    # what stays on a device between programs: a program's own arguments leave out what it does
    # not read (XLA drops unused ones: TEAL's kernel step reads its copies, not the FFN weights)
    arguments = {"weights": _shard_bytes(out["params"]), "kv_cache": _shard_bytes(carry.state.caches),
                 "method_state": _shard_bytes(carry.state.method_states), "method_data": _shard_bytes(data)}
    held = sum(arguments.values())
    return {
        **head, "programs": programs, "fits": all(p["fits"] for p in programs.values()) and held <= hbm,
        "arguments": arguments, "held": held,
        "decode_step": {**cost, "ideal_bytes_per_device": ideal["per_device"], "ideal_bytes_whole_model": ideal["whole_model"],
                        "estimated_tokens_per_s": batch / seconds if seconds else math.inf,
                        "hbm_estimated_tokens_per_s": batch * topology.bandwidth_per_device / cost["hbm_bytes"],
                        "xla_estimated_tokens_per_s": batch / cost["optimal_seconds"] if cost["optimal_seconds"] else None,
                        "ideal_tokens_per_s": batch * topology.bandwidth_per_device / ideal["per_device"]},
        "cache_slots": slots, "kv_slots_read": read,
    }


def tpu_compile(model: str | ModelConfig, topology: str = "v5e:2x4", methods: Sequence[str] = ("dense",),
                ratios: Sequence[float] = (0.4,), *, weights: str = "float", dtype: str = "bfloat16", batch: int = 1,
                context: int = 1024, prompt: int | None = None, mesh: tuple[int, int] | None = None,
                scan_layers: bool = False, decode_loop: bool = True, prefill: bool = True, require_fit: bool = False,
                with_dense: bool = True, hlo_dir: str | Path | None = None, jobs: int = 1) -> dict[str, Any]:
    """Compiles every (method spec, ratio) of ``methods`` × ``ratios`` and dense for a TPU slice
    -> a JSON-ready report: the target, the shapes, one record per method (`compile_method`) with
    its decode-step ratios against dense.

    ``model``: `resolve_model`; ``methods``: registry specs (``"pop"``, ``"pop:gamma=0.2"``,
    ``"prefill-only+pop"``); ``weights``: "float" or "int8"; ``context``: the KV capacity
    (prompt + generated); ``prompt``: the prefill length (default half the context, at least
    context − 4096), padded to the engine's prompt bucket; ``mesh``: (data, model), default
    (1, devices); ``decode_loop``: also compile the decode loop; ``prefill``: also compile the
    prefill (False, on a one-device mesh only: the decode step alone, what a sweep over many
    methods needs; the prefill is still lowered for the carry's shapes); ``require_fit``: ValueError
    when a program's per-device peak exceeds the chip's HBM; ``with_dense``: compile dense as
    the baseline of the ``vs_dense`` ratios (without it no record has them); ``jobs``: compile
    that many methods at once, each in its own process. Bad input raises ValueError (or
    MethodError / ConfigError) in one line; ImportError names the extra when libtpu is missing."""
    cfg = resolve_model(model)
    if weights not in ("float", "int8"):
        raise ValueError(f"weights={weights!r} must be 'float' or 'int8'")
    cfg = dataclasses.replace(cfg, weights=weights)
    if scan_layers:
        check_scannable(cfg)
    if batch < 1 or context < 2:
        raise ValueError(f"batch={batch} must be ≥ 1 and context={context} ≥ 2")
    prompt = max(context // 2, context - engine.CAPACITY_BUCKETS[-1]) if prompt is None else prompt
    if not 1 <= prompt < context:
        raise ValueError(f"prompt={prompt} must be in [1, context={context})")
    prompt_bucket = engine.bucket_for(prompt, engine.PROMPT_BUCKETS, "the prompt length")
    capacity = engine.bucket_for(context - prompt, engine.CAPACITY_BUCKETS, "context - prompt")
    specs = list(dict.fromkeys(["dense", *methods] if with_dense else methods))  # dense first: the baseline
    sweep_ = sweep(specs, list(ratios), dedupe=True)  # MethodError for an unknown name, before any compile
    target = resolve_topology(topology)
    shape = (1, len(target.devices)) if mesh is None else tuple(mesh)
    grid = topology_mesh(target, shape)
    sharding.check_mesh(cfg, grid)
    sharding.check_batch(batch, grid)
    methods_ = [dataclasses.replace(m, shards=grid.shape["model"])  # as POP.prepare does on a mesh
                if getattr(m, "partition", None) == "per_shard" and m.shards is None else m for _, m in sweep_]
    if not prefill and grid.devices.size != 1:
        raise ValueError(f"prefill=False needs a mesh of one device (the carry's shardings come from the prefill's "
                         f"compile); mesh {shape[0]}x{shape[1]} has {grid.devices.size}")
    shapes = dict(batch=batch, prompt=prompt_bucket, capacity=capacity, dtype=dtype, scan_layers=scan_layers,
                  decode_loop=decode_loop, prefill=prefill, hlo_dir=hlo_dir)
    if jobs > 1 and len(methods_) > 1:  # XLA compiles one program on about one core: methods side by side
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(min(jobs, len(methods_)), mp_context=spawn,
                                                    initializer=exit_with_parent) as pool:
            records = list(pool.map(_compile_in_worker, [(cfg, target.name, shape, m, shapes) for m in methods_]))
    else:
        records = [_compile_logged(cfg, target, grid, m, shapes) for m in methods_]
    if with_dense:
        _against_dense(records)
    report = {
        "topology": target.describe(), "mesh": {"data": shape[0], "model": shape[1]},
        "model": {"type": cfg.model_type, "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
                  "source": str(model) if not isinstance(model, ModelConfig) else cfg.model_type},
        "weights": weights, "dtype": dtype, "batch": batch, "context": context, "prompt": prompt,
        "prompt_bucket": prompt_bucket, "capacity": capacity, "scan_layers": scan_layers,
        "estimate_note": ESTIMATE, "hbm_estimate_note": HBM_ESTIMATE, "xla_estimate_note": XLA_ESTIMATE, "jax_backend": jax.default_backend(), "records": records,
    }
    if require_fit:
        check_fit(report)
    return report


def _compile_logged(cfg: ModelConfig, target: Topology, grid, method: Method, shapes: dict[str, Any]) -> dict[str, Any]:
    log.info("compiling %s for %s", method_label(method), target.name)
    return compile_method(cfg, target, grid, method, **shapes)


def exit_with_parent() -> None:
    """A compile worker's initializer: the worker exits once the process that started it is
    gone. A killed ``popjax compile --jobs N`` otherwise left its workers compiling, then idle,
    holding 4 GB each, until someone found them."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _compile_in_worker(job: tuple) -> dict[str, Any]:
    """`compile_method` in a worker process (``jobs`` > 1): the topology is resolved there again
    (its devices belong to the process that made them)."""
    cfg, name, shape, method, shapes = job
    if not log.handlers:  # this module's progress lines only, not every library's INFO (JAX's backend probing)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    target = resolve_topology(name)
    return _compile_logged(cfg, target, topology_mesh(target, shape), method, shapes)


def _against_dense(records: list[dict[str, Any]]) -> None:
    """Adds each record's decode-step ratios to the dense record's (the first); none where
    either program did not compile (did not fit)."""
    if "decode_step" not in records[0]:
        return
    dense = records[0]["decode_step"]
    for r in records:
        if "decode_step" not in r:
            continue
        step = r["decode_step"]
        r["vs_dense"] = {
            "bytes_accessed": step["bytes_accessed"] / dense["bytes_accessed"],
            "ideal_bytes": step["ideal_bytes_per_device"] / dense["ideal_bytes_per_device"],
            "estimated_speedup": step["estimated_tokens_per_s"] / dense["estimated_tokens_per_s"],
            "hbm_bytes": step["hbm_bytes"] / dense["hbm_bytes"],
            "hbm_estimated_speedup": step["hbm_estimated_tokens_per_s"] / dense["hbm_estimated_tokens_per_s"],
            "ideal_speedup": step["ideal_tokens_per_s"] / dense["ideal_tokens_per_s"],
            "xla_estimated_speedup": (step["xla_estimated_tokens_per_s"] / dense["xla_estimated_tokens_per_s"]
                                      if step["xla_estimated_tokens_per_s"] and dense["xla_estimated_tokens_per_s"] else None),
        }


def check_fit(report: dict[str, Any]) -> None:
    """ValueError naming the first program whose per-device peak exceeds the chip's HBM."""
    hbm = report["topology"]["hbm_per_device"]
    for r in report["records"]:
        if "error" in r:
            raise ValueError(f"{r['method']}: does not fit a {report['topology']['chip']} device (topology "
                             f"{report['topology']['name']}, mesh {report['mesh']['data']}x{report['mesh']['model']}): "
                             f"XLA:TPU: {r['error']}")
        if r["held"] > hbm:
            raise ValueError(f"{r['method']}: its weights, KV cache, state and method data need {r['held'] / 2**30:.2f} GiB "
                             f"per device, more than the {hbm / 2**30:.2f} GiB of HBM a {report['topology']['chip']} device has "
                             f"(topology {report['topology']['name']}, mesh {report['mesh']['data']}x{report['mesh']['model']})")
        for name, p in r["programs"].items():
            if not p["fits"]:
                raise ValueError(f"{r['method']}: {name} needs {p['peak'] / 2**30:.2f} GiB per device, more than the "
                                 f"{hbm / 2**30:.2f} GiB of HBM a {report['topology']['chip']} device has "
                                 f"(topology {report['topology']['name']}, mesh {report['mesh']['data']}x{report['mesh']['model']})")


def write_report(report: dict[str, Any], path: str | Path) -> None:
    """The report as JSON (atomically)."""
    write_json_atomic(Path(path), report)
