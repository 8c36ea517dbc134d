"""Gemma 2/3's architecture pieces, each against transformers' own modules (weights copied by hand, no importer):
the ``(1 + w)`` RMSNorm and GeGLU keeping only what their kernels keep (PyTorch and, in Triton's interpreter, Triton),
soft-capped attention under every mask the model builds, the embedding scale, ``query_pre_attn_scalar``, final-logit
soft-capping unfused and inside the fused loss, and the sliding layers' own rotary base. Whole tiny models: fp32 logits
within 1e-5 of ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` (relative to the largest), gradients too, decoding with
the KV cache past the window."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from trickles.errors import ConfigError
from trickles.kernels.activations import GeGLUFunction, geglu, geglu_packed
from trickles.kernels.cross_entropy import cross_entropy, linear_cross_entropy
from trickles.kernels.norms import RMSNorm
from trickles.kernels.softcap import softcap
from trickles.models.config import ModelConfig
from trickles.models.documents import DocumentMask, dense_mask
from trickles.models.masks import padded_attention_mask, window_mask
from trickles.models.transformer import Attention, build_model, initial_value

transformers = pytest.importorskip("transformers", exc_type=ImportError)
from transformers.models.gemma2 import modeling_gemma2 as g2  # noqa: E402

TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
HF_SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    sliding_window=6,
    query_pre_attn_scalar=24,
    final_logit_softcapping=3.0,
    rms_norm_eps=1e-6,
    layer_types=TYPES,
    attn_implementation="eager",
)
GEMMA = dict(
    n_layers=4,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    head_size=16,
    ffn_hidden=48,
    vocab_size=64,
    max_seq_len=64,
    norm_eps=1e-6,
    norm_placement="sandwich",
    norm_unit_offset=True,
    mlp_activation="gelu_tanh",
    embed_scale=True,
    query_pre_attn_scalar=24.0,
    final_softcap=3.0,
    sliding_window=6,
    window_layers=[t == "sliding_attention" for t in TYPES],
    tie_embeddings=True,
    kernels="torch",
)
NAMES = {
    "model.embed_tokens": "embed",
    "model.norm": "norm",
    "model.layers": "layers",
    "lm_head": "output",
    "self_attn": "attn",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "attn_post_norm",
    "pre_feedforward_layernorm": "mlp_norm",
    "post_feedforward_layernorm": "mlp_post_norm",
}


def _saved(fn, *args):
    """The output of ``fn(*args)`` and the tensors autograd saved for its backward."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(*args)
    return out, saved


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_unit_offset_rms_norm_is_gemmas_and_keeps_what_the_kernel_keeps(kernels):
    if kernels == "triton":
        pytest.importorskip("triton")
    g = torch.Generator().manual_seed(0)
    ref = g2.Gemma2RMSNorm(24, eps=1e-6)
    ours = RMSNorm(24, 1e-6, kernels, offset=True)
    assert not ours.weight.any()  # starts at 0: scales by 1 + w
    with torch.no_grad():
        ref.weight.copy_(torch.randn(24, generator=g) * 0.5)
        ours.weight.copy_(ref.weight)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2.0**-7)):
        x = (torch.randn(3, 5, 24, generator=g) * 3).to(dtype).requires_grad_()
        y, saved = _saved(ours, x)
        assert y.dtype == dtype  # cast to x's type at the end, as Gemma's
        stats = [t for t in saved if t.data_ptr() not in (x.data_ptr(), ours.weight.data_ptr())]
        assert len(saved) == 3 and len(stats) == 1  # x, the weight and the fp32 1/rms per row: nothing more
        assert stats[0].numel() == 15 and stats[0].dtype == torch.float32
        want = ref(x)
        assert _rel(y.float(), want.float()) <= tol
        dy = torch.randn(y.shape, generator=g).to(dtype)
        got, exp = torch.autograd.grad(y, (x, ours.weight), dy), torch.autograd.grad(want, (x, ref.weight), dy)
        for a, b in zip(got, exp):
            assert _rel(a.float(), b.float()) <= (1e-5 if dtype == torch.float32 else 2.0**-6)
    cfg = ModelConfig(**GEMMA, qk_norm="head")
    for name in ("layers.0.attn_norm.weight", "layers.1.attn.q_norm.weight", "norm.weight"):
        assert not initial_value(cfg, name, (16,), 0).any()


def test_geglu_is_gelu_tanh_times_up_bit_for_bit_and_saves_only_its_inputs():
    g = torch.Generator().manual_seed(1)
    a64, b64 = (torch.randn(3, 7, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    assert torch.autograd.gradcheck(GeGLUFunction.apply, (a64, b64))
    a, b = (torch.randn(4, 9, generator=g).mul(3).requires_grad_() for _ in range(2))
    ref = F.gelu(a, approximate="tanh") * b  # transformers' ACT2FN["gelu_pytorch_tanh"](gate) * up
    h, saved = _saved(geglu, a, b)
    assert {t.data_ptr() for t in saved} == {a.data_ptr(), b.data_ptr()} and len(saved) == 2
    assert torch.equal(h, ref)
    dh = torch.randn(h.shape, generator=g)
    for x, y in zip(torch.autograd.grad(h, (a, b), dh), torch.autograd.grad(ref, (a, b), dh)):
        assert torch.equal(x, y)
    ab = torch.randn(4, 18, generator=g).requires_grad_()  # a fused gate/up output: gate even, up odd
    packed = geglu_packed(ab)
    parts = ab.detach().unflatten(-1, (-1, 2)).unbind(-1)
    assert torch.equal(packed, F.gelu(parts[0], approximate="tanh") * parts[1])
    (dab,) = torch.autograd.grad(packed, ab, dh)
    assert torch.equal(dab, torch.autograd.grad(F.gelu(ab[..., 0::2], approximate="tanh") * ab[..., 1::2], ab, dh)[0])
    pytest.importorskip("triton")
    assert _rel(geglu(a, b, "triton"), ref) <= 1e-6
    tri = geglu_packed(ab, "triton")
    assert _rel(tri, packed) <= 1e-6
    assert _rel(torch.autograd.grad(tri, ab, dh)[0], dab) <= 1e-5


def _eager(q, k, v, mask, scale, cap):
    """transformers' Gemma 2 eager attention (repeat_kv, additive mask, fp32 softmax) on a boolean mask."""
    module = SimpleNamespace(head_dim=q.shape[-1], num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    out, _ = g2.eager_attention_forward(module, q, k, v, additive, scaling=scale, softcap=cap)
    return out.transpose(1, 2)


def test_capped_attention_under_causal_window_padding_paged_and_document_masks():
    cfg = ModelConfig(**dict(GEMMA, attn_softcap=1.5, sliding_window=5, window_layers=None))
    attn = Attention(cfg, 0).eval()
    assert (attn.scale, attn.softcap, attn.window, attn.rope_part) == (24.0**-0.5, 1.5, 5, 0)
    g = torch.Generator().manual_seed(2)
    b, t, s = 2, 9, 12
    q = torch.randn(b, 4, t, 16, generator=g) * 2
    k, v = (torch.randn(b, 2, s, 16, generator=g) * 2 for _ in range(2))
    ref = lambda mask: _eager(q, k, v, mask, attn.scale, 1.5)  # noqa: E731
    kt, vt, band = k[:, :, :t], v[:, :, :t], window_mask(3, t, s, 5, q.device)
    training = _eager(q, kt, vt, window_mask(0, t, t, 5, q.device), attn.scale, 1.5)
    assert _rel(attn._attend(q, kt, vt, None), training) <= 1e-6  # causal, window, no cache
    assert _rel(training, _eager(q, kt, vt, window_mask(0, t, t, 5, q.device), None, 1.5)) > 1e-2  # scale matters
    assert (
        _rel(training, _eager(q, kt, vt, window_mask(0, t, t, 5, q.device), attn.scale, None)) > 1e-2
    )  # so does the cap
    assert _rel(attn._attend(q, k, v, 3), ref(band)) <= 1e-6  # a cache: queries at 3..11
    pad = torch.ones(b, s, dtype=torch.bool)
    pad[0, :2] = False
    assert _rel(attn._attend(q, k, v, 3, pad), ref(band & padded_attention_mask(pad, 3, t, s))) <= 1e-6
    full = torch.rand(b, 1, t, s, generator=g) < 0.6
    full[..., 0] = True
    head_major = (k.transpose(0, 1).contiguous().transpose(0, 1), v.transpose(0, 1).contiguous().transpose(0, 1))
    assert head_major[0].stride(0) < head_major[0].stride(1)
    assert _rel(attn._attend(q, *head_major, 3, full), ref(full)) <= 1e-6  # a paged cache's keys and mask
    docs = torch.tensor([[0] * 4 + [1] * 5, [0] * 9], dtype=torch.int32)
    mask = DocumentMask(docs, backend="dense")
    got = mask.attend(q, kt, vt, window=5, scale=attn.scale, softcap=1.5)
    want = _eager(q, kt, vt, dense_mask(docs) & window_mask(0, t, t, 5, q.device), attn.scale, 1.5)
    assert _rel(got, want) <= 1e-6
    uncapped = mask.attend(q, kt, vt, scale=attn.scale)  # SDPA, given the scale
    assert _rel(uncapped, _eager(q, kt, vt, dense_mask(docs), attn.scale, None)) <= 1e-5


def _pair(hf_class, hf_extra, ours_extra):
    """transformers' model (weights perturbed, norms off zero) and ours with its weights copied by hand."""
    torch.manual_seed(0)
    hf_cfg = getattr(transformers, hf_class.replace("ForCausalLM", "Config").replace("3Config", "3TextConfig"))
    hf = getattr(transformers, hf_class)(hf_cfg(**HF_SHAPE, **hf_extra)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    ours = build_model(ModelConfig(**GEMMA, **ours_extra), 0).eval()
    state = {}
    for name, p in hf.state_dict().items():
        for a, b in NAMES.items():
            name = name.replace(a, b)
        state[name] = p
    assert ours.load_state_dict(state, strict=True) is not None
    return hf, ours


MODELS = {
    # Gemma 2: attention soft-capping, alternating local/global layers
    "gemma2": ("Gemma2ForCausalLM", dict(attn_logit_softcapping=2.0), dict(attn_softcap=2.0)),
    # Gemma 3: per-head q/k norms, the sliding layers' own base (default rope), linear scaling on the full ones
    "gemma3": (
        "Gemma3ForCausalLM",
        dict(
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            }
        ),
        dict(qk_norm="head", rope_local_theta=100.0, rope_type="linear", rope_factor=2.0),
    ),
}


@pytest.mark.parametrize("family", list(MODELS))
def test_a_tiny_gemma_with_every_piece_equals_transformers_forward_backward_and_decoding(family):
    hf, ours = _pair(*MODELS[family])
    # (no id 0: transformers zeroes the lookup gradient of its padding_idx row)
    tokens = torch.randint(1, 64, (2, 20), generator=torch.Generator().manual_seed(3))
    want = hf(tokens).logits
    got = ours(tokens)
    assert _rel(got, want) <= 1e-5
    assert want.abs().max() < 3.0  # final soft-capping at work
    dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(4))
    hf_grads = dict(zip([n for n, _ in hf.named_parameters()], torch.autograd.grad(want, list(hf.parameters()), dy)))
    ours_grads = dict(
        zip([n for n, _ in ours.named_parameters()], torch.autograd.grad(got, list(ours.parameters()), dy))
    )
    for hf_name, ours_name in (
        ("model.layers.0.input_layernorm.weight", "layers.0.attn_norm.weight"),
        ("model.layers.1.post_feedforward_layernorm.weight", "layers.1.mlp_post_norm.weight"),
        ("model.layers.0.self_attn.q_proj.weight", "layers.0.attn.q_proj.weight"),
        ("model.layers.1.mlp.gate_proj.weight", "layers.1.mlp.gate_proj.weight"),
        ("model.embed_tokens.weight", "embed.weight"),
    ):
        assert _rel(ours_grads[ours_name], hf_grads[hf_name]) <= 1e-5, ours_name
    with torch.no_grad():  # the KV cache past the window: a prompt, then one token at a time
        cache = ours.new_cache(2, 24)
        steps = [ours(tokens[:, :9], cache=cache, start=0)]
        steps += [ours(tokens[:, i : i + 1], cache=cache, start=i) for i in range(9, 20)]
    assert _rel(torch.cat(steps, 1), want.detach()) <= 1e-5


def test_fused_loss_with_a_final_softcap_equals_the_unfused_one():
    cfg = ModelConfig(**dict(GEMMA, final_softcap=0.5))
    target = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(5))
    target[0, :3] = -100
    tokens = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(6))
    runs = []
    for fused in (False, True):
        model = build_model(dataclasses.replace(cfg, fused_loss=fused, loss_chunk=16), 0)
        loss = model(tokens, target=target)
        runs.append((loss, torch.autograd.grad(loss, list(model.parameters()))))
    (ref, ref_grads), (loss, grads) = runs
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    for a, b in zip(grads, ref_grads):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max() + 1e-9
    plain = build_model(dataclasses.replace(cfg, final_softcap=None), 0)(tokens, target=target)
    assert abs(plain.item() - ref.item()) > 1e-3  # the cap changes the loss
    pytest.importorskip("triton")  # the Triton rows (one kernel per chunk), in the interpreter here: 12 rows
    g = torch.Generator().manual_seed(7)
    h, w = torch.randn(12, 16, generator=g).requires_grad_(), torch.randn(40, 16, generator=g).requires_grad_()
    t = torch.randint(0, 40, (12,), generator=g)
    t[:2] = -100
    want = cross_entropy(softcap(h @ w.t(), 0.5), t)
    got = linear_cross_entropy(h, w, t, chunk=8, kernels="triton", softcap=0.5)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w))):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(attn_softcap=0.0), "model.attn_softcap must be positive or none, got 0.0"),
        (dict(final_softcap=-1.0), "model.final_softcap must be positive"),
        (dict(query_pre_attn_scalar=0.0), "model.query_pre_attn_scalar must be positive"),
        (dict(flavor="gpt2", embed_scale=True), "model.embed_scale is built for the llama flavor"),
        (dict(flavor="gpt2", mlp_activation="gelu_tanh"), "model.mlp_activation=gelu_tanh is built for the llama"),
        (dict(mlp_activation="gelu_tanh", moe_experts=4), "built for dense MLPs only"),
        (dict(rope_local_theta=100.0), "model.rope_local_theta is the rotary base of the sliding-window layers"),
    ],
    ids=["attn-cap", "final-cap", "scalar", "gpt2-scale", "gpt2-geglu", "moe-geglu", "local-theta"],
)
def test_bad_gemma_fields_are_refused_in_one_line(fields, message):
    cfg = ModelConfig(vocab_size=64, max_seq_len=32, **fields)
    with pytest.raises(ConfigError, match=message) as e:
        cfg.validate()
    assert "\n" not in str(e.value)


def test_the_kernels_gemma_flags_pass_opcheck():
    """The operators' Gemma flags (``rms_norm``'s offset, ``swiglu``'s gelu, ``linear_cross_entropy``'s softcap): the
    fake implementations, autograd registrations and AOTAutograd agree with the Triton kernels (interpreter here)."""
    pytest.importorskip("triton")
    from trickles.kernels.activations import swiglu_op, swiglu_packed_op
    from trickles.kernels.cross_entropy import linear_cross_entropy_op
    from trickles.kernels.norms import rms_norm_op

    g = torch.Generator().manual_seed(8)
    t = lambda *s: torch.randn(s, generator=g).requires_grad_()  # noqa: E731
    target = torch.randint(0, 50, (11,), generator=g)
    target[2] = -100
    for op, args in (
        (rms_norm_op, (t(3, 5, 24), t(24), 1e-6, True)),
        (swiglu_op, (t(4, 37), t(4, 37), True)),
        (swiglu_packed_op, (t(4, 38), True)),
        (
            linear_cross_entropy_op,
            (t(11, 16), t(50, 16), None, target, 4, torch.float32, True, True, True, False, None, 0, 0.5),
        ),
    ):
        torch.library.opcheck(op, args)
