"""The step-time model at scale, on paper: published large GPT training runs on DGX A100 clusters, predicted with
the ``dgx-a100`` preset and nothing fitted per run, against the throughput their authors reported.

Source: D. Narayanan, M. Shoeybi, J. Casper, P. LeGresley, M. Patwary, V. Korthikanti, D. Vainbrand, P. Kashinkunti,
J. Bernauer, B. Catanzaro, A. Phanishayee, M. Zaharia, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC'21 (arXiv:2104.04473):

* Table 1 (weak scaling, every row checked against the paper's text): GPT models, vocabulary 51,200, sequence 2,048,
  mixed precision on DGX A100-80GB nodes (Selene: 8 GPUs on NVLink/NVSwitch, 8 x 200 Gb/s HDR InfiniBand each),
  tensor parallelism inside a node and pipeline parallelism across nodes, the interleaved schedule with the
  scatter/gather optimization, full activation recomputation; achieved TFLOP/s per GPU counted with their
  equation (3), ``F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` per iteration (recomputation's extra forward
  included). Micro-batch sizes and layers per virtual stage are those of the authors' script for the table,
  ``examples/sc21/run_table_1.sh`` in NVIDIA/Megatron-LM (MBS; ``--num-layers-per-virtual-pipeline-stage``; the 1T
  row runs plain 1F1B, the rows without pipeline none).
* Table 2, the PTD-P rows for the 174.6B GPT-3 model: model-parallel size 96 (tensor 8 inside a node, so pipeline
  12), micro-batch 1, batch 1536, on 384, 768 and 1536 GPUs; the layers per virtual stage are not given (taken as
  4, two chunks per rank).
* Section 5.1's estimate for GPT-3 175B: 1,024 A100s, batch 1536, X = 140 TFLOP/s per GPU, "34 days" for 300B
  tokens (``8 T P / (n X)``). The paper gives no layout for it; tensor 8 and pipeline 16 (6 layers a stage, two
  chunks of 3) are assumed.

What the runs used and trickles does not: Megatron-LM of 2021 ran attention unfused (the score matrix written, a
fused scale-mask-softmax, dropout on the probabilities, the causal mask applied after computing every score), so
these are predicted with ``step_time(..., attention="materialized")``; Megatron's default dropout 0.1; fp16.

Each published throughput becomes a step time, ``F / (n X)``, and the predicted step on
``load_cluster("dgx-a100").sized(n)`` must be within 15% of it. Measured on the model as committed, the ratios
published/predicted step time (= predicted/published throughput) are 1.05, 1.07, 1.09, 1.10, 1.04, 1.09, 1.02, 1.05,
1.05, 1.00 for Table 1's rows, 1.04, 1.04, 1.05 for Table 2's and 1.08 for the 1,024-GPU estimate.

Table 2's ZeRO-3 rows (DeepSpeed ZeRO-3 without model parallelism) are not checked: with their gradients reduced
in fp16, as DeepSpeed does, the model's throughput is 1.22-1.37x theirs -- it hides more of ZeRO-3's gathers behind
compute than DeepSpeed's 2021 implementation did.
"""

import pytest

from trickles.config import Config
from trickles.models.config import resolve_model
from trickles.planner import load_cluster, step_time

V, S = 51200, 2048

# (name, attention heads, hidden, layers, tensor, pipeline, GPUs, batch, TFLOP/s per GPU, micro-batch, virtual stages)
TABLE_1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1),
]
TABLE_2_PTD = [
    ("174.6B-384", 96, 12288, 96, 8, 12, 384, 1536, 153, 1, 2),
    ("174.6B-768", 96, 12288, 96, 8, 12, 768, 1536, 149, 1, 2),
    ("174.6B-1536", 96, 12288, 96, 8, 12, 1536, 1536, 141, 1, 2),
]
GPT3_ESTIMATE = ("gpt3-175B-1024", 96, 12288, 96, 8, 16, 1024, 1536, 140, 1, 2)


def megatron_flops(batch: int, layers: int, hidden: int) -> float:
    """Their equation (3): FLOPs of one iteration, recomputation included."""
    return 96 * batch * S * layers * hidden**2 * (1 + S / (6 * hidden) + V / (16 * layers * hidden))


def predict(row):
    _, heads, hidden, layers, t, p, gpus, batch, _, micro, v = row
    sets = [
        "model.flavor=gpt2",
        f"model.n_layers={layers}",
        f"model.d_model={hidden}",
        f"model.n_heads={heads}",
        f"model.n_kv_heads={heads}",
        f"model.vocab_size={V}",
        f"data.seq_len={S}",
        "model.dropout=0.1",
        f"train.global_batch={batch}",
        f"train.micro_batch={micro}",
        "memory.precision=fp16",
        "memory.recompute=full",
        f"parallel.tp={t}",
        f"parallel.pp={p}",
    ]
    if p > 1:
        sets += [f"parallel.schedule={'interleaved' if v > 1 else '1f1b'}", f"parallel.virtual_stages={v}"]
    cfg = Config.load(None, sets)
    dims = cfg.validate(gpus)
    model_cfg = resolve_model(cfg.model, V, S)
    return step_time(cfg, dims, model_cfg, load_cluster("dgx-a100").sized(gpus), attention="materialized")


@pytest.mark.parametrize("row", TABLE_1 + TABLE_2_PTD + [GPT3_ESTIMATE], ids=lambda r: r[0])
def test_predicted_throughput_is_within_15_percent_of_the_published(row):
    name, _, hidden, layers, _, _, gpus, batch, tflops, _, _ = row
    published_s = megatron_flops(batch, layers, hidden) / (gpus * tflops * 1e12)
    st = predict(row)
    ratio = published_s / st.total_s  # predicted throughput / published
    assert 0.85 <= ratio <= 1.15, f"{name}: predicted {st.total_s:.2f} s a step, published {published_s:.2f} s"
    assert st.devices == gpus and st.tokens == batch * S


def test_the_gpt3_estimate_is_34_days():
    """Their equation (4), ``8 T P / (n X)`` with T = 300B tokens and P = 175B parameters, is the 34 days they quote;
    the predicted step time over the ``T / (B s)`` iterations gives the model's own estimate, within 15%."""
    days = 8 * 300e9 * 175e9 / (1024 * 140e12) / 86400
    assert round(days) == 34
    st = predict(GPT3_ESTIMATE)
    predicted_days = 300e9 / (1536 * S) * st.total_s / 86400
    exact = 300e9 / (1536 * S) * megatron_flops(1536, 96, 12288) / (1024 * 140e12) / 86400
    assert 0.85 <= exact / predicted_days <= 1.15
