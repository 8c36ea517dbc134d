"""A weighted mixture of sources (:mod:`trickles.data.mixture`): the ``[[data.sources]]`` tables and their refusals,
the sampler's shares (over 200 steps of three sources, each source's tokens within 2% of its weight), the per-source
counts of metrics.jsonl (the tokens that are data, and the trained targets, the batches held), its batches
being a pure function of seed and position (so a resume, or another data-parallel degree, continues the mixture where
it was), and each source going through its own windows epoch by epoch."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trickles.config import Config, describe_keys
from trickles.data import DataConfig, ShardedBatches
from trickles.data.mixture import BLOCK, CHUNK, MixedBatches, Mixture, MixtureSampler, derived_seed, source_names
from trickles.data.sources import check_source, iter_documents, source_fingerprint
from trickles.errors import ConfigError, DataError

WEIGHTS = [0.5, 0.3, 0.2]
SEQ = 8


def _mixed(weights=WEIGHTS, seed=11, dp_rank=0, dp_size=1, lengths=(400, 250, 90)):
    """Source ``s``'s tokens are ``1000 * (s + 1) + position``, so a row says which source and window it came from."""
    parts = [
        ShardedBatches(1000 * (s + 1) + np.arange(n, dtype=np.int64), SEQ, derived_seed(seed, s), dp_rank, dp_size)
        for s, n in enumerate(lengths)
    ]
    return MixedBatches([f"s{i}" for i in range(len(lengths))], MixtureSampler(weights, seed), parts)


def _rows(data, consumed, global_batch=8, micro_batch=2):
    return np.concatenate([x.numpy() for x, _ in data.micro_batches(consumed, global_batch, micro_batch)])


def test_three_sources_over_200_steps_take_their_weights_within_two_percent():
    data, tokens = _mixed(), np.zeros(3)
    for step in range(200):
        rows = _rows(data, step * 8)
        tokens += np.bincount(rows[:, 0] // 1000 - 1, minlength=3) * SEQ  # what the batches really hold
        counted = data.source_tokens((step + 1) * 8)
        assert list(counted.values()) == tokens.tolist()  # metrics.jsonl's source_tokens is what was trained on
    share = tokens / tokens.sum()
    assert np.all(np.abs(share - WEIGHTS) <= 0.02 * np.array(WEIGHTS)), share
    # the stratified draw stays within a few samples of the weights at every step (6 at most here, inside a block;
    # independent draws stray by about sqrt(1600 / 4) = 20 by the end), and within two at block ends over a long run
    counts = np.array([data.sampler.counts(n) for n in range(0, 1601, 8)])
    assert np.abs(counts - np.outer(range(0, 1601, 8), WEIGHTS)).max() <= 6
    ends = np.array([data.sampler.counts(n) for n in range(0, 10**6, 16 * BLOCK)])
    assert np.abs(ends - np.outer(range(0, 10**6, 16 * BLOCK), WEIGHTS)).max() < 2


PAD = 7  # the synthetic chat source's padding token


def _packed(n_sequences=12, seed=0):
    """A chat source as :mod:`trickles.data.chat` packs one: sequences of ``SEQ`` tokens holding whole conversations
    (``START`` on the first token, ``TRAINED`` on some of the others) and then padding (``PAD``; ``START`` on its
    first token), one padding token after the last; tokens ``3000 + position`` but the padding."""
    from trickles.data.loader import START, TRAINED

    rng = np.random.default_rng(seed)
    tokens, flags = [], []
    for _ in range(n_sequences):
        used = 0
        while SEQ - used >= 2 and (used == 0 or rng.random() < 0.4):
            n = int(rng.integers(2, SEQ - used + 1))
            f = np.where(rng.random(n) < 0.5, TRAINED, 0)
            f[0], f[rng.integers(1, n)] = START, TRAINED
            tokens += [3000 + len(tokens) + i for i in range(n)]
            flags += f.tolist()
            used += n
        tokens += [PAD] * (SEQ - used)
        flags += [START] + [0] * (SEQ - used - 1) if used < SEQ else []
    return np.array(tokens + [PAD]), np.array(flags + [START], dtype=np.uint8)


def test_source_counts_are_the_data_and_trained_tokens_the_batches_held():
    """metrics.jsonl's ``source_tokens`` counts the tokens drawn from each source that are data -- a chat source's
    padding left out -- and ``source_trained_tokens`` the targets that took a loss, exactly what the batches held; at
    any point, asked by a fresh loader (a resume) or step by step, across the chat source's epochs."""
    chat, flags = _packed()

    def mixed():
        parts = [
            ShardedBatches(1000 * (s + 1) + np.arange(n), SEQ, derived_seed(11, s)) for s, n in enumerate((400, 250))
        ]
        parts.append(ShardedBatches(chat, SEQ, derived_seed(11, 2), flags=flags))
        return MixedBatches(["s0", "s1", "s2"], MixtureSampler(WEIGHTS, 11), parts)

    data, tokens, trained = mixed(), np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int64)
    assert (chat == PAD).sum() > 12 and data.parts[2].n_windows == 12
    for step in range(60):  # (about 96 samples of the chat source: 8 epochs of its 12 windows)
        batch = data.micro_batches(step * 8, 8, 2)
        x, y = (np.concatenate([b[i].numpy() for b in batch]) for i in (0, 1))
        source = x[:, 0] // 1000 - 1
        tokens += np.bincount(source, weights=(x != PAD).sum(1), minlength=3).astype(np.int64)
        trained += np.bincount(source, weights=(y != -100).sum(1), minlength=3).astype(np.int64)
        got = json.loads(json.dumps(data.source_counts((step + 1) * 8)))  # (as metrics.jsonl writes it)
        assert got == {
            "source_tokens": dict(zip(data.names, tokens.tolist())),
            "source_trained_tokens": dict(zip(data.names, trained.tolist())),
        }
    assert tokens[2] < data.sampler.counts(480)[2] * SEQ and trained[2] < tokens[2]  # padding and prompts left out
    assert tokens[0] == trained[0] == data.sampler.counts(480)[0] * SEQ  # a text source: every token of every sample
    for consumed in (0, 8, 96, 480):
        assert mixed().source_counts(consumed) == data.source_counts(consumed)


def test_every_sample_is_of_each_source_with_its_weight():
    """Weights whose shares of a block are not whole numbers: the left-over samples go out with the right odds, so the
    shares over many blocks converge to the weights (not to the rounded quotas)."""
    weights = [1.0, 1.0, 1.0, 0.37]
    sampler = MixtureSampler(weights, seed=5)
    n = 600 * BLOCK
    share = sampler.counts(n) / n
    p = np.array(weights) / sum(weights)
    assert np.abs(share - p).max() < 5e-5, share - p  # (1.7e-5 measured)
    floor_share = np.floor(BLOCK * p) / BLOCK
    assert np.abs(share - floor_share).max() > 1e-3  # not just the rounded quotas


def test_draws_are_a_pure_function_of_seed_and_position():
    """Any span, asked in any order by a fresh or a used sampler, across block and chunk boundaries, gives the same
    sources and numbers; each source's numbers count its samples 0, 1, 2, ... in order."""
    first = CHUNK * BLOCK - 100  # a chunk boundary in the middle
    whole = MixtureSampler(WEIGHTS, 3).draw(first, 300)
    used = MixtureSampler(WEIGHTS, 3)
    pieces = [used.draw(first + a, b - a) for a, b in ((200, 300), (0, 37), (37, 200))]
    order = [1, 2, 0]
    for i in range(2):
        assert np.array_equal(np.concatenate([pieces[k][i] for k in order]), whole[i])
    src, num = MixtureSampler(WEIGHTS, 3).draw(0, 5000)
    for s in range(3):
        assert np.array_equal(num[src == s], np.arange((src == s).sum()))
    assert not np.array_equal(MixtureSampler(WEIGHTS, 4).draw(0, 300)[0], src[:300])  # the seed matters


def test_resume_and_another_data_parallel_degree_continue_the_mixture():
    straight = _mixed()
    for step in range(5):
        _rows(straight, step * 8)
    expected = _rows(straight, 5 * 8)
    assert np.array_equal(_rows(_mixed(), 5 * 8), expected)  # a fresh loader at the resumed position
    halves = [_rows(_mixed(dp_rank=r, dp_size=2), 5 * 8) for r in range(2)]
    assert np.array_equal(np.concatenate(halves), expected)  # dp2's ranks together are dp1's batch


def test_each_source_goes_through_its_windows_epoch_by_epoch():
    """Source 2 (90 tokens: 11 windows) is drawn about 2 * 320 times over 1,600 samples: every run of 11 of its samples
    is one epoch, each of its windows once, in an order of its own."""
    data = _mixed()
    rows = np.concatenate([_rows(data, step * 8) for step in range(200)])
    starts = rows[rows[:, 0] // 1000 == 3][:, 0] - 3000  # the window each sample of source 2 began at
    n = (90 - 1) // SEQ
    epochs = [sorted(starts[i : i + n]) for i in range(0, len(starts) - n + 1, n)]
    assert len(epochs) > 20 and all(e == list(range(0, n * SEQ, SEQ)) for e in epochs)
    assert len({tuple(starts[i : i + n]) for i in range(0, len(starts) - n + 1, n)}) > 1  # reshuffled every epoch


def test_batches_carry_document_ids_and_refuse_a_source_shorter_than_a_window():
    eos = 1002  # (a token of source 0)
    parts = [ShardedBatches(1000 * (s + 1) + np.arange(200), SEQ, s, eos_id=eos) for s in range(2)]
    batch = MixedBatches(["a", "b"], MixtureSampler([1, 1], 0), parts).micro_batches(0, 4, 4)[0]
    assert len(batch) == 4 and batch[2] is None and tuple(batch[3].shape) == (4, SEQ)
    short = _mixed(lengths=(400, 250, SEQ))
    with pytest.raises(Exception, match="s2"):
        short.micro_batches(0, 64, 64)


# ---- the [[data.sources]] tables --------------------------------------------------------------


def _load(tmp_path, text: str) -> Config:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return Config.load(str(path))


def test_sources_tables_load_validate_name_and_round_trip(tmp_path):
    cfg = _load(
        tmp_path,
        '[data]\ntext_field = "body"\n'
        '[[data.sources]]\npath = "web/*.parquet"\nweight = 3\n'
        '[[data.sources]]\npath = "code.jsonl"\nweight = 1.5\nname = "code"\ntext_field = "content"\n'
        '[[data.sources]]\npath = "more/code.jsonl"\n',
    )
    cfg.validate(1)
    s = cfg.data.sources
    assert [x.weight for x in s] == [3.0, 1.5, 1.0] and s[1].text_field == "content"
    assert source_names(cfg.data) == ["web", "code", "code-3"]  # a glob's is its directory's
    per = cfg.data.per_source()
    assert [p.source for p in per] == ["web/*.parquet", "code.jsonl", "more/code.jsonl"]
    assert [p.text_field for p in per] == ["body", "content", "body"] and all(not p.sources for p in per)
    again = tmp_path / "again.toml"
    again.write_text(cfg.to_toml())  # trickles config's output reads back
    assert Config.load(str(again)).data.sources == s
    assert Config.from_dict(cfg.to_dict()).data.sources == s  # as a checkpoint's trainer.json holds it
    line = Config.load(None, ["data.sources=a.jsonl:2,b.parquet"]).data.sources  # the command line's form
    assert [(x.path, x.weight) for x in line] == [("a.jsonl", 2.0), ("b.parquet", 1.0)]
    keys = describe_keys()
    for key in ("data.sources[].path", "data.sources[].weight", "data.sources[].format", "data.dataset_split"):
        assert key in keys


@pytest.mark.parametrize(
    "table, words",
    [
        ('path = "a.jsonl"\nweight = 0', ["data.sources[1]", "weight 0", "positive"]),
        ('path = "a.jsonl"\nweight = -2.5', ["weight -2.5", "positive"]),
        ('path = "a.jsonl"\nweight = nan', ["weight nan", "positive"]),
        ('path = "a.jsonl"\nformat = "csv"', ["data.sources[1].format", "'csv'"]),
        (
            'path = "a.jsonl"\nwieght = 2',
            ["unknown key 'data.sources[1].wieght'", "did you mean 'data.sources[1].weight'"],
        ),
        ("weight = 2", ["data.sources[1] has no path"]),
        ('path = "a.jsonl"\nweight = "much"', ["data.sources[1].weight must be a number"]),
    ],
)
def test_bad_sources_are_one_line_before_any_process(tmp_path, table, words):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, f"[[data.sources]]\n{table}\n").validate(1)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_conflicting_source_settings_are_refused(tmp_path):
    for text, words in (
        ('[data]\nsource = "x.txt"\n[[data.sources]]\npath = "a.jsonl"\n', ["both give the data"]),
        ('[[data.sources]]\npath = "a.jsonl"\nname = "x"\n[[data.sources]]\npath = "b.jsonl"\nname = "x"\n', ["x"]),
        ('[data]\nlabel_field = "lang"\n[[data.sources]]\npath = "a.jsonl"\n', ["data.label_field"]),
    ):
        with pytest.raises(ConfigError) as e:
            _load(tmp_path, text).validate(1)
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_every_source_is_checked_read_and_fingerprinted(tmp_path):
    """check_source looks at every source (before any process starts), a BPE trains on every text source's documents
    in turn, and the tokenizer's cache key covers every source."""
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.jsonl").write_text('{"body": "beta"}\n{"body": "gamma"}\n')
    two = f"[[data.sources]]\npath = '{tmp_path}/a.txt'\n[[data.sources]]\npath = '{tmp_path}/b.jsonl'\n"
    cfg = _load(tmp_path, f"[data]\ntext_field = 'body'\n{two}").data
    check_source(cfg)
    assert list(iter_documents(cfg)) == ["alpha", "beta", "gamma"]
    one = DataConfig(source=f"{tmp_path}/a.txt", text_field="body")
    assert source_fingerprint(cfg)[0] == [None, source_fingerprint(one)] and len(source_fingerprint(cfg)) == 2
    (tmp_path / "b.jsonl").unlink()
    with pytest.raises(DataError, match="b.jsonl"):
        check_source(cfg)


def test_the_mixtures_validation_loss_is_weighted_by_the_shares():
    mix = Mixture(["a", "b", "c"], [0.5, 0.3, 0.2], [])
    assert mix.weighted({"a": 1.0, "b": 2.0, "c": 4.0}) == pytest.approx(0.5 + 0.6 + 0.8)
    assert mix.weighted({"a": 1.0, "c": 4.0}) == pytest.approx((0.5 + 0.8) / 0.7)  # a source without held-out data
    assert DataConfig().per_source() == [DataConfig()]
