"""Multi-head latent attention in the memory report, the planner and the FLOP counts: every byte autograd saves in a
latent attention layer predicted exactly (trickles/memory/latent_activations.py), on one process in every
recomputation mode, fp32 and bf16, with a query rank and without, SDPA's fused kernel (``v = n + r``) and its math path
(``v != n + r``), packed documents and dropout; the decoding cache's bytes, ``(kv_lora_rank + qk_rope_head_dim) x
dtype`` a token per layer wherever the library counts them, at least 5x below multi-head attention's at DeepSeek's
dims; the parameters and matrix-product FLOPs of the planner and of MFU against the built model and
``FlopCounterMode``."""

import pytest
import torch
from helpers import MLA_SHAPE, short_documents, tiny_config
from torch.utils.flop_counter import FlopCounterMode

from trickles.config import Config
from trickles.infer.paged import block_bytes
from trickles.infer.streaming import kv_cache_bytes
from trickles.memory.activations import ActivationMeter, activation_bytes
from trickles.memory.meta import rank_model
from trickles.models.config import resolve_model
from trickles.models.transformer import Transformer, count_params
from trickles.planner.compute import block_work, head_work, param_elements, rank_params
from trickles.topology import ParallelDims
from trickles.train.flops import flops_per_token, matmul_params
from trickles.train.trainer import Trainer

# n + r = 12 against v = 6: SDPA's math path on a CPU; v = 12 below: the fused kernel
MLA = MLA_SHAPE
_CASES = {
    "fp32-q_lora": ("fp32", ("model.q_lora_rank=24",), ("none", "selective", "full")),
    "bf16-q_proj": ("bf16", ("model.q_lora_rank=none",), ("none", "selective")),
    "bf16-fused": ("bf16", ("model.q_lora_rank=24", "model.v_head_dim=12"), ("none", "selective")),
    "fp32-documents": ("fp32", ("model.q_lora_rank=24", "data.document_mask=true"), ("none", "selective")),
    "fp32-fused-documents-dropout": (
        "fp32",
        ("model.q_lora_rank=none", "model.v_head_dim=12", "data.document_mask=true", "model.dropout=0.1"),
        ("none",),
    ),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_latent_attention_activations_are_exact(tmp_path, case):
    """Per layer and in the head, to the byte, in each recomputation mode the case lists."""
    precision, overrides, modes = _CASES[case]
    documents = "data.document_mask=true" in overrides
    extra = short_documents(tmp_path / "lines.jsonl") if documents else []
    for mode in modes:
        cfg = tiny_config(
            tmp_path,
            *MLA,
            *overrides,
            *extra,
            f"memory.precision={precision}",
            f"memory.recompute={mode}",
            "train.micro_batch=2",
            "train.global_batch=2",
            steps=1,
        )
        tr = Trainer(cfg, ParallelDims().build(torch.device("cpu")), quiet=True)
        batch = tr.train_data.micro_batches(0, 2, 2)[0]
        ids = batch[3] if documents else None
        with ActivationMeter(tr.model) as meter:
            loss = tr._loss(batch[0], batch[1], None, ids)
        loss.backward()
        p = 2 if precision == "bf16" else 4
        want = activation_bytes(tr.model_cfg, 2, 32, mode, p, documents=documents)
        got = [meter.per_layer[f"layers.{i}"] for i in range(tr.model_cfg.n_layers)]
        assert got == want["per_layer"], (mode, [g - w for g, w in zip(got, want["per_layer"])])
        assert meter.per_layer["head"] == want["head"], mode


def _model(*overrides, vocab=96, seq=32):
    return resolve_model(Config.load(None, ["model.preset=tiny", *overrides]).model, vocab, seq)


# DeepSeek-V2-Lite's attention: 16 heads, latent 512, rotary 64, no-position 128, values 128; beside it multi-head
# attention with as many heads of 128
DEEPSEEK = (
    "model.d_model=2048",
    "model.n_heads=16",
    "model.attention=mla",
    "model.q_lora_rank=none",
    "model.kv_lora_rank=512",
    "model.qk_rope_head_dim=64",
    "model.qk_nope_head_dim=128",
    "model.v_head_dim=128",
)


def test_the_decoding_cache_counts_the_latent_and_the_rotary_key_only():
    latent = _model(*DEEPSEEK, "model.n_layers=2", seq=64)
    dense = _model("model.d_model=2048", "model.n_heads=16", "model.n_kv_heads=16", "model.n_layers=2", seq=64)
    with torch.device("meta"):
        models = Transformer(latent).to(torch.bfloat16), Transformer(dense).to(torch.bfloat16)
    per_token = (512 + 64) * 2 * 2  # (L + r) bf16 values, two layers
    assert kv_cache_bytes(latent, 3, 64, torch.bfloat16) == 3 * 64 * per_token
    assert block_bytes(models[0], 16) == 16 * per_token
    cache = models[0].new_cache(1, 8)
    assert cache.bytes_per_token * latent.n_layers == per_token
    mha_bytes = kv_cache_bytes(dense, 3, 64, torch.bfloat16)
    assert block_bytes(models[1], 16) == 16 * mha_bytes // (3 * 64)
    assert mha_bytes >= 5 * kv_cache_bytes(latent, 3, 64, torch.bfloat16)  # 4096 / 576 = 7.1x
    assert block_bytes(models[1], 16) >= 5 * block_bytes(models[0], 16)


@pytest.mark.parametrize("query", ["model.q_lora_rank=24", "model.q_lora_rank=none"])
def test_latent_attention_parameters_and_flops_are_counted(query):
    """Parameters against the built model (tp2: the rank model's), MFU's and the planner's forward FLOPs against
    ``FlopCounterMode`` (every score, the math path's products), and a hand count of the block's products."""
    mc = _model(*MLA, query, "model.qkv_bias=true", "model.o_bias=true")
    torch.manual_seed(0)
    model = Transformer(mc)
    assert param_elements(mc) == count_params(model)
    tp2 = ParallelDims(tp=2)
    held = rank_model(mc, tp2, False, 0, torch.float32).numel
    assert sum(rank_params(mc, tp2, list(range(mc.n_layers)), True, True)) == held
    d, h, q = 64, 4, 24 if query.endswith("24") else None
    products = (d * q + q * h * 12 if q else d * h * 12) + d * (16 + 4) + 16 * h * (8 + 6) + h * 6 * d
    assert matmul_params(mc) == mc.n_layers * (products + 3 * d * mc.ffn_dim) + d * mc.vocab_size
    x = torch.randint(0, 96, (2, 32))
    with FlopCounterMode(display=False) as counter:
        model(x)
    counted = counter.get_total_flops()
    assert counted == flops_per_token(mc, 32) / 3 * 2 * 32
    one = ParallelDims()
    planned = mc.n_layers * block_work(mc, one, 2, 32, False, False, 4, "materialized").flops
    assert planned + head_work(mc, one, 2, 32, False, 4).flops == counted
