"""Batched decoding and beam search (trickles.infer): a padded batch decodes each prompt as it would alone, seeds,
stop strings, the repetition penalty, the in-place cache reorder, and beam search against transformers' own."""

import dataclasses

import pytest
import torch

from trickles.infer import PaddedBatch, Sampling, beam_search, decode
from trickles.infer.decode import TextTracker, apply_repetition_penalty
from trickles.models import ModelConfig, apply_preset, build_model
from trickles.models.generate import generate

VOCAB = 96
PRESETS = ["tiny", "gpt2-tiny"]


class Letters:
    """One printable character per token id (no multi-byte surprises); the last id is end-of-text."""

    eos_id = VOCAB - 1

    def encode(self, text):
        return [ord(c) - 33 for c in text]

    def decode(self, ids):
        return "".join(chr(33 + i) for i in ids if i != self.eos_id)


def model_for(preset, seed=3, max_seq_len=48):
    cfg = dataclasses.replace(apply_preset(ModelConfig(), preset), vocab_size=VOCAB, max_seq_len=max_seq_len)
    m = build_model(cfg, seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # larger weights than the initialization's: peaked, varied distributions
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return m


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]


GREEDY = Sampling(max_new_tokens=12, temperature=0)


@pytest.mark.parametrize("preset", PRESETS)
def test_padded_batch_decodes_each_prompt_as_alone(preset):
    """Prompts of lengths 3, 11, 7 left-padded into one batch: every step's logits equal the prompt's own (unpadded,
    batch of one) within 1e-5, and greedy tokens are identical."""
    m = model_for(preset)
    prompts = prompts_of([3, 11, 7])
    batched = decode(m, prompts, GREEDY)
    for p, c in zip(prompts, batched):
        [alone] = decode(m, [p], GREEDY)
        assert c.tokens == alone.tokens and len(c.tokens) == 12 and c.finish_reason == "length"
    batch = PaddedBatch(m, prompts, 6)
    assert batch.padded
    singles = [PaddedBatch(m, [p], 6) for p in prompts]
    logits, alone = batch.prefill(), [s.prefill() for s in singles]
    for _ in range(6):
        for i in range(3):
            assert (logits[i] - alone[i][0]).abs().max() <= 1e-5
        nxt = logits.argmax(-1)
        logits = batch.step(nxt)
        alone = [s.step(nxt[i : i + 1]) for i, s in enumerate(singles)]
    # and what padding would do unmasked: a different distribution (the test can tell)
    tokens = batch.tokens[:1]
    assert (m(tokens)[0, -1] - m(tokens[:, batch.pad[0] :])[0, -1]).abs().max() > 1e-3


@pytest.mark.parametrize("preset", PRESETS)
def test_same_length_batch_samples_as_generate(preset):
    """Without padding, one shared generator: the same draws as trickles.models.generate (the trainer's sampler)."""
    m = model_for(preset)
    [p] = prompts_of([5])
    s = Sampling(max_new_tokens=10, temperature=0.9, top_k=20)
    for rows in (3, 1):  # a batch, and one prompt alone (the command's usual case)
        ours = decode(m, [p] * rows, s, generator=torch.Generator().manual_seed(4))
        ref = generate(m, torch.tensor([p] * rows), 10, 0.9, 20, generator=torch.Generator().manual_seed(4))
        assert [c.tokens for c in ours] == ref.tolist()


def test_a_seed_gives_the_same_text_whatever_the_batch():
    m = model_for("tiny")
    prompts = prompts_of([4, 9])
    s = Sampling(max_new_tokens=15, temperature=1.0, top_p=0.9, seed=11)
    [alone] = decode(m, prompts[:1], s)
    again = decode(m, prompts, [s, dataclasses.replace(s, seed=5)])
    assert again[0].tokens == alone.tokens
    assert decode(m, prompts[:1], s)[0].tokens == alone.tokens
    other = decode(m, prompts[:1], dataclasses.replace(s, seed=12))[0]
    assert other.tokens != alone.tokens  # the seed matters (sampling, not argmax)


def test_stop_strings_cut_the_text_and_stop_only_their_row():
    m, tk = model_for("gpt2-tiny"), Letters()
    prompts = prompts_of([4, 9])
    free = decode(m, prompts, Sampling(max_new_tokens=16, temperature=0), tokenizer=tk)
    text = free[0].text
    stop = text[6:8]
    cut = text[: text.find(stop)]
    streamed = {0: [], 1: []}
    reasons = {}

    def on_text(row, delta, reason):
        streamed[row].append(delta)
        if reason is not None:
            reasons[row] = reason

    out = decode(
        m,
        prompts,
        [
            Sampling(max_new_tokens=16, temperature=0, stop=(stop, "\x00never")),
            Sampling(max_new_tokens=16, temperature=0),
        ],
        tokenizer=tk,
        on_text=on_text,
    )
    assert out[0].text == cut and out[0].finish_reason == "stop"
    assert len(out[0].tokens) == text.find(stop) + len(stop)  # it stopped at the token completing the stop string
    assert out[1].text == free[1].text and out[1].finish_reason == "length" and len(out[1].tokens) == 16
    assert "".join(streamed[0]) == cut and "".join(streamed[1]) == free[1].text
    assert reasons == {0: "stop", 1: "length"}


def test_end_of_sequence_stops_a_row():
    m, tk = model_for("tiny"), Letters()
    prompts = prompts_of([4, 9])
    free = decode(m, prompts, Sampling(max_new_tokens=12, temperature=0))
    eos = free[0].tokens[5]
    first = free[0].tokens.index(eos)
    tk.eos_id = eos
    out = decode(m, prompts, Sampling(max_new_tokens=12, temperature=0), eos_id=eos, tokenizer=tk)
    assert out[0].tokens == free[0].tokens[:first] and out[0].finish_reason == "stop"
    second = free[1].tokens.index(eos) if eos in free[1].tokens else None
    assert out[1].tokens == free[1].tokens[:second]


def test_text_tracker_holds_back_a_possible_stop_string():
    t = TextTracker(Letters(), ["XYZ"])
    enc = Letters().encode
    assert not t.update(enc("abcX")) and t.delta(False) == "abc"
    assert not t.update(enc("abcXY")) and t.delta(False) == ""
    assert not t.update(enc("abcXYq")) and t.delta(False) == "XYq"
    assert t.update(enc("abcXYqXYZr")) and t.text == "abcXYq" and t.delta(True) == ""


def test_repetition_penalty_is_hf_definition():
    """By hand: seen tokens 0 and 1 with penalty 2: a positive logit is halved, a negative one doubled, unseen ones
    untouched; and the same as transformers' RepetitionPenaltyLogitsProcessor (which also counts a repeat once)."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, -4.0, 0.0]])
    seen = torch.tensor([[True, True, False, False], [False, False, True, True]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0, 1.5]))
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0], [1.0, 1.0, -6.0, 0.0]]
    transformers = pytest.importorskip("transformers", exc_type=ImportError)
    proc = transformers.RepetitionPenaltyLogitsProcessor(2.0)
    assert proc(torch.tensor([[0, 1, 0]]), logits[:1].clone()).tolist() == out[:1].tolist()


def test_repetition_penalty_changes_greedy_decoding_of_repeats():
    m = model_for("tiny")
    prompts = prompts_of([5])
    plain = decode(m, prompts, Sampling(max_new_tokens=20, temperature=0))[0].tokens
    assert len(set(plain)) < len(plain)  # greedy repeats itself
    ids = decode(m, prompts, Sampling(max_new_tokens=20, temperature=0, repetition_penalty=1e6))[0].tokens
    assert len(set(ids)) == len(ids) and not set(ids) & set(prompts[0])  # a huge penalty: nothing seen comes back


def test_kv_cache_reorder_is_in_place():
    m = model_for("tiny")
    batch = PaddedBatch(m, prompts_of([3, 6, 5, 4]), 4)
    batch.prefill()
    cache = batch.cache
    before = {
        layer: (cache.k[layer].data_ptr(), cache.v[layer].data_ptr(), cache.k[layer].clone()) for layer in cache.k
    }
    index = torch.tensor([2, 2, 0, 3])
    cache.reorder(index)
    for layer, (kp, vp, k) in before.items():
        assert cache.k[layer].data_ptr() == kp and cache.v[layer].data_ptr() == vp
        assert torch.equal(cache.k[layer], k[index])


@pytest.mark.parametrize("preset", PRESETS)
def test_one_beam_is_greedy(preset):
    m = model_for(preset)
    prompts = prompts_of([3, 10])
    greedy = decode(m, prompts, GREEDY)
    eos = greedy[0].tokens[6]
    greedy = decode(m, prompts, GREEDY, eos_id=eos)
    beams = beam_search(m, prompts, 1, 12, eos_id=eos)
    assert [b.tokens for b in beams] == [g.tokens for g in greedy]
    assert [b.finish_reason for b in beams] == [g.finish_reason for g in greedy]


def test_beam_search_with_no_room_returns_empty_completions():
    """``max_new_tokens=0``: nothing is decoded, each prompt gets an empty completion ending for length, its prompt
    length counted."""
    m = model_for(PRESETS[0])
    prompts = prompts_of([3, 10])
    none = beam_search(m, prompts, 2, 0)
    assert [(c.tokens, c.finish_reason, c.prompt_tokens) for c in none] == [([], "length", 3), ([], "length", 10)]


# ---- against transformers ---------------------------------------------------------------------------------------

transformers_cases = [(1.0, False), (0.5, True), (-1.0, False), (2.0, "never")]


def _hf_pair(preset, tmp_path):
    """Our model and transformers' on the same weights: ours exported with save_hf (what ``trickles checkpoint export
    --format hf`` writes) and loaded by transformers."""
    transformers = pytest.importorskip("transformers", exc_type=ImportError)
    from trickles.models import save_hf

    ours = model_for(preset, max_seq_len=32)
    save_hf(ours, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa").eval()
    return hf, ours


# (prompt seed, which greedy token is the end-of-sequence token, [(length penalty, early_stopping)]), 16 new tokens.
# The first row of each runs every mode; the others were found by trying one-line changes of beam.py against it
# (the early-stopping heuristic's length, only the top N candidates may finish, no additions once early_stopping=True
# has N): each of those changes alters the answer in one of these cases.
BEAM_CASES = {
    "tiny": [(1, 5, transformers_cases), (0, 1, [(-1.0, False), (1.0, True)]), (2, 1, [(1.0, True)])],
    "gpt2-tiny": [(1, 5, transformers_cases)],
}


@pytest.mark.parametrize("preset", PRESETS)
def test_beam_search_matches_transformers(preset, tmp_path):
    """A batch of 2 prompts of different lengths, 3 beams, the same weights (ours exported with save_hf): the best
    beam's tokens and its length-normalized score equal transformers' generate(num_beams=3, do_sample=False), for
    length penalties favouring long and short text and each early_stopping mode; the end-of-sequence token is one
    the greedy continuation produces, so beams finish at different lengths."""
    hf, ours = _hf_pair(preset, tmp_path)
    finished = set()
    for seed, which, cases in BEAM_CASES[preset]:
        prompts = prompts_of([4, 9], seed=seed)
        eos = decode(ours, prompts, Sampling(max_new_tokens=16, temperature=0))[0].tokens[which]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
        for lp, early in cases:
            out = beam_search(ours, prompts, 3, 16, length_penalty=lp, early_stopping=early, eos_id=eos)
            with torch.no_grad():
                ref = hf.generate(
                    ids,
                    attention_mask=mask,
                    num_beams=3,
                    do_sample=False,
                    length_penalty=lp,
                    early_stopping=early,
                    max_new_tokens=16,
                    eos_token_id=eos,
                    pad_token_id=0,
                    output_scores=True,
                    return_dict_in_generate=True,
                )
            for b in range(2):
                row = ref.sequences[b, width:].tolist()
                reason = "stop" if eos in row else "length"
                row = row[: row.index(eos)] if eos in row else row
                assert out[b].tokens == row, (seed, lp, early, b)
                assert out[b].finish_reason == reason
                assert abs(out[b].score - float(ref.sequences_scores[b])) <= 1e-4 * abs(out[b].score)
                finished.add(reason)
    assert finished == {"stop", "length"}  # both ways of ending were compared
