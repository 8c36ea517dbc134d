"""Every script of ``benchmarks/`` end to end at a tiny size, as its command line runs it: one timed round and no
warm-up, every contestant installed here, the benchmark's own agreement check included (a disagreement stops it
with exit status 1), then the printed table and the JSON read back.

A run is the script's default invocation made small: its arguments say only sizes (model shape, batch, sequence,
ranks, steps, rounds) and where to write, never a mode, a peer, a selection or a skip, so the code that runs is the
code a plain ``python benchmarks/SCRIPT.py`` runs. Two exceptions, each worth more time than the whole module takes:
``kernels.py --no-compile`` (Inductor compiling the six kernels on a CPU is about 50 s) and ``memory_layouts.py
--only "one process"`` (each of its 27 layouts is a ``trickles memory --measure`` run of its own, 5-10 s).

Peers that are not installed (DeepSpeed, torchao, liger-kernel; accelerate where it is missing) are reported absent
by the benchmark, which goes on with the other contestants: the tests check that line and the rest. PyTorch's
``context_parallel`` has no sharding rule for SDPA's CPU kernel, so ``context_parallel.py`` reports it as not run here.
``gpu_check.py`` has its own file (``test_gpu_check.py``).

The runs are processes as ``python SCRIPT ARGS`` starts them, forked by :class:`trickles.testing.Command` (without the
seconds of importing torch), started two at a time in the order of the tests (the machine's two cores); each test
waits for its own run. Multi-rank scripts run ``--world 2`` (``tensor_parallel_nd.py`` its default 4: the grids need
4 ranks); no GPU is visible to them (``--device auto`` is the CPU).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import pytest

from trickles.testing import Command

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
AT_ONCE = 2  # runs at the same time
TIMEOUT = 240  # seconds one run may take (on a machine shared with other work)
ONE_ROUND = ["--steps", "1", "--warmup", "0"]
TINY_MODEL = ["--preset", "tiny", "--vocab", "256", "--seq", "32", *ONE_ROUND]
TINY_TRAINING = [
    "--set",
    "model.preset=tiny",
    "--set",
    "data.max_bytes=120000",
    "--set",
    "data.cache_dir={tmp}/{script}-cache",
]

#: test name -> (script, arguments), in the order the tests run; ``{tmp}`` is this module's scratch folder, ``{script}``
#: the script's name (two runs at a time must not share a corpus cache). Multi-rank and one-process runs alternate,
#: the longest first, so that the two runs at a time share the cores evenly.
RUNS = {
    "test_planner_time": (
        "planner_time",
        [
            "--worlds",
            "2",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--repeat",
            "1",
            "--calib-repeats",
            "1",
            "--calib-sample",
            "0.001",
            "--set",
            "model.n_layers=4",
            "--set",
            "model.d_model=64",
            "--set",
            "model.n_heads=4",
            "--set",
            "model.n_kv_heads=2",
            "--set",
            "model.vocab_size=512",
            "--set",
            "data.seq_len=32",
            "--set",
            "train.global_batch=4",
            "--json",
            "{tmp}/planner_time.json",
        ],
    ),
    "test_single_device": ("single_device", [*TINY_MODEL, "--batch", "2", "--json", "{tmp}/single_device.json"]),
    "test_moe": (
        "moe",
        [
            "--world",
            "2",
            "--batch",
            "1",
            "--seq",
            "32",
            "--d-model",
            "32",
            "--ffn",
            "64",
            "--experts",
            "4",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            *ONE_ROUND,
            "--json",
            "{tmp}/moe.json",
        ],
    ),
    "test_decoding": (
        "decoding",
        [
            "--preset",
            "tiny",
            "--vocab",
            "256",
            "--batch",
            "2",
            "--new",
            "4",
            "--rounds",
            "1",
            "--json",
            "{tmp}/decoding.json",
        ],
    ),
    "test_data_parallel": (
        "data_parallel",
        ["--world", "2", *TINY_MODEL, "--batch", "2", "--json", "{tmp}/data_parallel.json"],
    ),
    "test_inference": (
        "inference",
        [
            "--layers",
            "8",
            "--d-model",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "4",
            "--ffn",
            "128",
            "--vocab",
            "256",
            "--prompt-len",
            "8",
            "--new-tokens",
            "4",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--json",
            "{tmp}/inference.json",
        ],
    ),
    "test_tensor_parallel": (
        "tensor_parallel",
        ["--world", "2", *TINY_MODEL, "--batch", "2", "--json", "{tmp}/tensor_parallel.json"],
    ),
    "test_kernels": (
        "kernels",
        ["--shape", "tiny", "--rounds", "1", "--warmup", "0", "--no-compile", "--json", "{tmp}/kernels.json"],
    ),
    "test_context_parallel": (
        "context_parallel",
        [
            "--world",
            "2",
            "--seq",
            "64",
            "--heads",
            "2",
            "--head-dim",
            "16",
            *ONE_ROUND,
            "--json",
            "{tmp}/context_parallel.json",
        ],
    ),
    "test_context_window": (
        "context_window",
        ["--world", "2", "--seq", "64", "--heads", "2", "--head-dim", "16", *ONE_ROUND, "--json", "{tmp}/cw.json"],
    ),
    "test_memory_layouts": ("memory_layouts", ["--only", "one process", "--json", "{tmp}/memory_layouts.json"]),
    "test_pipeline_parallel": (
        "pipeline_parallel",
        [
            "--world",
            "2",
            *TINY_MODEL,
            "--batch",
            "2",
            "--micro-batch",
            "1",
            "--trace-steps",
            "1",
            "--json",
            "{tmp}/pipeline_parallel.json",
        ],
    ),
    "test_large_batch": (
        "large_batch",
        [
            "--sequences",
            "8",
            "--batch",
            "2",
            "--scale",
            "2",
            "--eval-sequences",
            "4",
            "--held-out",
            "2",
            *TINY_TRAINING,
            "--set",
            "data.seq_len=32",
            "--out",
            "{tmp}/large_batch",
        ],
    ),
    "test_tensor_parallel_nd": (
        "tensor_parallel_nd",
        [*TINY_MODEL, "--batch", "2", "--json", "{tmp}/tensor_parallel_nd.json"],  # its default 4 ranks: 1-D and 2-D
    ),
    "test_quantization": (
        "quantization",
        [
            "--train-steps",
            "2",
            "--seq-len",
            "32",
            *TINY_TRAINING,
            "--set",
            "train.warmup_steps=1",
            "--set",
            "train.global_batch=4",
            "--eval-batches",
            "1",
            "--new-tokens",
            "4",
            "--prompt-tokens",
            "8",
            "--rounds",
            "1",
            "--out",
            "{tmp}/quantization",
        ],
    ),
    "test_projections": ("projections", ["--preset", "tiny", "--tokens", "32", "--rounds", "1", "--warmup", "0"]),
    "test_documents": (
        "documents",
        [
            "--preset",
            "tiny",
            "--seq",
            "32",
            "--documents",
            "4",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--json",
            "{tmp}/documents.json",
        ],
    ),
    "test_serving": (
        "serving",
        [
            "--preset",
            "tiny",
            "--requests",
            "6",
            "--concurrency",
            "3",
            "--prompt-lens",
            "8,20",
            "--output-lens",
            "4,12,2",
            "--max-batch",
            "4",
            "--block-size",
            "4",
            "--json",
            "{tmp}/serving.json",
        ],
    ),
    "test_speculative": (
        "speculative",
        [
            *("--layers", "1", "--d-model", "32", "--draft-layers", "1", "--seq", "64", "--train-steps", "2"),
            *("--train-batch", "2", "--requests", "3", "--max-tokens", "8", "--max-batch", "2", "--block-size", "4"),
            *("--rounds", "1", "--json", "{tmp}/speculative.json"),
        ],
    ),
    "test_mla_decoding": (
        "mla_decoding",
        [
            *("--layers", "1", "--d-model", "64", "--heads", "2", "--q-rank", "24", "--kv-rank", "16", "--nope", "8"),
            *("--rope", "8", "--v-dim", "8", "--vocab", "256", "--context", "16", "--batch", "1", "--new", "3"),
            *("--rounds", "1", "--json", "{tmp}/mla_decoding.json"),
        ],
    ),
    "test_prefix_cache": (
        "prefix_cache",
        [
            *("--preset", "tiny", "--prompt-len", "40", "--prompts", "1", "--max-tokens", "2", "--block-size", "4"),
            *("--prefill-chunk", "16", "--json", "{tmp}/prefix_cache.json"),
        ],
    ),
    "test_checkpoint_stall": (
        "checkpoint_stall",
        [
            "--layers",
            "2",
            "--d-model",
            "64",
            "--rounds",
            "1",
            "--steps-between",
            "1",
            "--json",
            "{tmp}/checkpoint_stall.json",
        ],
    ),
}


class Runs:
    """The benchmark runs of the selected tests, at most :data:`AT_ONCE` at a time, started in the tests' order;
    each one's output goes to a file (no pipe to fill)."""

    def __init__(self, names: list[str], tmp: Path):
        self.tmp, self.waiting, self.running, self.done = tmp, list(names), {}, {}
        self.env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            CUDA_VISIBLE_DEVICES="",  # --device auto means the CPU here, whatever the machine has
            TRITON_INTERPRET="1",  # and the Triton kernels run in Triton's interpreter, as in the rest of the suite
        )
        self._fill()

    def _start(self, name: str) -> None:
        script, args = RUNS[name]
        cmd = [sys.executable, str(BENCH / f"{script}.py"), *(a.format(tmp=self.tmp, script=script) for a in args)]
        run = Command(cmd, cwd=ROOT, env=self.env, stderr=False)  # its own process group: its ranks end with it
        self.running[name] = (run, time.monotonic(), " ".join(cmd))

    def _fill(self) -> None:
        while self.waiting and len(self.running) < AT_ONCE:
            self._start(self.waiting.pop(0))

    def _reap(self) -> None:
        for name, (run, start, cmd) in list(self.running.items()):
            overdue = time.monotonic() - start > TIMEOUT
            if run.returncode is None and not overdue:
                continue
            if run.returncode is None:
                run.kill()
            self.done[name] = (run.returncode, run.output(), time.monotonic() - start, cmd, overdue)
            run.close()
            del self.running[name]
        self._fill()

    def result(self, name: str) -> str:
        """The run's output once it has ended with status 0 (else the test fails with its output's tail)."""
        if name not in self.done and name not in self.running and name in self.waiting:
            self.waiting.remove(name)
            self.waiting.insert(0, name)
        while name not in self.done:
            self._reap()
            time.sleep(0.05)
        status, output, seconds, cmd, overdue = self.done[name]
        assert not overdue, f"{cmd}: still running after {TIMEOUT} s\n{output[-4000:]}"
        assert status == 0, f"{cmd}: exit status {status} after {seconds:.0f} s\n{output[-6000:]}"
        assert "Traceback" not in output, output[-6000:]
        return output

    def close(self) -> None:
        for run, _, _ in self.running.values():
            run.kill()
            run.close()


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    selected = {item.name for item in request.session.items if item.module is sys.modules[__name__]}
    pool = Runs([n for n in RUNS if n in selected], tmp_path_factory.mktemp("benchmarks"))
    yield pool
    pool.close()


@pytest.fixture
def run(runs, request):
    """This test's benchmark: ``(printed output, scratch folder)``."""
    return runs.result(request.node.name), runs.tmp


def _json(path: Path):
    return json.loads(path.read_text())


def _finite(*xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in xs)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _timed(results: dict, names, peers: dict[str, str | None]) -> None:
    """Every contestant timed once, and each of ours against its peer by a finite ratio of medians and paired ratio."""
    assert list(results) == list(names)
    for n in names:
        r = results[n]
        assert r["n"] == 1 and _finite(r["median"]), (n, r)
        assert r["peer"] == peers.get(n), (n, r["peer"])
        if r["peer"]:
            assert _finite(r["ratio"], r["paired_ratio"]), (n, r)
            assert r["ratio"] == pytest.approx(r["median"] / results[r["peer"]]["median"])


def _losses_agree(check: dict, names, ref: list[float], tol: float = 1e-4) -> None:
    """Every rank's two losses of each contestant within ``tol`` of the single-device ones."""
    for n in names:
        for rank_losses in check[n]:
            assert rank_losses == pytest.approx(ref, rel=tol), (n, rank_losses, ref)


# ---- the benchmarks, in the order their runs start ---------------------------------------------


PLANNER_LAYOUTS_2 = [
    "dp",
    "dp zero1",
    "dp zero2 m2",
    "dp zero3",
    "dp recompute full",
    "dp recompute sel",
    "tp",
    "tp+sp",
    "pp gpipe",
    "pp 1f1b",
    "pp interleaved",
    "cp ring",
    "cp ulysses",
    "moe ep",
]


def test_planner_time(run):
    """The step-time model against measured steps of every layout of two ranks and the planner's own top choice
    (calibrated in the same ranks), at a small model."""
    out, tmp = run
    doc = _json(tmp / "planner_time.json")
    names = [r["name"] for r in doc["layouts"]]
    assert names[:14] == PLANNER_LAYOUTS_2 and len(names) in (14, 15)
    assert doc["plan"]["2"]["name"] in names  # the planner's choice was timed beside them
    for r in doc["layouts"]:
        assert _finite(r["measured_s"], r["predicted_s"], r["paired_ratio"]), r
    assert -1 <= doc["spearman"] <= 1
    assert "the planner's top choice" in out and "Spearman rho" in out


def test_single_device(run):
    """Our training step against ``transformers``' Llama, the logits and both losses checked first."""
    out, tmp = run
    doc = _json(tmp / "single_device.json")
    assert doc["check"]["ok"] and doc["check"]["logits_fp32_rel_diff"] <= doc["check"]["logits_tolerance"]
    assert list(doc["results"]) == ["trickles", "hf-llama"]
    assert _finite(doc["ratio_ours_hf"], doc["results"]["trickles"]["paired_ratio"])
    assert "ours/HF median step time:" in out


def test_moe(run):
    """One device: our layer and block against transformers' Mixtral (both experts implementations); two ranks: our
    expert parallelism against our layer holding every expert, DeepSpeed-MoE where installed."""
    out, tmp = run
    doc = _json(tmp / "moe.json")
    single = doc["single"]
    assert [c[-1] for c in single["checks"]] == ["ok"] * 4
    hf = ["hf moe (grouped_mm)", "hf moe (eager)", "hf block (grouped_mm)", "hf block (eager)"]
    assert sorted(single["results"]) == sorted(["ours moe layer", "ours block", *hf])
    for n in ("ours moe layer", "ours block"):
        r = single["results"][n]
        assert r["peer"] in hf and _finite(r["ratio"], r["paired_ratio"], *(v["ratio"] for v in r["vs"].values()))
    ep = doc["ep"]
    names = ["ours ep", "ours, all experts (no ep)"] + (["deepspeed-moe ep"] if _installed("deepspeed") else [])
    assert list(ep["results"]) == names
    assert all(max(ep["errors"][n]) <= 1e-5 for n in names)
    sent = [r["sent"] for r in ep["results"]["ours ep"]["sent"]]
    assert sent == pytest.approx(ep["results"]["ours ep"]["formula"])  # the all-to-alls' bytes are the formula's
    assert "target ours/peer <= 1.0x:  layer ours moe layer/" in out


def test_decoding(run):
    """Batched greedy and beam decoding against ``transformers``' ``generate``, the tokens checked first."""
    out, tmp = run
    doc = _json(tmp / "decoding.json")
    assert {k: set(v) <= {"equal", "tie"} and len(v) == 2 for k, v in doc["agreement"].items()} == {
        "greedy": True,
        "beams": True,
    }
    assert list(doc["times"]) == ["greedy ours", "greedy HF", "beams ours", "beams HF", "one by one ours"]
    assert set(doc["ours_over_hf"]) == {"greedy ours", "beams ours"} and _finite(*doc["ours_over_hf"].values())


def test_data_parallel(run):
    """ZeRO 0-3 against DDP and FSDP2; DeepSpeed where it is installed (``--offload``'s rows are left out: time)."""
    out, tmp = run
    doc = _json(tmp / "data_parallel.json")
    ours = [f"ours zero-{s}" for s in range(4)]
    deepspeed = [f"deepspeed zero-{s}" for s in (1, 2, 3)] if _installed("deepspeed") else []
    peers = {n: "fsdp2" if n == "ours zero-3" else "ddp" for n in ours}
    _timed(doc["results"], ["ddp", "fsdp2", *ours, *deepspeed], peers)
    for rank, ddp in enumerate(doc["check"]["ddp"]):  # each rank's loss is its rows' (the mean over ranks: the batch's)
        assert all(doc["check"][n][rank] == pytest.approx(ddp, rel=1e-4) for n in ["fsdp2", *ours, *deepspeed])
    assert doc["results"]["ours zero-3"]["memory_ratio"] == pytest.approx(1.0, abs=0.05)  # sharded like FSDP2
    if not deepspeed:
        assert "DeepSpeed ZeRO: unavailable (ModuleNotFoundError" in out


def test_inference(run):
    """Our resident model against ``transformers``' ``generate``; our layer streaming against accelerate's
    offloading where accelerate is installed; the streamed tokens checked equal to the resident ones first."""
    out, tmp = run
    doc = _json(tmp / "inference.json")
    names = ["ours resident", "HF generate", "ours streamed"] + (
        ["accelerate offload"] if _installed("accelerate") else []
    )
    assert list(doc["results"]) == names
    assert all(_finite(r["tokens_per_s"]) for r in doc["results"].values())
    assert "agreement: ours streamed == ours resident" in out
    assert ("(b) ours streamed tokens/s" in out) == _installed("accelerate")


def test_tensor_parallel(run):
    """``tensor_parallel.py --world 2``: ours (tp, tp+sp) against DTensor's, the DTensor peer's step included."""
    out, tmp = run
    doc = _json(tmp / "tensor_parallel.json")
    names = ["ours tp", "ours tp+sp", "dtensor tp", "dtensor tp+sp"]
    _timed(doc["results"], names, {"ours tp": "dtensor tp", "ours tp+sp": "dtensor tp+sp"})
    ref = doc["check"]["single device"][0]
    _losses_agree(doc["check"], names, ref)
    for n in ("ours tp", "ours tp+sp"):  # the ledger's bytes are the formula's
        assert doc["comm"][n]["sent"] == pytest.approx(doc["comm"][n]["expected"])
    assert doc["comm"]["dtensor tp"]["counts"]["all_reduce"] > 0  # the peer's collectives, counted
    assert "MISMATCH" not in out and "target ours/peer <= 1.0x:  ours tp/dtensor tp" in out


def test_kernels(run):
    """Each kernel: eager, ours in Triton's interpreter (and the chunked cross-entropy), outputs and gradients
    checked first; liger-kernel and torch.compile are left to a GPU run (``gpu_check.py``)."""
    out, tmp = run
    doc = _json(tmp / "kernels.json")
    assert doc["triton_interpreter"] is True
    for kernel, r in doc["results"].items():
        want = ["eager", *(["ours-chunked"] if kernel == "cross_entropy" else []), "ours-triton"]
        assert list(r["contestants"]) == want, kernel
        assert all(
            c["max_rel_err"] <= doc["tolerance"] and _finite(c["ratio_eager"]) for c in r["contestants"].values()
        )
    assert list(doc["results"]) == ["rms_norm", "layer_norm", "rotary", "swiglu", "gelu_tanh", "cross_entropy"]
    assert "liger: skipped" in out or _installed("liger_kernel")


def test_context_parallel(run):
    """Ring and all-to-all attention against SDPA on the whole sequence; DeepSpeed-Ulysses where installed; the ring
    with packed documents' masks against SDPA with the same mask, timed against the ring without."""
    out, tmp = run
    doc = _json(tmp / "context_parallel.json")
    ds = ["deepspeed ulysses"] if _installed("deepspeed") else []
    torch_cp = ["torch cp (ring)"] if doc["peers"]["torch cp (ring)"] == "ran" else []
    names = ["sdpa, 1 process", "ours ring", "ours ulysses", "ours ring, documents", *ds, *torch_cp]
    assert sorted(doc["results"]) == sorted(names)
    assert all(max(doc["errors"][n]) <= doc["tol"] for n in names)
    assert doc["results"]["ours ring, documents"]["peer"] == "ours ring"
    assert re.search(r"^documents: ours ring, documents/ours ring [0-9.]+x \(paired [0-9.]+x\), 8 documents", out, re.M)
    for n in ("ours ring", "ours ulysses", "ours ring, documents"):  # bytes sent are the formula's
        assert doc["memory"][n]["sent"] == pytest.approx(doc["expected_sent"][n]) and doc["memory"][n]["sent"] > 0
        assert _finite(doc["results"][n]["median"], doc["memory"][n]["saved"])
    if not ds:
        assert doc["peers"]["deepspeed ulysses"].startswith("did not run: import failed")


def test_context_window(run):
    """The windowed ring and the fully causal ring agree with SDPA on the whole sequence; the windowed one computes
    fewer scores and sends 3/8 of the bytes (cp=2, a window of one chunk: only the chunk the other rank sees travels,
    and its gradient; ``trickles/parallel/ring_plan.py``, "What travels")."""
    out, tmp = run
    doc = _json(tmp / "cw.json")
    assert sorted(doc["results"]) == ["ring, causal", "ring, window"]
    assert all(max(e) <= doc["args"]["tol"] for e in doc["errors"].values())
    scores = {n: max(rank[0] for rank in doc["work"][n]) for n in doc["results"]}  # the busiest rank's, per forward
    assert scores["ring, window"] < scores["ring, causal"]
    assert [8 * b for b in doc["sent"]["ring, window"]] == [3 * b for b in doc["sent"]["ring, causal"]]  # per rank
    assert re.search(r"^target causal/window >= 1.5x:  [0-9.]+x", out, re.M)


def test_memory_layouts(run):
    """The memory model against ``trickles memory --measure``: one layout, held and peak within 5%."""
    out, tmp = run
    [row] = _json(tmp / "memory_layouts.json")
    assert row["name"] == "one process" and row["status"] == 0
    assert row["held"]["ratio"] == pytest.approx(1, abs=0.05) and row["peak"]["ratio"] == pytest.approx(1, abs=0.05)
    assert "1 of 1 layouts within 5%" in out


def test_pipeline_parallel(run):
    """GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-V against ``torch.distributed.pipelining``, the bubble traced
    next to its prediction from the traced stage times."""
    out, tmp = run
    doc = _json(tmp / "pipeline_parallel.json")
    schedules = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]
    names = [n for s in schedules for n in (f"ours {s}", f"torch {s}")]
    _timed(doc["results"], names, {f"ours {s}": f"torch {s}" for s in schedules})
    _losses_agree(doc["check"], names, doc["check"]["single device"])
    for s in schedules:
        r = doc["results"][f"ours {s}"]
        assert r["p2p_sent"] == r["p2p_expected"] > 0 and 0 <= r["bubble_measured"] < 1, (s, r)
        assert 0 <= r["bubble_predicted"] <= r["bubble_measured"] + 0.05, (s, r)  # messages only ever add idle time
        assert all(x["sent"] == x["expected"] == x["received"] for x in doc["comm"][s])  # every rank's, the formula's


def test_large_batch(run):
    """AdamW and LAMB at the base batch and at twice it (square-root learning rate), the same sequences seen."""
    out, tmp = run
    rows = _json(tmp / "large_batch" / "large_batch.json")
    assert [r["name"] for r in rows] == ["adamw-b2", "lamb-b2", "adamw-b4-sqrt", "lamb-b4-sqrt"]
    assert [r["steps"] for r in rows] == [4, 4, 2, 2]
    assert all(_finite(r["final_val"]) and r["curve"] for r in rows)
    assert "final held-out loss" in out


def test_tensor_parallel_nd(run):
    """1-D and the 2-D grid at tp=4 (its default) against one process, and the 64-device projection."""
    out, tmp = run
    doc = _json(tmp / "tensor_parallel_nd.json")
    names = ["1d", "2d (q=2)"]
    _timed(doc["results"], names, {"2d (q=2)": "1d"})
    _losses_agree(doc["check"], names, doc["check"]["reference"])
    assert doc["comm"]["1d"]["sent"] == pytest.approx(doc["comm"]["1d"]["formula"])  # 1-D: every byte accounted for
    grid = doc["comm"]["2d (q=2)"]  # the grid's linears by their formula, plus norms, embedding and loss
    assert grid["sent"] >= grid["formula"] > 0
    assert list(doc["projection"]["modes"]) == ["1d", "2d", "2.5d", "3d"]
    assert "projection: one GPT-3 175B layer" in out


def test_quantization(run):
    """A model trained here as fp32, bf16 and our int8 (per row weight-only and true int8, per matrix): decode speed
    and held-out loss; torchao's int8 where installed."""
    out, tmp = run
    doc = _json(tmp / "quantization" / "quantization.json")
    names = ["fp32", "bf16", "int8-weight", "int8-full", "int8-tensor"] + (
        ["torchao-int8"] if _installed("torchao") else []
    )
    assert list(doc["results"]) == names
    fp32 = doc["results"]["fp32"]["val_loss"]
    for n, r in doc["results"].items():
        assert _finite(r["tokens_per_s"], r["val_loss"]) and r["val_loss"] == pytest.approx(fp32, rel=0.01), n
    if "torchao-int8" not in names:
        assert "torchao is not installed" in out


def test_projections(run):
    """Fused q/k/v and gate/up projections against separate ones, outputs and gradients checked first."""
    out, _ = run
    agreement = float(re.search(r"agreement ([0-9.e+-]+)", out).group(1))
    ratio = float(re.search(r"fused/separate: ([0-9.]+)x", out).group(1))
    assert agreement <= 1e-5 and _finite(ratio)
    assert re.search(r"^  separate +[0-9.]+ ms$", out, re.M) and re.search(r"^  fused +[0-9.]+ ms$", out, re.M)


def test_documents(run):
    """Packed documents' masks against plain causal attention, a whole model's step; one document agrees first."""
    out, tmp = run
    doc = _json(tmp / "documents.json")
    assert doc["agreement"] <= 1e-5 and doc["documents"] == 4 and _finite(doc["ratio"], doc["paired_ratio"])
    assert [len(doc["times_s"][n]) for n in ("causal", "documents")] == [1, 1]
    assert re.search(r"^  documents/causal: [0-9.]+x \(paired [0-9.]+x\)$", out, re.M)


def test_checkpoint_stall(run):
    """Our asynchronous save, our synchronous one and DCP's async_save of the same state, each timed once, with the
    host copy alone beside them."""
    out, tmp = run
    doc = _json(tmp / "checkpoint_stall.json")
    assert [len(doc["blocked_s"][n]) for n in ("ours-async", "ours-sync", "dcp-async")] == [1, 1, 1]
    assert doc["bytes"] > 0 and _finite(doc["copy"], *doc["median"].values(), doc["verdict"]["sync_over_async"])
    assert re.search(r"^ours-async blocks [0-9.]+x the host copy; ours-sync blocks [0-9.]+x as long", out, re.M)


def test_serving(run):
    """Continuous batching (HTTP), the static batcher (HTTP), the engine and transformers' continuous batching under
    3 clients: every request answered, our texts agreeing, the ratios computed."""
    out, tmp = run
    doc = _json(tmp / "serving.json")
    assert set(doc["results"]) == {"continuous", "static", "engine", "transformers"}
    assert all(r["sent"] == r["answered"] == 6 and r["tokens"] > 0 for r in doc["results"].values())
    assert "agreement: our contestants give every request the same text" in out
    assert _finite(*doc["ratios"].values()) and len(doc["ratios"]) == 4


def test_speculative(run):
    """Plain decoding, ngram and a draft model on a tiny model trained in the run to recite: each ratio computed."""
    out, tmp = run
    doc = _json(tmp / "speculative.json")
    assert set(doc["medians"]) == {"plain", "ngram", "draft"} and _finite(*doc["ratios"].values())
    assert re.search(r"^ngram/plain tokens/s: [0-9.]+x", out, re.M)


def test_mla_decoding(run):
    """Our latent cache against transformers' DeepSeek-V3 decoding: tokens agreeing first, both ratios, the KV bytes."""
    out, tmp = run
    doc = _json(tmp / "mla_decoding.json")
    assert "differ" not in doc["agreement"] and doc["kv_bytes"]["multi-head"] > doc["kv_bytes"]["latent"]
    # (at this size the decoding steps alone, a whole run less a one-token run, are within noise of zero: a number)
    assert _finite(doc["tokens_per_s_ours_over_hf"]) and math.isfinite(doc["decoding_tokens_per_s_ours_over_hf"])
    assert "KV bytes a token per layer: latent" in out


def test_prefix_cache(run):
    """A repeated prompt's time to first token against its first sending, the cache on and off; the hits counted."""
    out, tmp = run
    doc = _json(tmp / "prefix_cache.json")
    assert set(doc["ratios"]) == {"cache on", "cache off"} and _finite(*doc["ratios"].values()) and doc["hits"] > 0
    assert "cache on: again/first" in out


def _script(name: str):
    """``benchmarks/NAME.py`` as a module, ``sys.path`` left as it was (a script puts its folder first)."""
    path = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    return module


def test_memory_layouts_prints_the_routing_row_under_its_own_layout(tmp_path, monkeypatch, capsys):
    """``memory_layouts.py``'s report with the measurements faked: the expert-parallel row's prediction at the
    routing seen comes right under that row, wherever the layout stands in the list."""
    bench = _script("memory_layouts")

    def measured(name, ranks, overrides, steps, workdir):
        row = {"name": name, "ranks": ranks, "seconds": 1.0, "status": 0}
        row.update({k: {"predicted": 2**20, "measured": 2**20, "ratio": 1.0} for k in ("held", "peak")})
        if "moe" in name:
            row.update({f"{k}_at_routing": {"predicted": 2**21, "ratio": 0.5} for k in ("held", "peak")})
        return row

    monkeypatch.setattr(bench, "run_layout", measured)
    monkeypatch.setattr(bench, "LAYOUTS", {"moe ep2": (2, []), "one process": (1, [])})
    assert bench.main(["--json", str(tmp_path / "rows.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("moe ep2"))
    assert lines[at + 1].split() == ["at", "the", "routing", "seen", "2.00", "Mi", "0.500", "2.00", "Mi", "0.500"]


def test_planner_time_refuses_a_layout_its_settings_break_before_any_rank():
    """``--set model.n_layers=2`` leaves the interleaved pipeline (2 ranks x 2 chunks) without layers: one line, not a
    traceback from every rank."""
    bench = _script("planner_time")
    args = bench.argparse.Namespace(only=[], set=["model.n_layers=2"])
    with pytest.raises(SystemExit, match=r"^layout 'pp interleaved' at 2 ranks: model.n_layers \(2\) is smaller"):
        bench.chosen(args, 2)
    assert [n for n, _ in bench.chosen(bench.argparse.Namespace(only=[], set=[]), 2)] == PLANNER_LAYOUTS_2
