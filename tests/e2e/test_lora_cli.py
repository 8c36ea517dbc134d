"""LoRA through the command line (``train.lora_rank``): a run started from a Hugging Face directory trains only its
adapters -- the base weights come out bitwise unchanged --, exports them in PEFT's format, which ``peft`` loads onto
the original transformers model with our logits, and merged as a Hugging Face directory with the same logits; data
parallelism (replicated, ZeRO-1, ZeRO-3), tensor parallelism and a two-stage pipeline train like one process over
six steps.

One tiny ``LlamaForCausalLM`` (hidden 32, 2 layers, 4 heads, 2 key/value heads, vocabulary 320 so the byte tokenizer
fits) built by transformers serves every test; one single-process run is the reference."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers import cli_here, tiny_hf_llama
from safetensors.torch import load_file

from trickles.testing import run_command
from trickles.train.pieces import PieceReader

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

STEPS = 6


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora") / "base"
    tiny_hf_llama(root)
    return root


def _train(hf_dir, out, *extra: str, nproc: int = 1):
    args = [
        "train",
        "--quiet",
        "--init-from",
        str(hf_dir),
        *("--set", "data.tokenizer=byte", "--set", "data.seq_len=32", "--set", "data.max_bytes=20000"),
        *("--set", f"data.cache_dir={out}/../cache"),
        *("--set", f"train.steps={STEPS}", "--set", "train.global_batch=4", "--set", "train.lr=1e-2"),
        *("--set", "train.warmup_steps=0", "--set", "train.eval_every=0", "--set", "train.sample_tokens=0"),
        *("--set", "train.plot=false", "--set", f"train.out_dir={out}"),
        *("--set", "train.lora_rank=4", "--set", "train.lora_alpha=8", "--set", "model.fused_proj=false"),
        *extra,
    ]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    r = run_command([sys.executable, "-m", "trickles", *args], text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    reader = PieceReader(str(next((out / "checkpoints").glob("step_*"))), "model")
    return [x for x in losses if x is not None], {k: reader.read(k) for k in reader.keys()}


@pytest.fixture(scope="module")
def reference(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-ref") / "run"
    return out, *_train(hf_dir, out)


def test_base_frozen_peft_and_merged_exports_give_our_logits(hf_dir, reference, tmp_path):
    from trickles.models.hf import load_hf
    from trickles.train.load import load_for_inference

    run, losses, state = reference
    assert len(losses) == STEPS and losses[-1] < losses[0]
    base = load_file(hf_dir / "model.safetensors")
    names = {"model.layers.0.self_attn.q_proj.weight": "layers.0.attn.q_proj.weight", "lm_head.weight": "output.weight"}
    for hf, ours in names.items():
        assert torch.equal(state[ours], base[hf]), ours
    start = load_hf(hf_dir, fused_proj=False).state_dict()  # every base weight, in our names, as the run began
    frozen = sorted(n for n in state if "lora_" not in n)
    assert frozen == sorted(start) and len(frozen) == 2 + 2 * 9 + 1  # embedding, output, 9 per block, final norm
    for n in frozen:
        assert torch.equal(state[n], start[n]), n  # bitwise: the base never moved
    assert any("lora_B" in n and state[n].abs().max() > 0 for n in state)  # the adapters did

    r = cli_here("checkpoint", "export", run, tmp_path / "adapter", "--format", "peft")
    assert r.returncode == 0, r.stderr
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    r = cli_here("checkpoint", "export", run, tmp_path / "merged", "--format", "hf")
    assert r.returncode == 0, r.stderr

    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    ours, _, _ = load_for_inference(str(run), merge_adapters=False)
    with torch.no_grad():
        want = ours(ids)
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        got = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(ids).logits
    tol = 1e-5 * want.abs().max()
    assert (got - want).abs().max() <= tol
    assert (merged - want).abs().max() <= tol
    # generate reads the run with its adapters merged: the merged export's greedy tokens
    r = cli_here("generate", run, "--prompt", "def ", "--max-new-tokens", "6", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    prompt = torch.tensor([list(b"def ")])
    with torch.no_grad():
        greedy = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").generate(
            prompt, max_new_tokens=6, do_sample=False
        )
    assert r.stdout.rstrip("\n") == bytes(greedy[0].tolist()).decode("utf-8", errors="replace")


@pytest.mark.parametrize(
    "nproc, extra",
    [
        (2, ()),
        (2, ("--set", "parallel.zero=1")),
        (2, ("--set", "parallel.zero=3")),
        (2, ("--set", "parallel.pp=2", "--set", "train.micro_batch=2")),
        (2, ("--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true")),
        (2, ("--set", "parallel.tp=2", "--set", "model.fused_proj=true")),
        (2, ("--set", "parallel.cp=2")),
    ],
    ids=["dp2", "dp2-zero1", "dp2-zero3", "pp2", "tp2-sp", "tp2-fused", "cp2-ring"],
)
def test_layouts_train_like_one_process(hf_dir, reference, tmp_path, nproc, extra):
    """Losses and adapters of each layout against the single-process run (a fused projection's part adapters by
    their unfused names)."""
    from trickles.adapters.lora import part_name

    _, want_losses, want = reference
    losses, got = _train(hf_dir, tmp_path / "run", *extra, nproc=nproc)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-4, atol=1e-4)
    got = {part_name(n): t for n, t in got.items()}
    adapters = [n for n in want if "lora_" in n]
    assert adapters and sorted(adapters) == sorted(n for n in got if "lora_" in n)
    for n in adapters:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-4)


def test_bad_lora_settings_are_one_line(hf_dir):
    r = cli_here("train", "--init-from", hf_dir, "--set", "train.lora_rank=4", "--set", "train.lora_targets=[c_fc]")
    assert r.returncode == 2 and "train.lora_targets names 'c_fc'" in r.stderr
    r = cli_here("train", "--init-from", hf_dir, "--set", "train.lora_rank=4", "--set", "train.qat=true")
    assert r.returncode == 2 and "not built with train.qat" in r.stderr
