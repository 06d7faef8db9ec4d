"""Multi-host (popjax.distributed): two CPU processes × 4 fake devices joined by
``jax.distributed`` (gloo collectives) into one (2, 4) mesh give a single process's teacher-forced
NLL through prefill and decode for dense, POP (per shard and global), prefill-only + POP and the
calibrated TEAL, its greedy tokens (dense, POP per shard) and its prefill
logits (dense); an HF checkpoint converted once (by process 0, into the cache both
read) is loaded by both; an eval run writes exactly one JSON; the popjax cache lets two
processes fill one key; bad multi-host input is one ``popjax: error:`` line.

ONE launch for the whole file (module fixture): the two joined processes and a third, single
process (the reference run and the bad-input CLI calls) run `worker` below at once; each writes
its findings as JSON for the tests. By hand (PORT free, STORE from `write_store`):
``python tests/scale/test_multihost.py OUT 0 PORT STORE & python tests/scale/test_multihost.py OUT 1 PORT STORE``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the worker runs this file as a script
from eight_devices import random_tree, tiny_config  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.slow]  # slow: starts three JAX processes

PROMPTS = [[5, 17, 3, 99, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15]]
NEW_TOKENS = 4
LOGIT_ATOL = 1e-5  # rounding only (cross-process sums run in another order; measured ~2e-6)
LOCAL_DEVICES = 4
TEXT = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(40))


def methods():
    import popjax

    return {
        "dense": popjax.Dense(),
        "pop-per_shard": popjax.POP(0.3, partition="per_shard", shards=4),
        "pop-global": popjax.POP(0.3),
        "prefill-only+pop": popjax.PrefillOnly() + popjax.POP(0.3),
        # calibrated on CORPUS through the popjax cache (the joined pair share one): the
        # collection is one program over both processes, so both run it, then both store it
        "teal": popjax.TEAL(0.3),
    }
# Every other method's split on a (2, 4) mesh is tests/scale/eight_devices.py's, in one process:
# what two processes add (cross-process collectives, one calibration through a shared cache)
# these cover.


CALIBRATED = ("teal",)


def save_byte_tokenizer(target: Path) -> bool:
    """A byte-level tokenizer over the tiny model's 256 ids (the eval command tokenizes text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(target))
    return True


def write_store(directory: Path) -> Path:
    """The tiny random model as an HF checkpoint (config.json, model.safetensors in HF names,
    its byte tokenizer): every process's `popjax.load` converts it through the popjax cache."""
    from safetensors.numpy import save_file

    cfg = tiny_config(num_hidden_layers=1)  # one layer: half the code to compile, every method still prunes it
    tree = random_tree(cfg)
    tensors = {"model.embed_tokens.weight": tree["embed"], "model.norm.weight": tree["final_norm"]["weight"],
               "lm_head.weight": tree["lm_head"]}
    for i, layer in tree["layers"].items():
        prefix = f"model.layers.{i}"
        tensors[f"{prefix}.input_layernorm.weight"] = layer["attn_norm"]["weight"]
        tensors[f"{prefix}.post_attention_layernorm.weight"] = layer["mlp_norm"]["weight"]
        tensors.update({f"{prefix}.self_attn.{n}_proj.weight": layer["attn"][n] for n in "qkvo"})
        tensors.update({f"{prefix}.mlp.{n}_proj.weight": layer["mlp"][n] for n in ("gate", "up", "down")})
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({**cfg.to_hf_dict(), "architectures": ["LlamaForCausalLM"]}))
    save_byte_tokenizer(directory)
    return directory


GENERATED = ("dense", "pop-per_shard")  # the greedy loop's programs (start, decode_loop) for these two


def run_methods(model) -> dict:
    """Every method's NLL of fixed targets fed through its decode path after the prompts'
    prefill (one program: the prefill's logits score the first target, each decode step the
    next), the greedy tokens of `GENERATED` and the dense prefill logits of `popjax.forward`
    -> {name: {"nll", and "ids", "logits" where run}}."""
    import popjax
    from popjax.calibration import Corpus
    from popjax.eval.teacher import teacher_forced
    from popjax.requests import pad_batch

    vocab = model.config.vocab_size
    targets = np.random.default_rng(2).integers(0, vocab, (len(PROMPTS), NEW_TOKENS)).astype(np.int32)
    corpus = Corpus("random", np.random.default_rng(6).integers(0, vocab, (4, 32)))
    out = {}
    for name, method in methods().items():
        method = method.calibrate(model, corpus) if name in CALIBRATED else method.prepare(model)
        nll, _ = teacher_forced(model, method, PROMPTS, targets)
        out[name] = {"nll": np.asarray(nll).tolist()}
        if name in GENERATED:
            out[name]["ids"] = popjax.generate_ids(model, PROMPTS, NEW_TOKENS, method=method, ignore_eos=True)[0]
    tokens, mask = pad_batch(PROMPTS, 0, length=16, min_rows=2)
    logits = np.asarray(popjax.forward(model, tokens, mask))  # np.asarray: replicated on a multi-host mesh
    out["dense"]["logits"] = logits[:, -4:].tolist()  # the last positions of both rows
    return out


def cli(argv: list[str]) -> tuple[int, list[str]]:
    """popjax.cli.main(argv) -> (exit code, its stderr lines)."""
    from popjax.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, [line for line in err.getvalue().splitlines() if line.strip()]


def joined_worker(out: Path, pid: int, port: int, store: Path) -> dict:
    """One of the two joined processes: the methods on the (2, 4) mesh, the eval command, the
    shared cache key and a mesh that does not cover the 8 devices."""
    import jax

    import popjax
    from popjax import distributed, sharding
    from popjax.cache import get_or_make
    from popjax.cli import common

    start = time.monotonic()
    coordinator = f"localhost:{port}"
    distributed.initialize(coordinator, 2, pid, timeout_s=60)
    found = {"process_index": jax.process_index(), "process_count": jax.process_count(), "devices": jax.device_count()}
    # an HF checkpoint: process 0 converts it into the shared popjax cache, process 1 waits and reads it
    notices = []
    handler = logging.Handler()
    handler.emit = lambda record: notices.append(record.getMessage())
    logging.getLogger("popjax.loading").addHandler(handler)
    model = popjax.load(store, mesh=sharding.make_mesh((2, 4)))
    logging.getLogger("popjax.loading").removeHandler(handler)
    found["converted_here"] = any(n.startswith("converting") for n in notices)
    found["converted_entries"] = [str(p) for p in (Path(os.environ["POPJAX_CACHE"]) / "converted").iterdir()
                                  if not p.name.startswith(".")]
    params = jax.tree_util.tree_leaves(model.params)
    found["local_param_bytes"] = sum(s.data.nbytes for p in params for s in p.addressable_shards)
    found["global_param_bytes"] = sum(p.nbytes for p in params)
    found["methods"] = run_methods(model)
    found["methods_seconds"] = time.monotonic() - start
    made = []
    shared = get_or_make("multihost-test", {"key": 1}, lambda d: (made.append(pid), time.sleep(0.5), (d / "who").write_text(str(pid))),
                         root=out / "shared-cache")
    found["cache"] = {"made": bool(made), "path": str(shared), "who": (shared / "who").read_text()}
    flags = ["--coordinator", coordinator, "--num-processes", "2", "--process-id", str(pid)]
    found["bad_mesh"] = cli(["generate", "hi", "--model", str(store), "--mesh", "3x3", *flags])
    writes = []
    real_write = common.write_json_atomic
    common.write_json_atomic = lambda path, payload: (writes.append(str(path)), real_write(path, payload))
    text = out / "text.txt"
    text.write_text(TEXT)
    found["eval"] = cli(["eval", "--model", str(store), "--methods", "dense,pop", "--ratios", "0.3", "--tasks", "nll",
                         "--text-file", str(text), "--nll-prompt-tokens", "16", "--nll-decode-tokens", "8", "--nll-windows", "2",
                         "--batch-size", "2", "--json", str(out / "eval.json"), "--mesh", "2x4", *flags])
    found["eval_json_writes"] = writes
    found["eval_seconds"] = time.monotonic() - start - found["methods_seconds"]
    distributed.barrier("worker-done", 120)  # process 0 serves the coordinator: it leaves last
    return found


def reference_worker(out: Path, port: int, store: Path) -> dict:
    """The single process: the methods on one device, and the bad input that fails before
    (or instead of) joining: an unreachable coordinator, a process id out of range."""
    import popjax

    start = time.monotonic()
    os.environ["POPJAX_CACHE"] = str(out / "reference-cache")  # its own conversion, apart from the joined pair's
    found = {"methods": run_methods(popjax.load(store))}
    found["methods_seconds"] = time.monotonic() - start
    found["unreachable"] = cli(["generate", "hi", "--model", str(store), "--coordinator", f"localhost:{port}",
                                "--num-processes", "2", "--process-id", "1", "--init-timeout", "1"])
    found["process_id_out_of_range"] = cli(["generate", "hi", "--model", str(store), "--coordinator", "localhost:1",
                                            "--num-processes", "2", "--process-id", "2"])
    return found


def worker(out: str, role: str, port: str, store: str) -> None:
    """Runs in a subprocess; writes ``OUT/<role>.json`` (a traceback there if it failed)."""
    out_dir = Path(out)
    start = time.monotonic()
    try:
        if role == "reference":
            found = reference_worker(out_dir, int(port), Path(store))
        else:
            found = joined_worker(out_dir, int(role), int(port), Path(store))
        found["seconds"] = time.monotonic() - start
    except BaseException:
        found = {"error": traceback.format_exc()}
    (out_dir / f"{role}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    worker(*sys.argv[1:5])


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: the sockets are held open together, so the OS cannot hand out
    one port twice (two ``bind(0)`` calls in a row may; the reference process would then reach
    the joined pair's coordinator)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The two joined processes and the reference process, launched once at the same time."""
    out = tmp_path_factory.mktemp("multihost")
    store = write_store(out / "store")
    port, unused_port = free_ports(2)
    from tests.conftest import fake_devices_env

    env = fake_devices_env(LOCAL_DEVICES, POPJAX_CACHE=str(out / "cache"))
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    roles = {"0": port, "1": port, "reference": unused_port}  # the reference's coordinator is never served
    procs = {role: subprocess.Popen([sys.executable, __file__, str(out), role, str(p), str(store)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for role, p in roles.items()}
    logs = {}
    deadline = time.monotonic() + 240
    for role, proc in procs.items():
        try:
            logs[role] = proc.communicate(timeout=max(1, deadline - time.monotonic()))[0]
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            tails = {r: (p.communicate()[0] or "")[-1500:] for r, p in procs.items() if r not in logs}
            pytest.fail(f"process {role} did not finish in 240 s; what the unfinished processes printed: {tails}")
    found = {}
    for role in roles:
        path = out / f"{role}.json"
        assert path.is_file(), f"process {role} wrote nothing:\n{logs[role][-4000:]}"
        found[role] = json.loads(path.read_text())
        assert "error" not in found[role], found[role]["error"]
    found["out"] = out
    return found


def test_two_processes_form_one_mesh_and_hold_only_their_blocks(runs):
    """Both processes see 8 devices; each holds its own devices' blocks of the weights, not all."""
    for pid in ("0", "1"):
        found = runs[pid]
        assert (found["process_index"], found["process_count"], found["devices"]) == (int(pid), 2, 8)
        # (2, 4) mesh: a process holds one data row = 4 model blocks, i.e. one copy of the weights
        # split 4 ways, never the 8 device copies of a replicated placement
        assert found["local_param_bytes"] <= found["global_param_bytes"] * 1.01, found


@pytest.mark.parametrize("name", ["dense", "pop-per_shard", "pop-global", "prefill-only+pop", *CALIBRATED])
def test_decode_path_equals_one_process(runs, name):
    """Teacher-forced NLL through prefill and decode within rounding, greedy tokens equal where
    generated, dense prefill logits within rounding; identical on both processes."""
    want = runs["reference"]["methods"][name]
    for pid in ("0", "1"):
        got = runs[pid]["methods"][name]
        assert set(got) == set(want) == ({"nll", "ids", "logits"} if name == "dense" else {"nll", "ids"} if name in GENERATED else {"nll"})
        assert got.get("ids") == want.get("ids"), (name, pid)
        for key in ("nll", "logits"):
            if key in want:
                delta = float(np.abs(np.asarray(got[key]) - np.asarray(want[key])).max())
                print(f"{name} process {pid}: max |Δ{key}| {delta:.2e}")
                assert delta <= LOGIT_ATOL, (name, key, pid, delta)
    assert runs["0"]["methods"][name] == runs["1"]["methods"][name]  # identical on both processes


def test_one_conversion_loaded_by_both(runs):
    """The HF checkpoint is converted once (process 0; process 1 waits at the barrier) into the
    cache both read: one entry, seen by both processes."""
    entries = [runs[pid]["converted_entries"] for pid in ("0", "1")]
    assert len(entries[0]) == 1 and entries[0] == entries[1], entries
    assert (runs["0"]["converted_here"], runs["1"]["converted_here"]) == (True, False)
    assert (Path(entries[0][0]) / "entry.json").is_file()


def test_the_cache_lets_two_processes_fill_one_key(runs):
    """popjax.cache (temp dir + rename, flock): one process makes the entry, the other reads it."""
    made = [runs[pid]["cache"]["made"] for pid in ("0", "1")]
    assert sorted(made) == [False, True], made
    assert runs["0"]["cache"]["path"] == runs["1"]["cache"]["path"]
    assert runs["0"]["cache"]["who"] == runs["1"]["cache"]["who"]


def test_eval_writes_exactly_one_json(runs):
    """Both processes evaluate; process 0 alone writes the JSON."""
    for pid in ("0", "1"):
        assert runs[pid]["eval"][0] == 0, runs[pid]["eval"]
    assert len(runs["0"]["eval_json_writes"]) == 1 and runs["1"]["eval_json_writes"] == []
    records = json.loads((runs["out"] / "eval.json").read_text())["records"]
    assert {r["method"] for r in records} == {"dense", "pop"} and all(np.isfinite(r["nll"]) for r in records)
    assert not [p.name for p in runs["out"].iterdir() if p.name.startswith(".eval.json")]  # no temp file left


def test_bad_input_is_one_clear_line(runs):
    """An unreachable coordinator, a process id out of range and a mesh that does not cover the
    8 devices: exit code 2 and one ``popjax: error:`` line naming the value, on every process."""
    cases = {
        "unreachable": (runs["reference"]["unreachable"], "is not reachable after 1 s"),
        "process_id": (runs["reference"]["process_id_out_of_range"], "--process-id 2 is out of range"),
        "mesh 0": (runs["0"]["bad_mesh"], "mesh 3x3 does not cover the 8 devices of 2 processes"),
        "mesh 1": (runs["1"]["bad_mesh"], "mesh 3x3 does not cover the 8 devices of 2 processes"),
    }
    for case, ((code, lines), text) in cases.items():
        assert code == 2, (case, code, lines)
        errors = [line for line in lines if line.startswith("popjax: error:")]
        assert len(errors) == 1 and text in errors[0], (case, lines)
