"""Sliding-window attention (``model.sliding_window``, ``model.window_layers``): Mistral and Qwen2 against
transformers on sequences longer than the window (fp32 logits within 1e-5 relative to the largest, greedy
generation token-identical, export reloaded as the same class), the KV cache and left-padded batches past the
window, packed documents with a window against each document alone, and the one-line refusals.

transformers' mask (``masking_utils.sliding_window_overlay``): query ``q`` sees key ``k`` iff ``q - window < k <= q``.
"""

import dataclasses
import json

import pytest
import torch
from test_documents import EOS, _packed, _spans
from test_families import SHAPE, VOCAB, assert_close

from trickles.config import Config
from trickles.errors import CheckpointError, ConfigError
from trickles.infer.decode import Sampling, decode
from trickles.models import ModelConfig, build_model, load_hf, save_hf
from trickles.models.documents import DocumentMask, block_mask, document_ids, flex_attention, reference_attention
from trickles.models.generate import generate
from trickles.models.hf_config import config_from_hf, config_to_hf
from trickles.models.masks import window_mask
from trickles.models.presets import apply_preset

transformers = pytest.importorskip("transformers", exc_type=ImportError)

WINDOW, LONG, NEW = 8, 40, 16
CASES = {
    # every layer slides (Mistral v0.1's layout, a window of 8)
    "mistral": (transformers.MistralConfig, dict(sliding_window=WINDOW), "MistralForCausalLM"),
    # Qwen2: the first max_window_layers layers keep full attention, the others slide
    "qwen2-max-window-layers": (
        transformers.Qwen2Config,
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        "Qwen2ForCausalLM",
    ),
    # Qwen2 with an explicit pattern (the first layer slides, the second does not)
    "qwen2-layer-types": (
        transformers.Qwen2Config,
        dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
        "Qwen2ForCausalLM",
    ),
}
PATTERN = {"mistral": None, "qwen2-max-window-layers": [False, True], "qwen2-layer-types": [True, False]}


def hf_windowed(name):
    config_class, extra, _ = CASES[name]
    with torch.random.fork_rng():
        torch.manual_seed(29 + list(CASES).index(name))
        model = transformers.AutoModelForCausalLM.from_config(
            config_class(**SHAPE, **extra), attn_implementation="sdpa"
        )
    g = torch.Generator().manual_seed(5 + list(CASES).index(name))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def long_tokens():
    return torch.randint(3, VOCAB, (2, LONG), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", list(CASES))
@torch.no_grad()
def test_windowed_families_import_generate_and_export_like_transformers(name, tmp_path):
    hf = hf_windowed(name)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf").eval()
    assert (ours.cfg.sliding_window, ours.cfg.window_layers) == (WINDOW, PATTERN[name])
    x = long_tokens()
    theirs = hf(x).logits
    assert_close(ours(x).float(), theirs)
    # one position more or less of window is far outside the tolerance: the test sees an off-by-one
    for wrong in (WINDOW - 1, WINDOW + 1):
        off = build_model(dataclasses.replace(ours.cfg, sliding_window=wrong), seed=0).eval()
        off.load_state_dict(ours.state_dict())
        err = (off(x).float() - theirs).abs().max() / theirs.abs().max()
        assert err > 1e-3, (wrong, err)

    # greedy decoding through the KV cache, 12 + 16 positions (past the window of 8)
    prompt = x[:1, :12]
    want = hf.generate(prompt, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW, pad_token_id=0)
    assert torch.equal(generate(ours, prompt, NEW, temperature=0.0), want[:, 12:])
    # left-padded batch decoding (prompts of 12 and 5 tokens) gives each row what it gives alone
    short = x[1:, :5]
    rows = decode(ours, [x[0, :12].tolist(), short[0].tolist()], Sampling(max_new_tokens=NEW, temperature=0.0))
    assert rows[0].tokens == want[0, 12:].tolist()
    assert rows[1].tokens == generate(ours, short, NEW, temperature=0.0)[0].tolist()

    save_hf(ours, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == [CASES[name][2]] and written["sliding_window"] == WINDOW
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="sdpa").eval()
    assert back.config.sliding_window == WINDOW
    assert torch.equal(back(x).logits, theirs)


def test_window_mask_is_transformers_band():
    m = window_mask(3, 4, 8, 2, "cpu")  # queries at positions 3..6 over keys 0..7, each sees itself and one before
    assert m.tolist() == [[k in (q - 1, q) for k in range(8)] for q in range(3, 7)]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_dense_and_flex_document_masks_take_the_window():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 40, 8, generator=g)
    k, v = torch.randn(2, 2, 40, 8, generator=g), torch.randn(2, 2, 40, 8, generator=g)
    ids = document_ids(_packed(2, 40)[:, :40], EOS)
    want = reference_attention(q, k, v, ids, window=5)
    assert (want - reference_attention(q, k, v, ids)).abs().max() > 1e-2
    assert (DocumentMask(ids, "dense").attend(q, k, v, window=5) - want).abs().max() <= 1e-5
    assert (flex_attention(q, k, v, block_mask=block_mask(ids, 5), enable_gqa=True) - want).abs().max() <= 1e-5


@torch.no_grad()
def test_packed_documents_with_a_window_attend_as_each_document_alone():
    """Document mask AND window (layer 0 slides, layer 1 does not): each packed document's logits are its logits
    run alone (the 20-token document is longer than the window of 6)."""
    cfg = apply_preset(ModelConfig(preset="tiny"), "tiny")
    cfg.vocab_size, cfg.max_seq_len, cfg.sliding_window, cfg.window_layers = 256, 64, 6, [True, False]
    model = build_model(cfg, seed=3).eval()
    x = _packed(2, 32)[:, :-1]
    ids = document_ids(x, EOS)
    packed = model(x, documents=ids)
    for r in range(x.shape[0]):
        for a, b in _spans(ids[r]):
            assert (packed[r, a:b] - model(x[r : r + 1, a:b])[0]).abs().max() <= 1e-5
    assert (packed - model(x)).abs().max() > 1e-2  # the mask matters


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(sliding_window=0), "model.sliding_window must be at least 1 or none, got 0"),
        (dict(sliding_window=4, window_layers=[True]), "model.window_layers has 1 entries; give 2"),
    ],
)
def test_bad_windows_refused_in_one_line(changes, message):
    with pytest.raises(ConfigError, match=message):
        build_model(
            ModelConfig(n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, vocab_size=64, max_seq_len=16, **changes),
            seed=0,
        )


def test_windows_at_least_the_context_are_accepted_and_qwen_types_checked():
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, vocab_size=64, max_seq_len=16, sliding_window=64)
    x = torch.randint(0, 64, (1, 16))
    with torch.no_grad():
        windowed = build_model(cfg, seed=1).eval()(x)
        plain = build_model(dataclasses.replace(cfg, sliding_window=None), seed=1).eval()(x)
    assert torch.equal(windowed, plain)
    base = transformers.Qwen2Config(**SHAPE).to_dict()
    with pytest.raises(CheckpointError, match="use_sliding_window is false"):
        config_from_hf({**base, "layer_types": ["sliding_attention", "full_attention"]}, "config.json")
    with pytest.raises(CheckpointError, match="only sliding_attention and full_attention"):
        config_from_hf({**base, "use_sliding_window": True, "layer_types": ["chunked_attention"] * 2}, "config.json")
    with pytest.raises(ConfigError, match="Mistral's sliding window applies to every layer"):
        config_to_hf(dataclasses.replace(cfg, family="mistral", window_layers=[True, False]), torch.float32)


@pytest.mark.parametrize(
    "sets, world, message",
    [
        (
            ["parallel.tp=4", "parallel.tp_mode=2d", "model.n_kv_heads=4", "train.micro_batch=2"],
            4,
            "model.sliding_window (8) shorter than data.seq_len does not combine with parallel.tp_mode=2d",
        )
    ],
)
def test_layouts_without_windows_refuse_them_in_one_line(sets, world, message):
    cfg = Config.load(None, ["model.sliding_window=8", "data.seq_len=64", *sets])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        cfg.validate(world)
    assert "\n" not in str(e.value)
    cfg.model.sliding_window = 64  # a window as long as the sequence never cuts: accepted
    cfg.validate(world)
