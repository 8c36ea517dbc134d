"""Packed documents (``data.document_mask``): document ids from end-of-text, positions that restart, attention that
never crosses a boundary -- each document of a packed batch gives the losses and gradients it gives run alone."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import cli_here, short_documents, tiny_config

from trickles.config import Config
from trickles.data import ShardedBatches, require_boundaries
from trickles.errors import ConfigError, DataError
from trickles.models.config import ModelConfig
from trickles.models.documents import (
    DocumentMask,
    block_mask,
    dense_mask,
    document_ids,
    document_positions,
    flex_attention,
    reference_attention,
)
from trickles.models.presets import apply_preset
from trickles.models.transformer import build_model
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

EOS = 0


def test_ids_and_positions_restart_at_each_end_of_text():
    tokens = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, EOS, 4], [EOS, 1, 2, 3, 4, 5, 6, 7, 8]])
    ids = document_ids(tokens, EOS)
    assert ids.dtype == torch.int32
    assert ids.tolist() == [[0, 0, 1, 1, 1, 1, 2, 3, 3], [1, 1, 1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(ids).tolist() == [[0, 1, 0, 1, 2, 3, 0, 0, 1], list(range(9))]


def _packed(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    """Token rows holding several documents each: one longer than half a row, some of two tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 200, (rows, length), generator=g)
    tokens[0, [3, 5, 25]] = EOS  # documents [0,3) [3,5) [5,25) [25,..)
    tokens[1, [0, 9, 10, 20]] = EOS  # a document of one token (the eos at 9)
    return tokens


def _spans(ids_row: torch.Tensor) -> list[tuple[int, int]]:
    cuts = [0] + [i for i in range(1, len(ids_row)) if ids_row[i] != ids_row[i - 1]] + [len(ids_row)]
    return list(zip(cuts[:-1], cuts[1:]))


@pytest.mark.parametrize("preset", ["tiny", "gpt2-tiny"])
def test_each_packed_document_trains_as_if_alone(preset):
    """Per-token losses and parameter gradients of a packed batch against each document run by itself (fp32,
    within 1e-5): fails if the mask is dropped, and for gpt2's learned positions if their reset is (checked on the
    same batch below). Rotary scores depend on relative positions only, so within a document llama's are the
    same either way (measured: 4.8e-7 apart)."""
    cfg = apply_preset(ModelConfig(preset=preset), preset)
    cfg.vocab_size, cfg.max_seq_len = 256, 64
    model = build_model(cfg, seed=3)
    tokens = _packed(2, 32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    ids = document_ids(x, EOS)

    logits = model(x, documents=ids)
    packed = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)
    packed.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    alone = torch.empty_like(packed)
    for r in range(x.shape[0]):
        for a, b in _spans(ids[r]):
            lo = model(x[r : r + 1, a:b])
            loss = F.cross_entropy(lo[0], y[r, a:b], reduction="none")
            alone[r, a:b] = loss.detach()
            loss.sum().backward()
    assert (packed.detach() - alone).abs().max() <= 1e-5
    for n, p in model.named_parameters():
        assert (grads[n] - p.grad).abs().max() <= 1e-5 * max(1.0, float(p.grad.abs().max())), n

    with torch.no_grad():  # the same batch without the mask, and with the mask but positions running on
        plain = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none").view_as(y)
        assert (plain - alone).abs().max() > 1e-2
        mask = DocumentMask(ids)
        mask.positions = torch.arange(x.shape[1]).expand_as(x)
        h = model.embed_tokens(x, 0, mask.positions, x.shape[1])
        rope = model.rope(0, x.shape[1], mask.positions)
        for block in model.layers.values():
            h = block(h, rope, None, 0, None, documents=mask)
        running = F.cross_entropy(model.head(h).flatten(0, 1), y.flatten(), reduction="none").view_as(y)
        if preset == "gpt2-tiny":
            assert (running - alone).abs().max() > 1e-2
        else:
            assert (running - alone).abs().max() <= 1e-5


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_dense_and_flex_masks_attend_like_the_reference():
    """The dense path (CPU training) and flex attention's block mask (CUDA training; forward only on a CPU, which
    has no flex backward) against a hand-written same-document causal attention, with grouped key/value heads."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 40, 8, generator=g)
    k, v = torch.randn(2, 2, 40, 8, generator=g), torch.randn(2, 2, 40, 8, generator=g)
    ids = document_ids(_packed(2, 40)[:, :40], EOS)
    want = reference_attention(q, k, v, ids)
    assert (DocumentMask(ids, "dense").attend(q, k, v) - want).abs().max() <= 1e-5
    assert (flex_attention(q, k, v, block_mask=block_mask(ids), enable_gqa=True) - want).abs().max() <= 1e-5
    m = dense_mask(ids)
    assert m.shape == (2, 1, 40, 40) and not m[0, 0, 5, 4] and m[0, 0, 4, 3] and not m[0, 0, 3, 4]


def test_loader_gives_each_micro_batch_its_document_ids():
    tokens = np.array([3, 4, EOS, 5, 6, 7, EOS, 8, 9, 1, 2, EOS, 4, 4, 4, 4, 4], dtype=np.uint16)
    data = ShardedBatches(tokens, seq_len=4, seed=0, eos_id=EOS)
    for x, y, labels, ids in data.micro_batches(0, global_batch=4, micro_batch=2):
        assert labels is None and torch.equal(ids, document_ids(x, EOS))
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert all(len(b) == 2 for b in ShardedBatches(tokens, 4, 0).micro_batches(0, 4, 2))  # off: as before


def test_a_run_with_document_masks_trains_and_differs_from_plain_causal(tmp_path):
    corpus = short_documents(tmp_path / "lines.jsonl")

    def losses(*overrides):
        tr = Trainer(
            tiny_config(tmp_path, *corpus, *overrides, steps=3), ParallelDims().build(torch.device("cpu")), quiet=True
        )
        return [tr.train_step()["loss"] for _ in range(3)]

    masked, plain = losses("data.document_mask=true"), losses()
    assert all(np.isfinite(masked)) and max(abs(a - b) for a, b in zip(masked, plain)) > 1e-4


def test_token_stream_without_boundaries_is_refused(tmp_path):
    with pytest.raises(DataError, match=r"needs end-of-text tokens \(id 256\) between documents, and t.bin has none"):
        require_boundaries(np.arange(100, dtype=np.uint16) % 200, 256, "t.bin", chunk=7)
    require_boundaries(np.array([1, 2, 256, 3], dtype=np.uint16), 256, "t.bin", chunk=3)
    # through the command, before any rank starts: a token file without the byte tokenizer's eos (256)
    tokens = tmp_path / "t.bin"
    (np.arange(3000) % 200).astype(np.uint16).tofile(tokens)
    r = cli_here(
        "train",
        "--set",
        f"data.source={tokens}",
        "--set",
        "data.document_mask=true",
        "--set",
        "model.preset=tiny",
        "--set",
        f"train.out_dir={tmp_path / 'run'}",
        "--nproc",
        "2",
    )
    assert r.returncode == 2 and r.stderr == (
        f"error: data.document_mask=true needs end-of-text tokens (id 256) between "
        f"documents, and {tokens} has none; write the token file with the eos id "
        f"after each document, or set data.document_mask=false\n"
    ), r.stderr
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_without_end_of_text_is_refused_before_any_rank(tmp_path):
    """data.document_mask cuts documents at the tokenizer's eos: a tokenizer directory that names none stops the
    command with one line before a rank starts (and a run directory is made)."""
    from tokenizers import Tokenizer, models

    (tmp_path / "tok").mkdir()
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "tok" / "tokenizer.json"))
    r = cli_here(
        "train",
        "--set",
        f"data.tokenizer={tmp_path / 'tok'}",
        "--set",
        "data.document_mask=true",
        "--set",
        "model.preset=tiny",
        "--set",
        f"train.out_dir={tmp_path / 'run'}",
        "--nproc",
        "2",
    )
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "names no end-of-text token" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("sets,world,what", [(["parallel.tp=4", "parallel.tp_mode=2d"], 4, "parallel.tp_mode=2d")])
def test_layouts_that_do_not_take_document_ids_yet_are_refused(sets, world, what):
    cfg = Config.load(
        None, ["model.preset=tiny", "data.seq_len=32", "train.global_batch=8", "data.document_mask=true", *sets]
    )
    with pytest.raises(ConfigError, match=f"data.document_mask=true does not combine with {what} yet"):
        cfg.validate(world)


def test_distillation_with_document_masks_is_refused():
    cfg = Config.load(None, ["model.preset=tiny", "data.document_mask=true", "distill.teacher=some/run"])
    with pytest.raises(ConfigError, match=r"does not combine with distillation \(distill.teacher\) yet"):
        cfg._check_documents(ParallelDims())  # (validate first checks that the teacher exists)


@pytest.mark.parametrize(
    "preset,recompute,precision",
    [
        ("tiny", "none", "fp32"),
        ("tiny", "selective", "bf16"),
        ("tiny", "full", "fp32"),
        ("gpt2-tiny", "none", "bf16"),
        ("gpt2-tiny", "selective", "fp32"),
    ],
)
def test_the_memory_model_counts_what_document_masks_keep(tmp_path, preset, recompute, precision):
    """activation_bytes(documents=True) against the bytes autograd saves in a trainer's micro-step, per layer and in
    the head, to the byte (grouped-query heads in the llama cases: k and v repeated by the dense path)."""
    from trickles.memory.activations import ActivationMeter, activation_bytes

    cfg = tiny_config(
        tmp_path,
        *short_documents(tmp_path / "lines.jsonl"),
        "data.document_mask=true",
        f"model.preset={preset}",
        f"memory.recompute={recompute}",
        f"memory.precision={precision}",
        "train.micro_batch=2",
        "train.global_batch=2",
    )
    tr = Trainer(cfg, ParallelDims().build(torch.device("cpu")), quiet=True)
    x, y, _, ids = tr.train_data.micro_batches(0, 2, 2)[0]
    assert int(ids[:, -1].max()) > 0  # some row packs more than one document
    with ActivationMeter(tr.model) as meter:
        loss = tr._loss(x, y, None, ids)
    loss.backward()
    p = 2 if precision == "bf16" else 4
    want = activation_bytes(tr.model_cfg, 2, 32, recompute, p, documents=True)
    assert [meter.per_layer[f"layers.{i}"] for i in range(tr.model_cfg.n_layers)] == want["per_layer"]
    assert meter.per_layer["head"] == want["head"]
    assert want["total"] > activation_bytes(tr.model_cfg, 2, 32, recompute, p)["total"] or recompute == "full"


def test_compiled_blocks_take_the_document_mask(tmp_path):
    """Blocks compiled as train.compile compiles them, traced around the mask object without a graph break, give the
    eager run's losses. (TorchDynamo with the eager backend: Inductor's code generation is the same as without
    documents and costs ~25 s here; the full train.compile=true run was checked by hand: equal to 1e-7.)"""
    from torch._dynamo.utils import counters

    corpus = short_documents(tmp_path / "lines.jsonl")

    def losses(compiled):
        tr = Trainer(
            tiny_config(tmp_path, *corpus, "data.document_mask=true", steps=2),
            ParallelDims().build(torch.device("cpu")),
            quiet=True,
        )
        if compiled:
            for block in tr.model.layers.values():
                block.compile(backend="eager", fullgraph=True)
        return [tr.train_step()["loss"] for _ in range(2)]

    eager = losses(False)
    graphs = counters["stats"]["unique_graphs"]
    compiled = losses(True)
    assert counters["stats"]["unique_graphs"] > graphs
    assert max(abs(a - b) / b for a, b in zip(compiled, eager)) <= 1e-5, (compiled, eager)
