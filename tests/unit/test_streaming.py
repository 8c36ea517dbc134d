"""Layer streaming (trickles/infer): the placement, exactness against the resident model, the two
buffers and the prefetch order, checkpoints stored in pieces, and the memory budget held on CPU."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from trickles.data.tokenizers import ByteTokenizer
from trickles.errors import UserError
from trickles.infer.placement import plan_placement, spaced
from trickles.infer.streaming import CheckpointTensors, block_bytes, kv_cache_bytes, load_streaming, save_for_inference
from trickles.models.config import ModelConfig
from trickles.models.generate import generate
from trickles.models.presets import apply_preset
from trickles.models.transformer import build_model
from trickles.train import checkpoint as ckpt
from trickles.train.load import load_for_inference

N_LAYERS = 6


# ---- placement ---------------------------------------------------------------------------


def _min_cyclic_gap(chosen, n):
    if len(chosen) < 2:
        return n
    return min((b - a) % n for a, b in zip(chosen, chosen[1:] + chosen[:1]))


def test_spaced_spreads_the_streamed_blocks_as_far_apart_as_any_choice_can():
    assert spaced(12, 3) == (2, 6, 10)
    assert spaced(8, 8) == tuple(range(8)) and spaced(5, 0) == ()
    for n in range(1, 11):
        for s in range(1, n + 1):
            ours = list(spaced(n, s))
            assert len(set(ours)) == s and all(0 <= i < n for i in ours)
            best = max(_min_cyclic_gap(list(c), n) for c in itertools.combinations(range(n), s))
            assert _min_cyclic_gap(ours, n) == best == n // s, (n, s)
    with pytest.raises(ValueError):
        spaced(3, 4)


def test_plan_streams_the_fewest_blocks_that_fit():
    n, b, fixed = 12, 100, 250
    whole = fixed + n * b
    assert plan_placement([b] * n, fixed, whole).streamed == ()
    assert plan_placement([b] * n, fixed, whole).device_bytes == whole
    for budget in range(fixed + 2 * b, whole):
        p = plan_placement([b] * n, fixed, budget)
        s = len(p.streamed)
        # the closed form for equal blocks: keep floor((M - F - 2b) / b) of them
        assert s == n - (budget - fixed - 2 * b) // b, budget
        assert s >= 3 and p.n_buffers == 2 and p.buffer_bytes == b
        assert p.device_bytes == fixed + (n - s) * b + 2 * b <= budget
        assert p.streamed == spaced(n, s) and sorted(p.resident + p.streamed) == list(range(n))
    with pytest.raises(UserError, match="too small for this model: streaming every block still needs"):
        plan_placement([b] * n, fixed, fixed + 2 * b - 1)
    with pytest.raises(UserError, match="must be positive"):
        plan_placement([b] * n, fixed, 0)


def test_plan_sizes_the_buffers_by_the_largest_streamed_block():
    sizes = [10, 50, 10, 10, 10, 10]  # a large block 1 (an MoE layer, say)
    # streaming spaced(6, 3) = (1, 3, 5) needs 30 + 2 * 50 = 130 > 95; spaced(6, 4) = (0, 2, 3, 5): 60 + 2 * 10 = 80
    p = plan_placement(sizes, 0, 95)
    assert p.streamed == (0, 2, 3, 5) and p.resident == (1, 4)
    assert p.buffer_bytes == 10 and p.device_bytes == 80
    p = plan_placement(sizes, 0, 99)  # one byte short of the whole model: streaming three blocks (1, 3, 5) would not do
    assert p.streamed == (0, 2, 3, 5)
    assert plan_placement(sizes, 0, 100).streamed == ()


def test_the_copy_threads_copy_is_bit_for_bit_in_every_dtype():
    from trickles.infer.streaming import _copy_one_thread

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.bool):
        src = (torch.randn(37, 5, generator=g) * 50).to(dtype)
        dst = torch.empty_like(src)
        _copy_one_thread(dst, src)
        assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8)), dtype
    fused = torch.zeros(4, 5, 3)  # a part's rows, interleaved with the other parts' in a fused weight's buffer
    src = torch.randn(4, 2, 3, generator=g)
    _copy_one_thread(fused[:, 1:3], src)
    assert torch.equal(fused[:, 1:3], src) and not fused[:, 0].any() and not fused[:, 3:].any()
    src = torch.randn(8, 3, generator=g)
    dst = torch.empty(8, 3, dtype=torch.bfloat16)  # a checkpoint in another precision: converted as copy_ does
    _copy_one_thread(dst, src)
    assert torch.equal(dst, src.to(torch.bfloat16))


# ---- the streamed model against the resident one ------------------------------------------


def _save(tmp, flavor="llama"):
    if flavor == "llama":
        cfg = dataclasses.replace(
            apply_preset(ModelConfig(), "tiny"), n_layers=N_LAYERS, vocab_size=257, max_seq_len=64
        )
    else:  # learned positions, biases, the output tied to the embedding
        cfg = dataclasses.replace(
            apply_preset(ModelConfig(), "gpt2-tiny"), n_layers=N_LAYERS, vocab_size=257, max_seq_len=64
        )
    path = str(tmp / f"ckpt-{flavor}")
    save_for_inference(build_model(cfg, seed=3), ByteTokenizer(), path)
    return path


def _budgets(model, max_len, batch=1):
    """Budgets from everything resident down to every block streamed."""
    fixed = kv_cache_bytes(model.cfg, batch, max_len)
    block = block_bytes(model.layers["0"])  # in a buffer, each tensor 64-byte aligned
    others = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("layers.")) + sum(
        b.numel() * 4 for b in model.buffers()
    )
    whole = fixed + others + N_LAYERS * block
    return [whole + 4096, whole - block, whole - 3 * block, fixed + others + 2 * block + 4096]


@pytest.mark.parametrize("flavor", ["llama", "gpt2"])
def test_streamed_generation_is_bit_identical_to_resident(tmp_path, flavor):
    path = _save(tmp_path, flavor)
    ref, tok, _ = load_for_inference(path, "cpu")
    prompt = torch.tensor([tok.encode("def stream(x):")] * 2)
    new = 24
    max_len = prompt.shape[1] + new

    def run(model):
        logits = []
        g = torch.Generator().manual_seed(7)
        out = generate(
            model,
            prompt,
            new,
            temperature=0.9,
            top_k=50,
            generator=g,
            logits_fn=lambda z: logits.append(z.clone()) or z,
        )
        return out, logits

    want, want_logits = run(ref)
    seen = set()
    for budget in _budgets(ref, max_len, batch=2):
        model, _, _ = load_streaming(path, "cpu", budget, batch=2, max_len=max_len)
        seen.add(len(model.placement.streamed))
        got, got_logits = run(model)
        assert len(got_logits) == len(want_logits) == new
        for a, b in zip(got_logits, want_logits):
            assert torch.equal(a, b)  # bit for bit
        assert torch.equal(got, want)
        assert [tok.decode(r) for r in got.tolist()] == [tok.decode(r) for r in want.tolist()]
        if model.streamer is not None:
            model.streamer.close()
    assert seen == {0, 3, 5, N_LAYERS}  # all resident, some streamed, every block streamed


def test_two_buffers_each_streamed_block_copied_once_per_forward_and_prefetched_ahead(tmp_path):
    path = _save(tmp_path)
    ref, _, _ = load_for_inference(path, "cpu")
    budgets = _budgets(ref, 40)
    model, _, _ = load_streaming(path, "cpu", budgets[2], max_len=40)
    p, st = model.placement, model.streamer
    assert len(p.streamed) == 5 and len(st.slots) == 2
    assert all(s.numel() == p.buffer_bytes for s in st.slots)
    # outside its forward a streamed block holds no weights; the resident parts hold exactly the plan's bytes
    held = {id(t): t for t in model.parameters() if t.device.type != "meta"}
    for i in p.streamed:
        assert all(t.device.type == "meta" for t in model.layers[str(i)].parameters())
    on_device = sum(t.numel() * t.element_size() for t in held.values()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )
    assert on_device + 2 * p.buffer_bytes + kv_cache_bytes(model.cfg, 1, 40) == p.device_bytes

    events = []
    fetch = st._fetch
    st._fetch = lambda i, slot: (events.append(("fetch", i, slot)), fetch(i, slot))[-1]
    for i, block in model.layers.items():
        block.register_forward_pre_hook(lambda m, a, i=int(i): events.append(("run", i, st._running)))
    forwards = 5
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for _ in range(forwards):
            model(x)
    fetches = [e for e in events if e[0] == "fetch"]
    assert st.copies == len(fetches) == len(p.streamed) * forwards + 1  # once each per forward, plus the next one ahead
    order = list(p.streamed)
    runs = [e for e in events if e[0] == "run" and e[1] in order]
    for k, (_, i, slot) in enumerate(runs):
        nxt = order[(order.index(i) + 1) % len(order)]
        # the next streamed block's copy starts as block i starts (hooks run in registration order: the
        # streamer's first), into the other buffer
        at = events.index(runs[k])
        assert events[at - 1][:2] == ("fetch", nxt) and events[at - 1][2] == 1 - slot
    assert st.bytes_copied == sum(st.layouts[e[1]].nbytes for e in fetches)
    st.close()


def test_streams_a_checkpoint_stored_in_pieces(tmp_path):
    """ZeRO-style flat ranges over two files: no memory map applies, the pieces are read at each use."""
    whole = _save(tmp_path)
    reader = ckpt.PieceReader(whole, "model")
    parts = str(tmp_path / "pieces")
    os.makedirs(parts)
    for rank in range(2):
        pieces = {}
        for k in reader.keys():
            t = reader.read(k).reshape(-1)
            half = t.numel() // 2
            a, b = (0, half) if rank == 0 else (half, t.numel())
            pieces[k] = (t[a:b].clone(), {"global_shape": list(reader.global_shape(k)), "flat_range": [a, b]})
        ckpt.save_pieces(pieces, os.path.join(parts, f"model-rank{rank:05d}.safetensors"))
    for name in ("trainer.json", "tokenizer"):
        src = os.path.join(whole, name)
        (os.system(f"cp -r {src} {parts}/") == 0) or pytest.fail("copy failed")
    ckpt.write_manifest(parts)
    assert not any(CheckpointTensors(parts).mapped(k) for k in reader.keys())
    assert all(CheckpointTensors(whole).mapped(k) for k in reader.pieces)  # as stored: fused projections fused
    ref, tok, _ = load_for_inference(whole, "cpu")
    prompt = torch.tensor([tok.encode("pieces")])
    model, _, _ = load_streaming(parts, "cpu", _budgets(ref, 30)[-1], max_len=30)
    assert len(model.placement.streamed) == N_LAYERS
    assert torch.equal(generate(model, prompt, 16, temperature=0), generate(ref, prompt, 16, temperature=0))


@pytest.mark.parametrize("stored", ["fused", "apart"])
def test_a_fused_model_streams_bit_identically(tmp_path, stored):
    """With ``model.fused_proj`` (set, or unset on a machine with CUDA and Triton installed, where it follows the
    kernels -- for a model on the CPU too) the resident model computes q/k/v and gate/up with one matmul each; the
    streamed model must fuse them as well, for its sampled logits to be bit-identical (the fused and the separate
    projections round differently: SiLU of the gate's stride-2 half of the fused output differs in the last bit from
    SiLU of a contiguous gate). A checkpoint written by a fused model holds the fused tensors, copied as they are; one
    written apart with ``fused_proj`` set (as pruning keeps the user's setting) has its parts' rows interleaved into
    the fused weights as they are copied. Some blocks resident (built on the device) and every block streamed."""
    cfg = dataclasses.replace(
        apply_preset(ModelConfig(), "tiny"),
        n_layers=N_LAYERS,
        vocab_size=257,
        max_seq_len=64,
        fused_proj=stored == "fused",
    )
    path = str(tmp_path / stored)
    save_for_inference(build_model(cfg, seed=3), ByteTokenizer(), path)
    if stored == "apart":
        meta = ckpt.read_json(os.path.join(path, "trainer.json"))
        ckpt.write_json(os.path.join(path, "trainer.json"), {**meta, "model": {**meta["model"], "fused_proj": True}})
        ckpt.write_manifest(path)
    tensors = CheckpointTensors(path)
    assert tensors.mapped(f"layers.0.attn.{'qkv' if stored == 'fused' else 'q'}_proj.weight")
    assert "layers.0.attn.k_proj.weight" in tensors.reader
    ref, tok, _ = load_for_inference(path, "cpu")
    assert ref.cfg.fuses_projections
    prompt = torch.tensor([tok.encode("fused")] * 2)
    max_len = prompt.shape[1] + 12

    def run(model):
        logits = []
        generate(
            model,
            prompt,
            12,
            temperature=0.9,
            top_k=50,
            generator=torch.Generator().manual_seed(7),
            logits_fn=lambda z: logits.append(z.clone()) or z,
        )
        return logits

    want = run(ref)
    budgets = _budgets(ref, max_len, batch=2)
    for budget, streamed in ((budgets[2], 5), (budgets[-1], N_LAYERS)):
        model, _, _ = load_streaming(path, "cpu", budget, batch=2, max_len=max_len)
        assert len(model.placement.streamed) == streamed and model.cfg.fuses_projections
        got = run(model)
        assert len(got) == len(want) == 12 and all(torch.equal(a, b) for a, b in zip(got, want))  # bit for bit
        model.streamer.close()


@pytest.mark.parametrize("mode", ["weight", "full"])
def test_streams_an_int8_checkpoint_bit_for_bit(tmp_path, mode):
    """A quantized checkpoint (trickles compress quantize) streams its int8 codes and scales -- a quarter of the fp32
    block's bytes -- and decodes exactly as the resident int8 model, with either matmul."""
    from trickles.compress.checkpoint import load_checkpoint, quantize_checkpoint

    src = _save(tmp_path)
    path = quantize_checkpoint(src, str(tmp_path / "int8"))
    ref, tok, _ = load_checkpoint(path, "cpu", int8=mode)
    float_model, _, _ = load_for_inference(src, "cpu")
    assert block_bytes(ref.layers["0"]) < 0.3 * block_bytes(float_model.layers["0"])
    prompt = torch.tensor([tok.encode("int8")] * 2)
    in_blocks = {id(t) for b in ref.layers.values() for t in [*b.parameters(), *b.buffers()]}
    fixed = (
        kv_cache_bytes(ref.cfg, 2, 30)
        + sum(t.numel() * t.element_size() for t in [*ref.parameters(), *ref.buffers()] if id(t) not in in_blocks)
        + 4096
    )
    model, _, _ = load_streaming(path, "cpu", fixed + 2 * block_bytes(ref.layers["0"]), batch=2, max_len=30, int8=mode)
    assert len(model.placement.streamed) == N_LAYERS
    logits = [[], []]
    for out, m in zip(logits, (model, ref)):
        generate(m, prompt, 12, temperature=0, logits_fn=lambda z, out=out: out.append(z.clone()) or z)
    assert all(torch.equal(a, b) for a, b in zip(*logits)) and len(logits[0]) == 12


def test_a_budget_too_small_says_what_would_fit(tmp_path):
    path = _save(tmp_path)
    with pytest.raises(UserError, match=r"streaming every block still needs [0-9.e-]+ GB"):
        load_streaming(path, "cpu", 10_000, max_len=64)


@pytest.mark.needs_gpu
def test_streamed_generation_on_cuda_is_bit_identical_to_resident(tmp_path):
    path = _save(tmp_path)
    dev = torch.device("cuda")
    ref, tok, _ = load_for_inference(path, dev)
    prompt = torch.tensor([tok.encode("cuda")], device=dev)
    want = ref(prompt)
    for budget in _budgets(ref, 40)[1:]:
        model, _, _ = load_streaming(path, dev, budget, max_len=40)
        assert model.streamer.cuda
        for _ in range(3):  # the buffers cycle: later forwards use prefetched copies
            assert torch.equal(model(prompt), want)
        assert torch.equal(generate(model, prompt, 16, temperature=0), generate(ref, prompt, 16, temperature=0))


# ---- the budget held (CPU, anonymous memory measured in a fresh process) ---------------------

PROBE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "stream_probe.py")
SLACK = 8 << 20  # activations and logits of a 48-position prompt, the copy thread, allocator rounding


def _probe(path, budget, new_tokens=12):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    r = subprocess.run(
        [sys.executable, PROBE, path, str(budget), str(new_tokens)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_half_the_model_as_budget_bounds_anonymous_memory(tmp_path):
    """A ~150 MB fp32 model (8 blocks of 16.8 MB, embeddings and output 16.8 MB) with a budget of half of it:
    the peak anonymous memory above the process's baseline (interpreter, torch, trickles and the kernels'
    imports, measured in the same process before loading) stays within budget + KV cache + SLACK, while the
    resident model in the same measurement exceeds that bound (so the measurement sees the weights)."""
    cfg = dataclasses.replace(
        apply_preset(ModelConfig(), "tiny"),
        n_layers=8,
        d_model=512,
        n_heads=8,
        n_kv_heads=8,
        ffn_hidden=2048,
        vocab_size=4096,
        max_seq_len=128,
    )
    path = str(tmp_path / "big")
    save_for_inference(build_model(cfg, seed=0), ByteTokenizer(), path)
    model_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    budget = model_bytes // 2
    streamed = _probe(path, budget)
    resident = _probe(path, "resident")
    assert len(streamed["streamed"]) >= 6
    assert streamed["ids"] == resident["ids"]
    bound = budget + streamed["kv"] + SLACK
    used, used_resident = streamed["peak"] - streamed["baseline"], resident["peak"] - resident["baseline"]
    assert used <= bound, f"streaming used {used / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB"
    assert used_resident > bound, f"the resident model used {used_resident / 2**20:.1f} MiB, no more than the bound"
