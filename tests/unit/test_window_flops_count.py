"""The planner counts a sliding-window layer's attention FLOPs as the window allows: the forward's scores and weighted
sum cost ``4 h_d`` per (query, key) entry the layer's mask leaves, counted here from the masks the model itself hands
to ``scaled_dot_product_attention`` (a per-layer pattern: two layers slide, two attend to every earlier key)."""

import pytest
import torch
import torch.nn.functional as F

from trickles.config import Config
from trickles.models import build_model
from trickles.models.config import resolve_model
from trickles.planner import load_cluster, step_time
from trickles.planner.compute import attention_flops, causal_pairs, chunk_work
from trickles.topology import ParallelDims

SEQ, BATCH, WINDOW = 32, 2, 8
SETS = [
    "model.preset=tiny",
    "model.n_layers=4",
    f"model.sliding_window={WINDOW}",
    "model.window_layers=[true, false, true, false]",
    f"data.seq_len={SEQ}",
    "model.vocab_size=320",
    "train.global_batch=2",
]


def _model_entries(mc) -> list[int]:
    """Per layer, the score entries the model's attention leaves unmasked over one micro-batch (all heads)."""
    model = build_model(mc, 0)
    seen: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def counting(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        rows, keys = q.shape[-2], k.shape[-2]
        if attn_mask is not None:
            kept = attn_mask.expand(*q.shape[:-2], rows, keys).sum().item()
        elif is_causal:
            kept = q.shape[:-2].numel() * causal_pairs(rows)
        else:
            kept = q.shape[:-2].numel() * rows * keys
        seen.append(int(kept))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    F.scaled_dot_product_attention = counting
    try:
        with torch.no_grad():
            model(torch.zeros(BATCH, SEQ, dtype=torch.long))
    finally:
        F.scaled_dot_product_attention = sdpa
    return seen


def test_the_planner_counts_each_layers_attention_flops_as_its_window_allows():
    cfg = Config.load(None, SETS)
    mc = resolve_model(cfg.model, 320, SEQ)
    entries = _model_entries(mc)
    assert len(entries) == mc.n_layers and entries[0] < entries[1]  # the window cuts: fewer entries than causal
    per_entry = 4 * mc.head_dim  # scores 2 h_d, weighted sum 2 h_d
    layers = range(mc.n_layers)
    one = [attention_flops(chunk_work(mc, ParallelDims(), BATCH, SEQ, [i], False, False, 4)) for i in layers]
    assert one == [pytest.approx(per_entry * e, rel=1e-12) for e in entries]
    # each layout's ranks share the same total: heads split by tp, queries (ring) or heads (all-to-all) by cp
    for dims, mode in ((ParallelDims(tp=2), "ring"), (ParallelDims(cp=2), "ring"), (ParallelDims(cp=2), "ulysses")):
        work = chunk_work(mc, dims, BATCH, SEQ, list(layers), False, False, 4, cp_mode=mode)
        assert attention_flops(work) * dims.tp * dims.cp == pytest.approx(per_entry * sum(entries), rel=1e-12)
    # the closed form: w (w + 1) / 2 + (T - w) w keys below the diagonal band, T (T + 1) / 2 without a window
    assert causal_pairs(SEQ, WINDOW) == sum(min(i + 1, WINDOW) for i in range(SEQ)) == 36 + 24 * 8
    assert causal_pairs(SEQ) == causal_pairs(SEQ, 99) == SEQ * (SEQ + 1) // 2


def test_a_window_shortens_the_step_time_model_attention():
    full = Config.load(None, SETS[:2] + SETS[4:])
    cfg = Config.load(None, SETS)
    times = []
    for c in (full, cfg):
        dims = c.validate(1)
        times.append(step_time(c, dims, resolve_model(c.model, 320, SEQ), load_cluster("local")).compute_s)
    assert times[1] < times[0]
