"""The ``trickles`` command end to end: outputs of a run, local multi-rank runs, and bad input."""

import json
import os
import shutil
import sys

import pytest
import torch
from helpers import cli_here

from trickles.testing import run_command

TINY = [
    "--set",
    "model.preset=tiny",
    "--set",
    "data.seq_len=32",
    "--set",
    "data.max_bytes=120000",
    "--set",
    "train.global_batch=8",
    "--set",
    "train.warmup_steps=2",
    "--set",
    "train.lr=3e-3",
]


def trickles(*args, cwd=None, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return run_command([sys.executable, "-m", "trickles", *args], text=True, cwd=cwd, timeout=timeout, env=env)


def generated(*args) -> str:
    """stdout of ``trickles generate ARGS``, exactly (text mode would turn a sampled carriage return into a newline)."""
    r = run_command(
        [sys.executable, "-m", "trickles", "generate", *args],
        text=False,
        timeout=300,
        env=dict(os.environ, PYTHONUNBUFFERED="1", PYTHONIOENCODING="utf-8"),
    )
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return r.stdout.decode("utf-8")


def run_args(tmp, *extra, steps=6):
    return [
        "train",
        *TINY,
        "--set",
        f"data.cache_dir={tmp}/cache",
        "--set",
        f"train.out_dir={tmp}/run",
        "--set",
        f"train.steps={steps}",
        *extra,
    ]


SEED = 1234  # train.seed's default: the run's final sample is drawn with a generator seeded by it
TEMPERATURE = 0.8


def reference_samples(checkpoint, prompt: str, n: int, num_samples: int = 1, seed: int = SEED) -> list[str]:
    """What ``trickles generate --temperature 0.8 --seed SEED`` must print, decoded by the plainest loop: the checkpoint
    loaded in this process, the whole sequence through the model for every token (no KV cache), each token drawn
    from softmax(logits / 0.8) with a generator seeded like the command's, stopping once every row has drawn eos.

    Sampling rather than greedy decoding: the tiny model after a few steps is nearly a unigram model whose argmax
    is a space whatever the details of its weights, the sampler or the prompt, so greedy text would pass most bugs;
    sampled draws depend on every probability. (The KV cache against the full forward: tests/unit/test_model.py.)"""
    from trickles.train.load import load_for_inference

    model, tokenizer, _ = load_for_inference(str(checkpoint), "cpu")
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    rows = torch.tensor([ids] * num_samples)
    g = torch.Generator().manual_seed(seed)
    done = torch.zeros(num_samples, dtype=torch.bool)
    with torch.no_grad():
        for _ in range(n):
            probs = (model(rows)[:, -1].float() / TEMPERATURE).softmax(-1)
            nxt = torch.multinomial(probs, 1, generator=g)[:, 0]
            rows = torch.cat([rows, nxt[:, None]], dim=1)
            done |= nxt == tokenizer.eos_id
            if bool(done.all()):
                break
    return [prompt + tokenizer.decode(row[len(ids) :].tolist()) for row in rows]


# the run's own sample at the end drawn the same way (no top-k), so it is comparable too
SAMPLED = ["--set", f"train.sample_temperature={TEMPERATURE}", "--set", "train.sample_top_k=0"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    r = trickles(
        *run_args(
            tmp,
            "--set",
            "train.eval_every=3",
            "--set",
            "train.sample_tokens=20",
            "--set",
            "train.checkpoint_every=3",
            *SAMPLED,
        )
    )
    assert r.returncode == 0, r.stderr
    return tmp, r


def test_run_writes_metrics_plot_sample_and_checkpoints(finished_run):
    tmp, r = finished_run
    out = tmp / "run"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records] == list(range(1, 7))
    for x in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(x)
    assert records[2]["val_loss"] is not None and records[5]["val_loss"] is not None
    assert records[-1]["loss"] < records[0]["loss"]
    assert (out / "loss.png").stat().st_size > 1000
    sample = (out / "sample.txt").read_bytes().decode("utf-8")
    assert [sample] == reference_samples(out / "checkpoints" / "step_000006", "def ", 20)  # the final model's tokens
    assert "sample after 6 steps:" in r.stdout
    steps = sorted(os.listdir(out / "checkpoints"))
    assert steps == ["step_000003", "step_000006"]
    for s in steps:
        assert {
            "manifest.json",
            "model-rank00000.safetensors",
            "optimizer-rank00000.safetensors",
            "trainer.json",
            "tokenizer",
        } <= set(os.listdir(out / "checkpoints" / s))


def test_generate_from_run(finished_run):
    tmp, _ = finished_run
    args = [
        "--prompt",
        "import os",
        "--max-new-tokens",
        "20",
        "--temperature",
        str(TEMPERATURE),
        "--num-samples",
        "3",
        "--seed",
        "5",
    ]
    out = generated(str(tmp / "run"), *args)
    samples = reference_samples(tmp / "run" / "checkpoints" / "step_000006", "import os", 20, num_samples=3, seed=5)
    assert out == "".join(f"--- sample {i + 1} ---\n{text}\n" for i, text in enumerate(samples))
    assert (
        generated(str(tmp / "run" / "checkpoints" / "step_000006"), *args) == out
    )  # the out_dir: its newest checkpoint


def test_resume_auto_continues(finished_run, tmp_path):
    tmp, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(tmp / "run", run)
    r = trickles(
        "train",
        *TINY,
        "--set",
        f"data.cache_dir={tmp}/cache",
        "--set",
        f"train.out_dir={run}",
        "--set",
        "train.steps=8",
        "--set",
        "train.sample_tokens=0",
        "--resume",
        "auto",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records] == list(range(1, 9))


LAYOUTS = {
    "dp2-zero3": (["parallel.zero=3"], "(dp=2, ZeRO-3)"),
    "tp2-sp": (["parallel.tp=2", "parallel.sequence_parallel=true"], "(dp=1, tp=2 with sequence parallel)"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_local_launcher_two_ranks(tmp_path, layout):
    """(The same job under torchrun, killed and restarted once: tests/e2e/test_fault.py.)"""
    settings, banner = LAYOUTS[layout]
    sets = [a for s in settings for a in ("--set", s)]
    r = trickles(*run_args(tmp_path, "--nproc", "2", "--set", "train.sample_tokens=8", *SAMPLED, *sets, steps=3))
    assert r.returncode == 0, r.stderr
    assert f"2 rank(s) {banner}" in r.stdout
    assert "leaked" not in r.stderr and "Traceback" not in r.stderr
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3
    _check_samples(tmp_path / "run", steps=3)  # also from sharded (ZeRO-3, tp) checkpoints


def _check_samples(run, steps):
    """The run's own sample (the live, sharded model on every rank), ``trickles generate`` from its checkpoint
    (consolidated into one process) and the plain reference loop agree token for token."""
    [reference] = reference_samples(run / "checkpoints" / f"step_{steps:06d}", "def ", 8)
    assert (run / "sample.txt").read_bytes().decode("utf-8") == reference
    assert (
        generated(str(run), "--max-new-tokens", "8", "--temperature", str(TEMPERATURE), "--seed", str(SEED))
        == reference + "\n"
    )


def test_pipeline_from_the_command_line_with_its_timeline(tmp_path):
    """``--set parallel.pp=2 --set parallel.schedule=zb-v`` trains, samples through the stages (the last one on rank
    0, in ZB-V's V), checkpoints (each stage its part), and ``--pipeline-trace`` draws the last step with its bubble."""
    png = tmp_path / "pipe.png"
    r = trickles(
        *run_args(
            tmp_path,
            "--nproc",
            "2",
            "--set",
            "parallel.pp=2",
            "--set",
            "parallel.schedule=zb-v",
            "--set",
            "parallel.virtual_stages=2",
            "--set",
            "train.micro_batch=2",
            "--set",
            "model.n_layers=4",
            "--set",
            "train.sample_tokens=8",
            *SAMPLED,
            "--pipeline-trace",
            str(png),
            steps=3,
        )
    )
    assert r.returncode == 0, r.stderr
    assert "2 rank(s) (dp=1, pp=2 zb-v" in r.stdout
    assert f"pipeline trace: {png} (bubble" in r.stdout and "predicted for these stage times" in r.stdout
    assert png.stat().st_size > 10_000
    _check_samples(
        tmp_path / "run", steps=3
    )  # sampled through the stages, and from each stage's part of the checkpoint


def _one_line_error(r, needle):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--set", "train.stpes=3"], "unknown key 'train.stpes'; did you mean 'train.steps'?"),
        (["--set", "model.n_heads=three"], "model.n_heads must be an integer, got 'three'"),
        (
            ["--set", "data.source=/no/such/corpus.txt"],
            "data.source '/no/such/corpus.txt' is not a file; give an existing file",
        ),
        (["--config", "/no/such/run.toml"], "config file /no/such/run.toml does not exist"),
        (
            ["--nproc", "2", "--set", "parallel.dp=4"],
            "parallel.dp x tp x pp x cp = 4 x 1 x 1 x 1 = 4, but there are 2 processes",
        ),
        (
            ["--nproc", "2", "--set", "train.global_batch=7"],
            "train.global_batch (7) must be divisible by parallel.dp (2)",
        ),
        (
            ["--set", "parallel.ep=2", "--nproc", "2"],
            "parallel.ep=2 splits the experts of mixture-of-experts blocks, but model.moe_experts is 0",
        ),
        (
            ["--set", "parallel.pp=4", "--nproc", "4"],
            "model.n_layers (2) is smaller than the number of pipeline stages",
        ),
        (["--set", "parallel.tp=3", "--nproc", "3"], "model.n_heads (4) must be divisible by parallel.tp (3)"),
        (["--set", "parallel.sequence_parallel=true"], "parallel.sequence_parallel needs parallel.tp > 1"),
        (["--set", "parallel.zero=4"], "parallel.zero must be 0, 1, 2 or 3, got 4"),
        (
            ["--set", "memory.offload_optimizer=true"],
            "memory.offload_optimizer needs a sharded optimizer; set parallel.zero to 1, 2 or 3",
        ),
        (
            ["--set", "parallel.zero=3", "--set", "train.compile=true"],
            "train.compile does not work with parallel.zero=3 yet",
        ),
        (
            ["--resume", "/no/such/path"],
            "--resume /no/such/path: no such checkpoint directory; give a step_* directory, a run's out_dir, or auto",
        ),
        (["--nproc", "2", "--max-restarts", "-1"], "--max-restarts must be at least 0, got -1"),
        (["--nproc", "0"], "--nproc must be at least 1, got 0"),
    ],
)
def test_bad_input_is_one_line_status_two_and_leaves_nothing(tmp_path, extra, needle):
    r = cli_here(*run_args(tmp_path, *extra))  # refused before anything starts (a real process: the tests below)
    _one_line_error(r, needle)
    assert not (tmp_path / "run").exists()


GENERATE_MEMORY_REFUSED = [
    (
        ["generate", "{tmp}/no/such/run"],
        "checkpoint {tmp}/no/such/run does not exist; give a checkpoint directory, a run's out_dir or a Hugging Face "
        "model directory",
    ),
    (["generate", "{tmp}"], "no complete checkpoint found at {tmp}; give a step_* directory or a run's out_dir"),
    (["generate", "{tmp}", "--max-new-tokens", "-1"], "--max-new-tokens must be at least 0, got -1"),
    (
        ["generate", "{tmp}", "--max-new-tokens", "ten"],
        "argument --max-new-tokens: invalid int value: 'ten' (see trickles generate --help)",
    ),
    (["generate", "{tmp}", "--top-p", "1.5"], "--top-p must be in (0, 1] (1: off), got 1.5"),
    (["generate", "{tmp}", "--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["memory", "--set", "model.n_layer=3"], "unknown key 'model.n_layer'; did you mean 'model.n_layers'?"),
    (["memory", "--device-gb", "0"], "--device-gb must be a positive number of GB, got 0"),
    (["memory", "--nproc", "0"], "--nproc must be at least 1, got 0"),
    (
        ["memory", "--png", "{tmp}/no/such/dir/m.png"],
        "--png {tmp}/no/such/dir/m.png: the directory {tmp}/no/such/dir does not exist",
    ),
]


@pytest.mark.parametrize("args,needle", GENERATE_MEMORY_REFUSED)
def test_bad_input_to_generate_and_memory_is_one_line_status_two(tmp_path, args, needle):
    run = trickles if (args, needle) == GENERATE_MEMORY_REFUSED[0] else cli_here  # one case through a real process
    r = run(*[a.format(tmp=tmp_path) for a in args], cwd=tmp_path)
    _one_line_error(r, needle.format(tmp=tmp_path))
    assert os.listdir(tmp_path) == []  # nothing written, here or under a default out_dir


def _damage(step_dir, how):
    if how == "truncated":
        with open(step_dir / "model-rank00000.safetensors", "r+b") as f:
            f.truncate(os.path.getsize(step_dir / "model-rank00000.safetensors") // 2)
    elif how == "edited":
        text = (step_dir / "trainer.json").read_text()
        assert '"step": 6,' in text
        (step_dir / "trainer.json").write_text(text.replace('"step": 6,', '"step": 9,'))  # same size, other content
    elif how == "no manifest":
        (step_dir / "manifest.json").unlink()


@pytest.mark.parametrize(
    "how,needle",
    [
        ("truncated", "model-rank00000.safetensors has"),
        ("edited", "trainer.json does not match its checksum"),
        ("no manifest", "has no manifest.json"),
    ],
)
def test_damaged_checkpoint_is_refused_and_auto_falls_back(finished_run, tmp_path, how, needle):
    tmp, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(tmp / "run", run)
    newest = run / "checkpoints" / "step_000006"
    _damage(newest, how)
    r = cli_here(
        "train",
        *TINY,
        "--set",
        f"data.cache_dir={tmp}/cache",
        "--set",
        f"train.out_dir={run}",
        "--set",
        "train.steps=7",
        "--resume",
        str(newest),
    )  # refused before training starts (the fallback below: a real process)
    _one_line_error(r, needle)
    r = trickles(
        "train",
        *TINY,
        "--set",
        f"data.cache_dir={tmp}/cache",
        "--set",
        f"train.out_dir={run}",
        "--set",
        "train.steps=7",
        "--set",
        "train.sample_tokens=0",
        "--resume",
        "auto",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records] == list(range(1, 8))  # resumed from step 3, not the damaged 6


def test_fresh_run_into_a_used_out_dir_is_refused(finished_run):
    tmp, _ = finished_run
    r = trickles(*run_args(tmp))
    _one_line_error(r, "already holds checkpoints (newest: step 6); continue with --resume auto")


def test_memory_command_predicts_measures_and_draws(tmp_path):
    png = tmp_path / "mem.png"
    r = trickles(
        "memory",
        *TINY,
        "--set",
        f"data.cache_dir={tmp_path}/cache",
        "--set",
        "memory.recompute=selective",
        "--nproc",
        "2",
        "--set",
        "parallel.zero=2",
        "--measure",
        "2",
        "--png",
        str(png),
        "--device-gb",
        "16",
    )
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.strip()}
    for key in ("parameters", "gradients", "optimizer", "activations", "head"):
        assert rows[key][-1] == "1.000", r.stdout  # measured / predicted
    assert "layer 1" in r.stdout and "-> fits" in r.stdout
    assert png.stat().st_size > 1000
    only = trickles(
        "memory",
        "--set",
        "model.preset=llama-7b",
        "--set",
        "memory.precision=bf16",
        "--set",
        "data.seq_len=4096",
        "--set",
        "train.global_batch=1",
        "--device-gb",
        "80",
    )
    assert only.returncode == 0 and "does NOT fit" in only.stdout  # 7B with Adam on one 80 GB device
    assert (
        "each of the 32 layers: " in only.stdout and "of saved activations" in only.stdout
    )  # predicted only: one line
