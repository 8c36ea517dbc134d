"""The activation formulas of Korthikanti et al. (2022) for a GPT layer, against this library's prediction, piece
by piece: equal where the implementation saves the same tensors, the documented difference where it does not
(:mod:`trickles.memory.korthikanti`). gpt2-small's shapes (h = 768, a = 12, f = 4h), s = 1024, b = 2, 16-bit,
dropout 0.1; the measured side of the library's formula is held to the saved-tensor meter by the other tests."""

import dataclasses

import pytest

from trickles.memory.activations import activation_bytes
from trickles.memory.korthikanti import korthikanti_layer_bytes, korthikanti_terms
from trickles.models import ModelConfig, apply_preset

S, B = 1024, 2
GPT = dataclasses.replace(apply_preset(ModelConfig(), "gpt2-small"), dropout=0.1)
H, A = GPT.d_model, GPT.n_heads
SBH, AS2B, SB = S * B * H, A * S * S * B, S * B


def _ours(device, tp=1, sp=False, recompute="none"):
    got = activation_bytes(GPT, B, S, recompute, dtype_bytes=2, device_type=device, tp=tp, sequence_parallel=sp)
    assert sum(got["terms"].values()) == got["layer"]  # the pieces are the prediction
    return got["terms"]


LAYOUTS = [(1, False), (2, False), (4, False), (4, True)]


@pytest.mark.parametrize("tp,sp", LAYOUTS)
def test_the_papers_pieces_add_up_to_its_closed_forms(tp, sp):
    for selective in (False, True):
        terms = korthikanti_terms(S, B, H, A, tp, sp, selective)
        assert sum(terms.values()) == pytest.approx(korthikanti_layer_bytes(S, B, H, A, tp, sp, selective), rel=1e-12)
    assert korthikanti_layer_bytes(S, B, H, A) == SBH * (34 + 5 * A * S / H)
    assert (
        korthikanti_layer_bytes(S, B, H, A, selective=True)
        == korthikanti_layer_bytes(S, B, H, A, flash=True)
        == 34 * SBH
    )


@pytest.mark.parametrize("tp,sp", LAYOUTS)
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_fused_attention_with_dropout_matches_the_paper_but_the_norms_statistics_and_the_log_sum_exp(tp, sp, recompute):
    """CUDA: the fused kernel stores no score matrix (the paper's FlashAttention case) and keeps the fp32
    log-sum-exp ``4asb/t`` (dropped by selective recomputation); the masks are 1 byte; LayerNorm under autocast keeps
    an fp32 copy of its input and its mean and 1/std (``2sbh + 8sb`` more a norm, on the tokens it sees)."""
    ours = _ours("cuda", tp, sp, recompute)
    theirs = korthikanti_terms(S, B, H, A, tp, sp, selective=recompute == "selective", flash=True)
    whole = tp if sp else 1
    assert ours["mlp"] == theirs["mlp"]
    assert ours["dropout masks"] == theirs["dropout masks"]
    assert ours["attention"] - theirs["attention"] == (4 * SB * A // tp if recompute == "none" else 0)
    assert ours["norms"] - theirs["norms"] == 2 * (2 * SBH + 8 * SB) // whole


@pytest.mark.parametrize("tp,sp", LAYOUTS)
def test_cpu_math_attention_keeps_fp32_scores_and_16_bit_masks(tp, sp):
    """A CPU: attention with dropout runs SDPA's math path -- fp32 Q, K, V (``+6sbh/t``) and fp32 probabilities,
    keep-mask and dropped probabilities (``12as^2b/t`` for the paper's ``5as^2b/t``, its 1-byte mask counted with
    the masks there); each residual dropout keeps a 2-byte scaled mask; LayerNorm keeps its 16-bit mean and 1/std."""
    ours = _ours("cpu", tp, sp)
    theirs = korthikanti_terms(S, B, H, A, tp, sp)
    whole = tp if sp else 1
    assert ours["mlp"] == theirs["mlp"]
    assert ours["attention"] - theirs["attention"] == 6 * SBH // tp + 8 * AS2B // tp
    assert ours["dropout masks"] - theirs["dropout masks"] == 2 * SBH // whole - AS2B // tp
    assert ours["norms"] - theirs["norms"] == 2 * 4 * SB // whole
    # selective recomputation: exactly the paper's attention (Q, K, V, the projections' inputs), the 5as/h term gone
    sel = _ours("cpu", tp, sp, "selective")
    theirs_sel = korthikanti_terms(S, B, H, A, tp, sp, selective=True)
    assert sel["attention"] == theirs_sel["attention"]
    assert sel["dropout masks"] - theirs_sel["dropout masks"] == 2 * SBH // whole
