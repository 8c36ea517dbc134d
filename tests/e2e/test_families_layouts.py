"""Layout invariance through the command line for the families users bring: a tiny Qwen3 (per-head q/k norms, sliding
windows on some layers), a tiny Gemma 2 (sandwich norms, ``(1 + w)`` RMSNorm, GeGLU, attention and final soft-caps,
``query_pre_attn_scalar``, local/global alternation, tied embeddings) and a tiny DeepSeek-V3 of dense blocks (latent
attention: heads split under tensor parallelism with the compressions replicated, values narrower than the keys
through the ring and the all-to-all), each built by transformers from the family's
config class, its weights perturbed, saved with ``save_pretrained`` beside a byte-level BPE tokenizer, and trained
with ``trickles train --init-from DIR`` on a small JSONL corpus for 6 steps.

Every layout -- dp2 with ZeRO-3, dp2, tp2 with sequence parallelism, pp2 (two micro-batches), cp2 as a ring and as
Ulysses' all-to-all, each with a window shorter than the sequence -- logs the per-step losses of one process and
saves its final weights, within 1e-4. One process's run is shared by the layouts of its family."""

from __future__ import annotations

import inspect
import json
import sys

import pytest
import torch
from helpers import final_weights, run_losses

from trickles.testing import run_command

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

STEPS = 6
SEQ = 32
WINDOW = 8  # a quarter of the sequence: a context-parallel ring has blocks wholly outside it
# the bound; measured: every layout within 1e-6 of one process's losses and 6e-6 of its weights, while a
# piece left out (no window, no attention or final soft-cap, head_dim for query_pre_attn_scalar) moves the losses
# by 3e-3 or more and the weights by 6e-3 or more
TOL = 1e-4

# layout -> (ranks, settings, the banner's words)
LAYOUTS = {
    "dp2-zero3": (2, ["parallel.zero=3"], "(dp=2, ZeRO-3)"),
    "dp2": (2, [], "(dp=2),"),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"], "(dp=1, tp=2 with sequence parallel)"),
    "pp2": (2, ["parallel.pp=2", "train.micro_batch=2"], "(dp=1, pp=2 "),
    "cp2-ring": (2, ["parallel.cp=2", "parallel.cp_mode=ring"], "(dp=1, cp=2 ring)"),
    "cp2-ulysses": (2, ["parallel.cp=2", "parallel.cp_mode=ulysses"], "(dp=1, cp=2 ulysses)"),
}


def _qwen3(vocab: int):
    return transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=128,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
        )
    )


def _gemma2(vocab: int):
    return transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=128,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,  # small caps, so the tanh bends the scores and the tiny model's logits
            final_logit_softcapping=3.0,
            hidden_activation="gelu_pytorch_tanh",
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )


def _deepseek_v3(vocab: int, **moe):
    """Latent attention (a low-rank query, a compressed key/value latent, a shared rotary key, values narrower than
    the keys) in dense blocks: the first ``first_k_dense_replace`` blocks of DeepSeek-V3 are all of them here (or,
    with ``moe``, the settings of its mixture-of-experts blocks after them)."""
    return transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            max_position_embeddings=128,
            rope_interleave=True,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
            **({"num_hidden_layers": 4, "first_k_dense_replace": 4} | moe),
        )
    )


def _deepseek_v3_moe(vocab: int):
    """DeepSeek-V3's mixture of experts behind latent attention: a dense first block, then fine-grained routed experts
    (sigmoid scores, two groups of which each token may use one, top-2, a routed scale) beside a shared expert."""
    return _deepseek_v3(
        vocab,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )


FAMILIES = {"qwen3": _qwen3, "gemma2": _gemma2, "deepseek_v3": _deepseek_v3, "deepseek_v3_moe": _deepseek_v3_moe}
# expert parallelism (dropless: DeepSeek's routing keeps every assignment) alone and under tensor parallelism, and
# ZeRO-3 with the routing bias moved by the loads (the one process moving it the same way)
MOE_LAYOUTS = {
    "ep2": (2, ["parallel.ep=2"], "(dp=2, ep=2"),
    "ep2-tp2": (4, ["parallel.ep=2", "parallel.tp=2"], "(dp=2, tp=2, ep=2"),
    "dp2-zero3-bias": (2, ["parallel.zero=3"], "(dp=2, ZeRO-3)"),
}
LAYOUTS.update(MOE_LAYOUTS)
#: the layouts each family runs (latent attention: every layout that splits it, plain dp2 left to the others)
FAMILY_LAYOUTS = {
    "qwen3": [k for k in LAYOUTS if k not in MOE_LAYOUTS],
    "gemma2": [k for k in LAYOUTS if k not in MOE_LAYOUTS],
    "deepseek_v3": [k for k in LAYOUTS if k not in MOE_LAYOUTS and k != "dp2"],
    "deepseek_v3_moe": list(MOE_LAYOUTS),
}
#: settings every run of a family takes (one process's too)
FAMILY_SETTINGS = {"deepseek_v3_moe": ["model.moe_bias_rate=0.01"]}


def _documents() -> list[str]:
    """A few dozen documents: the functions of some standard-library modules."""
    import csv
    import textwrap

    docs = []
    for module in (json, csv, textwrap):
        docs += [d for d in inspect.getsource(module).split("\ndef ") if len(d) > 200]
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """``(the JSONL corpus, the tokenizer trained on it)``."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    root = tmp_path_factory.mktemp("corpus")
    docs = _documents()
    path = root / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(docs, trainer=trainer)
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")
    return path, tok


def _hf_dir(root, family: str, tok) -> str:
    torch.manual_seed(0)
    model = FAMILIES[family](len(tok)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norms not all ones (or zeros), so a norm mapped or placed wrongly shows
                p.add_(0.1 * torch.randn_like(p))
            if "q_proj" in name or "k_proj" in name or "kv_a_proj" in name:  # sharp attention (the cap bends it)
                p.mul_(8)
    path = root / f"tiny-{family}"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _train(hf: str, corpus, out, ranks: int, settings: list[str]):
    sets = [
        f"data.source={corpus}",
        f"data.seq_len={SEQ}",
        f"data.cache_dir={out.parent}/cache",
        f"train.steps={STEPS}",
        "train.global_batch=4",
        "train.lr=3e-3",
        "train.warmup_steps=2",
        "train.eps=1e-6",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.plot=false",
        f"train.out_dir={out}",
        *settings,
    ]
    args = ["train", "--init-from", hf, *(a for s in sets for a in ("--set", s))]
    if ranks > 1:
        args += ["--nproc", str(ranks)]
    r = run_command([sys.executable, "-m", "trickles", *args], text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "leaked" not in r.stderr, r.stderr[-3000:]
    return r


def _losses(out) -> list[float]:
    return run_losses(out, STEPS)


def _weights(out) -> dict[str, torch.Tensor]:
    return final_weights(out, STEPS)


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus):
    """``family -> (its directory, one process's losses, its final weights)``, each made once, when first asked."""
    root = tmp_path_factory.mktemp("families")
    made = {}

    def get(family: str):
        if family not in made:
            hf = _hf_dir(root, family, corpus[1])
            out = root / f"{family}-one"
            _train(hf, corpus[0], out, 1, FAMILY_SETTINGS.get(family, []))
            made[family] = hf, _losses(out), _weights(out)
        return made[family]

    return get


@pytest.mark.parametrize("family, layout", [(f, la) for f in FAMILIES for la in FAMILY_LAYOUTS[f]])
def test_a_family_from_its_directory_trains_like_one_process(family, layout, references, corpus, tmp_path):
    hf, want_losses, want = references(family)
    ranks, settings, banner = LAYOUTS[layout]
    r = _train(hf, corpus[0], tmp_path / "run", ranks, [*FAMILY_SETTINGS.get(family, []), *settings])
    assert f"{ranks} rank(s) {banner}" in r.stdout, r.stdout
    losses = _losses(tmp_path / "run")
    assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= TOL, (losses, want_losses)
    assert want_losses[-1] < want_losses[0] - 0.05  # the steps moved the model: equal losses are not trivial
    got = _weights(tmp_path / "run")
    assert got.keys() == want.keys()
    for name, w in got.items():
        assert (w - want[name]).abs().max() <= TOL, (name, (w - want[name]).abs().max())
