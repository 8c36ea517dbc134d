"""Tensor parallel (1-D, Megatron) with sequence parallel: each layer against the dense one, layout
invariance, collectives and activation memory counted against the Megatron analysis, RNG streams,
checkpoints."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import tiny_config
from trickles.memory.activations import ActivationMeter, activation_bytes
from trickles.parallel.tensor import (ColumnParallelLinear, ForkRNG, ReplicatedKV, RowParallelLinear, TPContext,
                                      VocabParallelEmbedding, init_tp_param, vocab_parallel_cross_entropy)
from trickles.testing import run_ranks
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

STEPS = 20
CACHE = "/tmp/trickles-test-tp"
CPU = torch.device("cpu")
# Tensor parallelism changes the summation order inside every matmul. With Adam's default eps
# (1e-8) a gradient element near zero turns that fp32 rounding into an update of up to ~1e-5
# (measured: 1.1e-5 at tp=4 after 5 steps, 1.4e-7 when everything runs in fp64); eps=1e-6
# keeps the weight comparison about the parallel math (max difference then 4e-6).
EPS = "train.eps=1e-6"


def _trainer(tmp, dp, tp, overrides, steps=STEPS):
    cfg = tiny_config(tmp, "parallel.bucket_mb=0.05", f"data.cache_dir={CACHE}", EPS, f"parallel.tp={tp}", *overrides, steps=steps)
    return Trainer(cfg, ParallelDims(dp=dp, tp=tp).build(CPU), quiet=True)


def _pieces(engine):
    """``{name: (this tp rank's tensor, global shape, offset, replicated)}`` of every parameter (a tied one once)."""
    out, specs = {}, engine.placements()
    for name, p in engine.full_state().items():
        spec = specs.get(name)
        shape, offset = (spec.global_shape, spec.offset) if spec else (tuple(p.shape), (0,) * p.dim())
        out[name] = (p.detach().float().clone(), shape, offset, spec is None or spec.replicated)
    return out


def _assemble(per_rank):
    """Whole parameters from every rank's pieces; tp-replicated ones must agree on every rank."""
    whole = {}
    for name, (_, shape, _, replicated) in per_rank[0].items():
        full = torch.full(shape, float("nan"))
        for pieces in per_rank:
            t, _, offset, rep = pieces[name]
            block = tuple(slice(o, o + n) for o, n in zip(offset, t.shape))
            if replicated:
                assert torch.equal(t, per_rank[0][name][0]), f"{name} drifted apart across ranks"
            full[block] = t
        assert not full.isnan().any(), f"the pieces of {name} do not cover it"
        whole[name] = full
    return whole


def _train(tmp, dp, tp, overrides, steps=STEPS):
    tr = _trainer(tmp, dp, tp, overrides, steps)
    losses = [tr.train_step()["loss"] for _ in range(steps)]
    return losses, _pieces(tr.engine)


_REFERENCE = {}


def reference(tmp, preset, extra=()):
    key = (preset, tuple(extra))
    if key not in _REFERENCE:
        losses, pieces = _train(tmp, 1, 1, [f"model.preset={preset}", *extra])
        _REFERENCE[key] = losses, _assemble([pieces])
    return _REFERENCE[key]


# ---- each layer against the dense one -------------------------------------------------------

def _rel(a, b):
    """Largest difference relative to the largest reference value."""
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-12))


def _ctx(sp):
    topo = ParallelDims(tp=torch.distributed.get_world_size()).build(CPU)
    return TPContext(topo.comm("tp"), sp), topo


def _mlp_pair(sp, bias):
    ctx, topo = _ctx(sp)
    comm, r, t = ctx.comm, ctx.comm.rank, ctx.comm.size
    torch.manual_seed(0)
    B, T, d, f = 2, 8, 16, 32
    x, w = torch.randn(B, T, d), torch.randn(B, T, d)
    A, b1, W2, b2 = torch.randn(f, d), torch.randn(f), torch.randn(d, f), torch.randn(d)
    dense = [v.clone().requires_grad_() for v in (x, A, b1, W2, b2)]
    yd = F.linear(F.gelu(F.linear(dense[0], dense[1], dense[2] if bias else None)), dense[3], dense[4] if bias else None)
    (yd * w).sum().backward()

    col, row = ColumnParallelLinear(d, f, bias, ctx), RowParallelLinear(f, d, bias, ctx)
    with torch.no_grad():
        for p, full in [(col.weight, A), (col.bias, b1), (row.weight, W2), (row.bias, b2)]:
            if p is not None:
                p.copy_(init_tp_param(full, p))
    mine = (lambda v: v.chunk(t, dim=1)[r]) if sp else (lambda v: v)
    xl = mine(x).clone().requires_grad_()
    topo.ledger.reset()
    y = row(F.gelu(col(ctx.enter(xl))))
    forward_calls = topo.ledger.snapshot()
    (y * mine(w)).sum().backward()
    err = {"y": _rel(y, mine(yd)), "dx": _rel(xl.grad, mine(dense[0].grad)),
           "dA": _rel(col.weight.grad, init_tp_param(dense[1].grad, col.weight)),
           "dW2": _rel(row.weight.grad, init_tp_param(dense[3].grad, row.weight))}
    if bias:
        err["db1"] = _rel(col.bias.grad, init_tp_param(dense[2].grad, col.bias))
        db2 = comm.all_reduce(row.bias.grad.clone()) if sp else row.bias.grad  # partial under sequence parallel
        err["db2"] = _rel(db2, dense[4].grad)
    return err, forward_calls, topo.ledger.snapshot()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_column_row_pair_matches_dense_forward_and_backward(world, sp):
    for err, fwd, total in run_ranks(world, _mlp_pair, sp, True):
        assert max(err.values()) < 1e-6, err
        if sp:  # all-gather in, reduce-scatter out; backward: reduce-scatter, all-gather, and the input gathered again
            assert {k: v["calls"] for k, v in fwd.items()} == {"all_gather/tp": 1, "reduce_scatter/tp": 1}
            assert {k: v["calls"] for k, v in total.items()} == {"all_gather/tp": 3, "reduce_scatter/tp": 2, "all_reduce/tp": 1}
        else:  # one all-reduce forward (exit), one backward (entry)
            assert {k: v["calls"] for k, v in fwd.items()} == {"all_reduce/tp": 1}
            assert {k: v["calls"] for k, v in total.items()} == {"all_reduce/tp": 2}


def _vocab_parallel(sp):
    ctx, _ = _ctx(sp)
    r, t = ctx.comm.rank, ctx.comm.size
    torch.manual_seed(1)
    V, d, B, T = 8 * t, 12, 3, 4 * t
    table, ids, w = torch.randn(V, d), torch.randint(0, V, (B, T)), torch.randn(B, T, d)
    ids[0, :2] = torch.tensor([0, V - 1])  # both ends of the vocabulary
    dense = table.clone().requires_grad_()
    (F.embedding(ids, dense) * w).sum().backward()
    emb = VocabParallelEmbedding(V, d, ctx)
    with torch.no_grad():
        emb.weight.copy_(init_tp_param(table, emb.weight))
    mine = (lambda v: v.chunk(t, dim=1)[r]) if sp else (lambda v: v)
    out = emb(ids)
    (out * mine(w)).sum().backward()
    err = {"embedding": _rel(out, mine(F.embedding(ids, table))),
           "d_table": _rel(emb.weight.grad, init_tp_param(dense.grad, emb.weight))}

    logits, target = torch.randn(B * T, V) * 3, torch.randint(0, V, (B * T,))
    target[:2] = torch.tensor([0, V - 1])
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full, target)
    ref.backward()
    start = r * (V // t)
    local = logits[:, start:start + V // t].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, ctx.comm, start)
    loss.backward()
    err["loss"] = _rel(loss, ref)
    err["d_logits"] = _rel(local.grad, full.grad[:, start:start + V // t])
    return err


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_vocab_parallel_embedding_and_cross_entropy_match_dense(world, sp):
    for err in run_ranks(world, _vocab_parallel, sp):
        assert max(err.values()) < 1e-6, err


def _replicated_kv():
    ctx, _ = _ctx(False)
    comm, r, t = ctx.comm, ctx.comm.rank, ctx.comm.size
    torch.manual_seed(2)
    n_heads, n_kv, h, d, B, T = 4, 1 if t == 2 else 2, 3, 10, 2, 5
    local = n_heads // t
    assert n_kv % t  # key/value heads that do not divide by tp
    x, W, w = torch.randn(B, T, d), torch.randn(n_kv * h, d), torch.randn(B, T, local * h)
    dense = W.clone().requires_grad_()
    k = F.linear(x, dense).view(B, T, n_kv, h).repeat_interleave(n_heads // n_kv, dim=2)  # one per query head
    slices = [k[:, :, o * local:(o + 1) * local].reshape(B, T, -1) for o in range(t)]
    sum((sl * w).sum() for sl in slices).backward()  # every rank's loss on its query heads, summed
    kv = ReplicatedKV(d, n_heads, n_kv, h, False, ctx)
    with torch.no_grad():
        kv.weight.copy_(W)
    out = kv(x)
    (out * w).sum().backward()
    assert kv.weight.tp_spec.partial_grad and kv.weight.tp_spec.replicated
    return float((out - slices[r]).abs().max()), float((comm.all_reduce(kv.weight.grad.clone()) - dense.grad).abs().max())


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_key_value_heads_match_dense(world):
    for out_err, grad_err in run_ranks(world, _replicated_kv):
        assert out_err < 1e-6 and grad_err < 1e-5


# ---- layout invariance ---------------------------------------------------------------------

CASES = [(preset, 1, tp, sp, ()) for preset in ("tiny", "gpt2-tiny") for tp in (2, 4) for sp in (False, True)] + [
    ("tiny", 2, 2, False, ("parallel.zero=1",)),
    ("tiny", 2, 2, True, ("parallel.zero=1",)),
    ("gpt2-tiny", 2, 2, True, ("parallel.zero=1", "train.micro_batch=2")),
    ("tiny", 2, 2, True, ("parallel.zero=3",)),
    ("tiny", 1, 2, True, ("memory.recompute=full",)),
    ("gpt2-tiny", 1, 2, True, ("memory.recompute=selective",)),
]


def _case_id(c):
    preset, dp, tp, sp, extra = c
    return f"{preset}-dp{dp}-tp{tp}{'-sp' if sp else ''}" + "".join(f"-{e.split('.')[-1]}" for e in extra)


@pytest.mark.parametrize("preset,dp,tp,sp,extra", CASES, ids=[_case_id(c) for c in CASES])
def test_layout_invariance(tmp_path, preset, dp, tp, sp, extra):
    """tp (x dp) ranks train like one process: losses within 1e-4 relative, gathered weights within 1e-5."""
    same_math = [e for e in extra if e.startswith("train.micro_batch")]
    ref_losses, ref_weights = reference(str(tmp_path), preset, same_math)
    overrides = [f"model.preset={preset}", f"parallel.sequence_parallel={str(sp).lower()}", *extra]
    results = run_ranks(dp * tp, _train, str(tmp_path), dp, tp, overrides)
    for losses, _ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-4)
    for d in range(dp):  # each data-parallel replica's tensor-parallel ranks together hold the model
        weights = _assemble([pieces for _, pieces in results[d * tp:(d + 1) * tp]])
        assert weights.keys() == ref_weights.keys()
        for n, w in weights.items():
            assert torch.allclose(w, ref_weights[n], atol=1e-5, rtol=0), (n, (w - ref_weights[n]).abs().max())


def test_low_precision_tracks_fp32(tmp_path):
    ref, _ = reference(str(tmp_path), "tiny")
    for losses, _ in run_ranks(2, _train, str(tmp_path), 1, 2, ["parallel.sequence_parallel=true", "memory.precision=bf16"]):
        assert losses == pytest.approx(ref, rel=2e-2)


# ---- communication counted -----------------------------------------------------------------

def _one_step_ledger(tmp, overrides):
    tr = _trainer(tmp, 1, torch.distributed.get_world_size(), overrides, steps=2)
    tr.train_step()
    tr.topo.ledger.reset()
    tr.train_step()
    return tr.model_cfg, tr.micro_batch, tr.topo.ledger.snapshot()


@pytest.mark.parametrize("tp", [2, 4])
def test_collectives_per_step_match_megatron(tmp_path, tp):
    (cfg, micro, plain), *_ = run_ranks(tp, _one_step_ledger, str(tmp_path), [])
    (_, _, seq_par), *_ = run_ranks(tp, _one_step_ledger, str(tmp_path), ["parallel.sequence_parallel=true"])
    L, tokens = cfg.n_layers, micro * 32
    act = tokens * cfg.d_model * 4  # one activation [b, s, d] in fp32
    ring = (tp - 1) / tp
    # the cross-entropy's three [tokens] all-reduces (max, target logit, sum of exponentials) and the
    # squared gradient norm; kv heads replicated (tp=4 on 2 kv heads) add their partial gradients
    kv_partial = 0 if cfg.kv_heads % tp == 0 else 2 * L * cfg.kv_heads * cfg.head_dim * cfg.d_model * 4
    small = 3 * tokens * 4 + 4 + kv_partial
    n_small = 4 + (1 if kv_partial else 0)
    # two all-reduces per block forward (attention, MLP exits) and two backward (their entries),
    # the embedding's exit forward and the final norm's entry backward
    n_act = 4 * L + 2
    assert plain["all_reduce/tp"]["calls"] == n_act + n_small
    assert plain["all_reduce/tp"]["bytes"] == n_act * act + small
    assert set(plain) == {"all_reduce/tp"}
    # sequence parallel: each all-reduce becomes an all-gather + reduce-scatter pair of the same wire volume
    assert seq_par["reduce_scatter/tp"]["calls"] == n_act
    regathers = 2 * L + 1  # each region's input gathered again in backward (attention, MLP, output layer)
    assert seq_par["all_gather/tp"]["calls"] == n_act + regathers
    pair_wire = seq_par["reduce_scatter/tp"]["wire_bytes"] + seq_par["all_gather/tp"]["wire_bytes"] * n_act / (n_act + regathers)
    assert pair_wire == pytest.approx(plain["all_reduce/tp"]["wire_bytes"] - 2 * ring * small, rel=1e-3)
    assert pair_wire == pytest.approx(n_act * 2 * ring * act, rel=1e-3)
    norms = (2 * L + 1) * cfg.d_model * 4  # norm weights see only their positions: partial gradients summed
    assert seq_par["all_reduce/tp"]["calls"] == 5  # all partial gradients in one all-reduce
    assert seq_par["all_reduce/tp"]["bytes"] == small + norms


# ---- activation memory ---------------------------------------------------------------------

def _activations(tmp, preset, sp, seq=64, batch=4):
    tp = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    tr = _trainer(tmp, 1, tp, [f"model.preset={preset}", f"parallel.sequence_parallel={str(sp).lower()}", f"data.seq_len={seq}",
                               f"train.micro_batch={batch}", f"train.global_batch={batch}"], steps=1)
    x, y = tr.train_data.micro_batches(0, batch, batch)[0]
    with ActivationMeter(tr.model) as meter:
        loss = tr._loss(x, y)
    loss.backward()
    return tr.model_cfg, meter.per_layer


@pytest.mark.parametrize("preset", ["tiny", "gpt2-tiny"])
def test_sequence_parallel_shrinks_activations_as_megatron_predicts(tmp_path, preset):
    (cfg, one), = run_ranks(1, _activations, str(tmp_path), preset, False)
    base = one["layers.0"]
    assert base == activation_bytes(cfg, 4, 64)["layer"]
    for tp in (2, 4):
        (_, plain), *_ = run_ranks(tp, _activations, str(tmp_path), preset, False)
        (_, seq), *_ = run_ranks(tp, _activations, str(tmp_path), preset, True)
        for name, measured in (("tp", plain), ("tp+sp", seq)):
            predicted = activation_bytes(cfg, 4, 64, tp=tp, sequence_parallel=name == "tp+sp")
            for i in range(cfg.n_layers):
                assert measured[f"layers.{i}"] == pytest.approx(predicted["layer"], rel=0.01), (name, tp, i)
            assert measured["head"] == pytest.approx(predicted["head"], rel=0.01), (name, tp)
        # Megatron: tp alone splits only the matmul parts (heads, MLP width); what the norms keep
        # (and the linears after them) stays whole -- with sequence parallel it is split too
        norms_whole = plain["layers.0"] - seq["layers.0"]
        assert norms_whole == pytest.approx((1 - 1 / tp) * _norm_bytes(cfg, 4 * 64), rel=1e-6)
        if cfg.kv_heads % tp == 0:  # every part of the layer split: exactly 1/tp of one device's activations
            assert seq["layers.0"] * tp == base


def _norm_bytes(cfg, tokens):
    """What a layer's two norms keep for backward over ``tokens`` positions (fp32)."""
    d = cfg.d_model
    one = 4 * tokens * d + 4 * tokens + 8 * tokens * d if cfg.flavor == "llama" else 8 * tokens * d + 8 * tokens
    return 2 * one


# ---- random streams ------------------------------------------------------------------------

def _streams():
    ctx, _ = _ctx(False)
    torch.manual_seed(5)
    x = torch.ones(64, 64)
    drop = nn.Dropout(0.5).train()
    private = ForkRNG(drop, ctx, 0.5)(x)
    shared = drop(x)
    return private, shared, torch.get_rng_state()


def test_dropout_streams_private_inside_regions_shared_outside():
    (p0, s0, g0), (p1, s1, g1) = run_ranks(2, _streams)
    assert not torch.equal(p0, p1)  # a rank's heads (or sequence shard) drop their own elements
    assert torch.equal(s0, s1) and torch.equal(g0, g1)  # outside: the same stream, still in step afterwards


# ---- checkpoints ---------------------------------------------------------------------------

def _first_half(tmp, dp, tp, overrides, tag):
    tr = _trainer(tmp, dp, tp, [*overrides, f"train.out_dir={tmp}/{tag}"], steps=8)
    losses = [tr.train_step()["loss"] for _ in range(4)]
    path = tr.save_checkpoint()
    straight = losses + [tr.train_step()["loss"] for _ in range(4)]
    return path, straight, _pieces(tr.engine)


def _second_half(tmp, dp, tp, overrides, path, tag):
    tr = _trainer(tmp, dp, tp, [*overrides, f"train.out_dir={tmp}/{tag}"], steps=8)
    tr.load_checkpoint(path)
    return [tr.train_step()["loss"] for _ in range(4)], _pieces(tr.engine)


def test_checkpoint_resume_with_dropout_same_layout(tmp_path):
    """Shards with their global shapes and offsets; per-rank random states restored: dropout continues exactly."""
    common = ["parallel.sequence_parallel=true", "model.dropout=0.1", "parallel.zero=1"]
    first = run_ranks(4, _first_half, str(tmp_path), 2, 2, common, "a")
    path = first[0][0]
    second = run_ranks(4, _second_half, str(tmp_path), 2, 2, common, path, "b")
    for (tail, _), (_, s, _) in zip(second, first):
        assert tail == s[4:]
    final, resumed = _assemble([f[2] for f in first[:2]]), _assemble([s[1] for s in second[:2]])
    for n in final:
        assert torch.equal(final[n], resumed[n]), n


def test_checkpoint_loads_at_another_layout(tmp_path):
    """tp=2 with sequence parallel -> dp=2 with ZeRO-1, and -> tp=4: the same continuation."""
    (path, straight, _), _ = run_ranks(2, _first_half, str(tmp_path), 1, 2, ["parallel.sequence_parallel=true"], "a")
    for tail, _ in run_ranks(2, _second_half, str(tmp_path), 2, 1, ["parallel.zero=1"], path, "b"):
        assert tail == pytest.approx(straight[4:], rel=1e-4)
    for tail, _ in run_ranks(4, _second_half, str(tmp_path), 1, 4, [], path, "c"):
        assert tail == pytest.approx(straight[4:], rel=1e-4)


# ---- memory report -------------------------------------------------------------------------

def _report(tmp, dp, tp, overrides):
    from trickles.memory.report import measure, predict

    tr = _trainer(tmp, dp, tp, [*overrides, "train.global_batch=4", "data.seq_len=64"], steps=3)
    rep = predict(tr.cfg, tr.topo.dims, tr.model_cfg)
    measure(tr, rep, steps=2)
    return rep.predicted, rep.measured


@pytest.mark.parametrize("dp,tp,extra", [(1, 2, ["parallel.sequence_parallel=true"]), (2, 2, ["parallel.zero=1"]),
                                         (1, 4, ["parallel.sequence_parallel=true", "memory.recompute=selective"])],
                         ids=["tp2-sp", "dp2-tp2-zero1", "tp4-sp-selective"])
def test_memory_report_predicts_each_tensor_parallel_rank(tmp_path, dp, tp, extra):
    for predicted, measured in run_ranks(dp * tp, _report, str(tmp_path), dp, tp, extra):
        for key in ("parameters", "gradients", "optimizer", "activations", "head"):
            assert measured[key] == pytest.approx(predicted[key], rel=0.01), (key, predicted, measured)
