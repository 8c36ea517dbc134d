"""Chat SFT through the command line: ``trickles train`` on conversations (``data.format = "chat"``, a Llama-3 style
template whose eos ends every turn) trains on the assistant's tokens only -- its first loss is the model's loss on the
assistant targets of the first batch -- says in its data line and in every metrics record (``overlong_cut``,
``overlong_dropped``: the same at every layout and after a resume) how many conversations it packed and cut, and
trains at tp2, cp2, pp2 and dp2 like one process (the loss is the mean over the global batch's assistant
tokens at every layout); bad chat input is refused in one line before any process starts."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import cli_here, tiny_config

from trickles.train.trainer import Trainer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
WORDS = "the sky is blue grass green sea wide sun bright moon pale tree tall stone grey".split()


def _chats(n: int) -> list[dict]:
    """``n`` short conversations of one or two exchanges; every fifth one long (cut at data.seq_len)."""
    out = []
    for i in range(n):
        turns = []
        for j in range(1 + i % 2):
            q = " ".join(WORDS[(i + j + k) % len(WORDS)] for k in range(2))
            a = " ".join(WORDS[(2 * i + j + k) % len(WORDS)] for k in range(2 + (60 if i % 5 == 4 else i % 4)))
            turns += [{"role": "user", "content": f"Tell me about {q}?"}, {"role": "assistant", "content": a}]
        out.append({"messages": ([{"role": "system", "content": "Be brief."}] if i % 2 else []) + turns})
    return out


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    from tokenizers import decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("chat-sft")
    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator([" ".join(WORDS)] * 8 + ["Tell me about Be brief. user assistant system"] * 4, trainer)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=SPECIALS[0], eos_token="<|eot_id|>")
    tok.chat_template = LLAMA3
    tok.save_pretrained(root / "tok")
    with open(root / "chats.jsonl", "w") as f:
        f.writelines(json.dumps(c) + "\n" for c in _chats(60))
    return root


def _keys(root, out, *more):
    keys = [
        "model.preset=tiny",
        f"data.source={root}/chats.jsonl",
        "data.format=chat",
        f"data.tokenizer={root}/tok",
        "data.seq_len=96",
        "data.val_fraction=0.1",
        f"data.cache_dir={root}/cache",
        "train.steps=3",
        "train.global_batch=4",
        "train.warmup_steps=1",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.plot=false",
        f"train.out_dir={out}",
        *more,
    ]
    return [a for kv in keys for a in ("--set", kv)]


def _losses(out, cut: int | None = None) -> list[float]:
    """The run's losses; ``cut``: every record also says how many conversations were cut (none dropped)."""
    with open(out / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    if cut is not None:
        assert all((r["overlong_cut"], r["overlong_dropped"]) == (cut, 0) for r in records), (out, records[0])
    return [r["loss"] for r in records]


def test_chat_sft_trains_on_assistant_tokens_like_one_process_at_tp2_cp2_pp2_dp2(chat_data, tmp_path):
    root = chat_data
    one = cli_here("train", *_keys(root, tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    line = next(x for x in one.stdout.splitlines() if "chat: " in x)
    assert "conversations in" in line and "longer than data.seq_len cut (data.overlong=truncate)" in line
    cut = int(line.split("sequences, ")[1].split(" longer")[0])
    assert cut >= 10  # (every fifth conversation is longer than data.seq_len)
    losses = _losses(tmp_path / "one", cut)
    # the first step's loss is the initial model's on the assistant targets of the first batch, the others -100
    cfg = tiny_config(tmp_path, *[kv for kv in _keys(root, tmp_path / "ref") if kv != "--set"])
    tr = Trainer(cfg, cfg.validate(1).build(torch.device("cpu")), quiet=True)
    x, y, _, docs = tr.train_data.micro_batches(0, 4, 4)[0]
    assert 0 < int((y != -100).sum()) < y.numel() // 2 and int(docs.max()) >= 3
    with torch.no_grad():
        assert abs(float(tr.model(x, target=y, documents=docs)) - losses[0]) < 1e-5
    for layout in ("parallel.tp=2", "parallel.cp=2", "parallel.pp=2", "parallel.dp=2"):
        run = cli_here("train", "--quiet", "--nproc", "2", *_keys(root, tmp_path / layout, layout))
        assert run.returncode == 0, run.stderr
        other = _losses(tmp_path / layout, cut)
        assert max(abs(a - b) / b for a, b in zip(other, losses)) < 1e-4, (layout, other, losses)
    tr.load_checkpoint(str(next((tmp_path / "one" / "checkpoints").glob("step_*"))))  # a resume counts the same
    record = tr.train_step()
    assert record["step"] == 4 and (record["overlong_cut"], record["overlong_dropped"]) == (cut, 0)


def test_bad_chat_input_is_refused_before_any_process_starts(chat_data, tmp_path):
    root = chat_data
    with open(tmp_path / "bad.jsonl", "w") as f:
        f.writelines(json.dumps(c) + "\n" for c in _chats(3) + [{"messages": [{"role": "robot", "content": "x"}]}])
    run = cli_here("train", "--nproc", "2", *_keys(root, tmp_path / "bad", f"data.source={tmp_path}/bad.jsonl"))
    assert run.returncode != 0 and not (tmp_path / "bad").exists()
    assert run.stderr.strip().count("\n") == 0 and "bad.jsonl:4: message 1 has the unknown role 'robot'" in run.stderr
