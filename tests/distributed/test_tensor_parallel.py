"""Tensor parallel (1-D, Megatron) with sequence parallel: each layer against the dense one, layout
invariance, collectives and activation memory counted against the Megatron analysis, RNG streams,
checkpoints."""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_losses_track, assert_weights_track, tiny_config
from torch import nn

from trickles.memory.activations import ActivationMeter, activation_bytes
from trickles.parallel.tensor.layers import (
    ColumnParallelLinear,
    ForkRNG,
    ReplicatedKV,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
    init_tp_param,
)
from trickles.parallel.tensor.loss import vocab_parallel_cross_entropy
from trickles.parallel.tensor.region_bytes import partial_grad_elements, region_wire_bytes
from trickles.testing import run_ranks
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

STEPS = 20
INVARIANCE_STEPS = 6  # the fp32 layout-invariance cases: a wrong gradient, shard or message shows in the first steps
CPU = torch.device("cpu")
# Tensor parallelism changes the summation order inside every matmul. With Adam's default eps
# (1e-8) a gradient element near zero turns that fp32 rounding into a larger update (measured
# over 20 steps: weights 6.6e-6 apart at tp=2, 2.8e-6 at tp=4); eps=1e-6 keeps the weight
# comparison about the parallel math (then 3.8e-7 at tp=2, 1.7e-6 at tp=4 with sequence
# parallel). The default eps has its own case (test_default_eps_tracks_one_process).
EPS = "train.eps=1e-6"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """This run's tokenized-data cache, shared by the module's tests (spawned ranks get it in their overrides)."""
    return f"data.cache_dir={tmp_path_factory.mktemp('tp-cache')}"


def _trainer(tmp, dp, tp, overrides, steps=STEPS, eps=EPS):
    """``eps=None``: Adam's default eps."""
    cfg = tiny_config(
        tmp, "parallel.bucket_mb=0.05", *([eps] if eps else []), f"parallel.tp={tp}", *overrides, steps=steps
    )
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


def _train(tmp, dp, tp, overrides, steps=STEPS, eps=EPS, initial=False):
    """Losses and this rank's pieces (``initial``: and its pieces before the first step)."""
    tr = _trainer(tmp, dp, tp, overrides, steps, eps)
    start = _pieces(tr.engine) if initial else None
    losses = [tr.train_step()["loss"] for _ in range(steps)]
    return (losses, _pieces(tr.engine), start) if initial else (losses, _pieces(tr.engine))


_REFERENCE = {}


def reference(tmp, cache, preset, extra=()):
    """One process's losses and weights, computed once per run (keyed by the run's cache directory too)."""
    key = (cache, preset, tuple(extra))
    if key not in _REFERENCE:
        losses, pieces = _train(tmp, 1, 1, [cache, f"model.preset={preset}", *extra], INVARIANCE_STEPS)
        _REFERENCE[key] = losses, _assemble([pieces])
    return _REFERENCE[key]


def _tracking_references(tmp, overrides, eps=EPS):
    """One process's losses, whole weights and initial weights under ``overrides``, and the losses of the same run
    with a learning rate 5% lower (tiny_config's 3e-3): the reference and the wrong run a tolerance must reject."""
    losses, pieces, start = _train(tmp, 1, 1, overrides, eps=eps, initial=True)
    slower, _ = _train(tmp, 1, 1, [*overrides, "train.lr=2.85e-3"], eps=eps)
    return losses, _assemble([pieces]), _assemble([start]), slower


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
    yd = F.linear(
        F.gelu(F.linear(dense[0], dense[1], dense[2] if bias else None)), dense[3], dense[4] if bias else None
    )
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
    err = {
        "y": _rel(y, mine(yd)),
        "dx": _rel(xl.grad, mine(dense[0].grad)),
        "dA": _rel(col.weight.grad, init_tp_param(dense[1].grad, col.weight)),
        "dW2": _rel(row.weight.grad, init_tp_param(dense[3].grad, row.weight)),
    }
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
            assert {k: v["calls"] for k, v in total.items()} == {
                "all_gather/tp": 3,
                "reduce_scatter/tp": 2,
                "all_reduce/tp": 1,
            }
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
    err = {
        "embedding": _rel(out, mine(F.embedding(ids, table))),
        "d_table": _rel(emb.weight.grad, init_tp_param(dense.grad, emb.weight)),
    }

    logits, target = torch.randn(B * T, V) * 3, torch.randint(0, V, (B * T,))
    target[:2] = torch.tensor([0, V - 1])
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full, target)
    ref.backward()
    start = r * (V // t)
    local = logits[:, start : start + V // t].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, ctx.comm, start)
    loss.backward()
    err["loss"] = _rel(loss, ref)
    err["d_logits"] = _rel(local.grad, full.grad[:, start : start + V // t])
    return err


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_vocab_parallel_embedding_and_cross_entropy_match_dense(world, sp):
    for err in run_ranks(world, _vocab_parallel, sp):
        assert max(err.values()) < 1e-6, err


def _vocab_parallel_op():
    """opcheck of the loss operators (unfused, fused) over a real 2-rank group (the fakes against outputs the
    all-reduces made), the ledger of one unfused call (three all-reduces of ``[N]`` fp32 on ``tp``, none in backward),
    and the loss compiled whole (``fullgraph=True``) giving the eager losses and gradient, its collectives counted."""
    from trickles.kernels.cross_entropy import linear_cross_entropy_op
    from trickles.kernels.groups import comm_name
    from trickles.parallel.tensor.loss import vocab_parallel_ce_op, vocab_parallel_losses

    ctx, topo = _ctx(False)
    r, t = ctx.comm.rank, ctx.comm.size
    torch.manual_seed(3)
    logits, target = torch.randn(6, 4 * t), torch.tensor([0, 4 * t - 1, -100, 3, 5, 2])
    local = logits[:, 4 * r : 4 * (r + 1)].clone().requires_grad_()
    torch.library.opcheck(vocab_parallel_ce_op, (local, target, comm_name(ctx.comm), 4 * r))
    h, w = torch.randn(6, 5), torch.randn(4 * t, 5)
    fused = (h, w[4 * r : 4 * (r + 1)], None, target, 4, torch.float32, False, True, True, False, comm_name(ctx.comm))
    torch.library.opcheck(linear_cross_entropy_op, (*fused, 4 * r))
    topo.ledger.reset()
    losses = vocab_parallel_losses(local, target, ctx.comm, 4 * r)
    ledger = topo.ledger.snapshot()
    losses.sum().backward()
    ref = F.cross_entropy(logits, target, reduction="none")
    compiled = torch.compile(
        lambda z: vocab_parallel_losses(z, target, ctx.comm, 4 * r), fullgraph=True, backend="aot_eager"
    )
    again = compiled(local)  # one opaque node: the collectives run inside it, counted as eagerly
    (grad,) = torch.autograd.grad(again.sum(), local)
    assert torch.equal(again, losses) and torch.equal(grad, local.grad)
    assert topo.ledger.snapshot()["all_reduce/tp"]["calls"] == 6
    return _rel(losses, ref), ledger


def test_vocab_parallel_loss_is_an_operator_over_a_real_group():
    for err, forward in run_ranks(2, _vocab_parallel_op):
        assert err < 1e-6
        assert forward == {"all_reduce/tp": {"calls": 3, "bytes": 3 * 6 * 4, "wire_bytes": 3 * 6 * 4}}


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
    slices = [k[:, :, o * local : (o + 1) * local].reshape(B, T, -1) for o in range(t)]
    sum((sl * w).sum() for sl in slices).backward()  # every rank's loss on its query heads, summed
    kv = ReplicatedKV(d, n_heads, n_kv, h, False, ctx)
    with torch.no_grad():
        kv.weight.copy_(W)
    out = kv(x)
    (out * w).sum().backward()
    assert kv.weight.tp_spec.partial_grad and kv.weight.tp_spec.replicated
    return float((out - slices[r]).abs().max()), float(
        (comm.all_reduce(kv.weight.grad.clone()) - dense.grad).abs().max()
    )


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_key_value_heads_match_dense(world):
    for out_err, grad_err in run_ranks(world, _replicated_kv):
        assert out_err < 1e-6 and grad_err < 1e-5


# ---- layout invariance ---------------------------------------------------------------------

# each preset at tp 2 and 4, with and without sequence parallelism (not every pairing); then the compositions
CASES = [
    ("tiny", 1, 2, False, ()),
    ("tiny", 1, 4, True, ()),
    ("gpt2-tiny", 1, 2, True, ()),
    ("gpt2-tiny", 1, 4, False, ()),
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
def test_layout_invariance(tmp_path, cache, preset, dp, tp, sp, extra):
    """tp (x dp) ranks train like one process: losses within 1e-4 relative, gathered weights within 1e-5."""
    same_math = [e for e in extra if e.startswith("train.micro_batch")]
    ref_losses, ref_weights = reference(str(tmp_path), cache, preset, same_math)
    overrides = [cache, f"model.preset={preset}", f"parallel.sequence_parallel={str(sp).lower()}", *extra]
    results = run_ranks(dp * tp, _train, str(tmp_path), dp, tp, overrides, INVARIANCE_STEPS)
    for losses, _ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-4)
    for d in range(dp):  # each data-parallel replica's tensor-parallel ranks together hold the model
        weights = _assemble([pieces for _, pieces in results[d * tp : (d + 1) * tp]])
        assert weights.keys() == ref_weights.keys()
        for n, w in weights.items():
            assert torch.allclose(w, ref_weights[n], atol=1e-5, rtol=0), (n, (w - ref_weights[n]).abs().max())


def test_low_precision_tracks_one_process(tmp_path, cache):
    """bf16 at tp=2 with sequence parallel against bf16 on one process (20 steps).

    Measured: losses within 2.4e-4 (relative), against 1.5e-2 for a learning rate 5% lower. Weights: tensor
    parallelism sums the matmuls' partial products in bf16 across ranks, so a weight may round to its neighbour:
    all within 3.3e-3, except the norms (near 1.0: one bf16 ulp, 2^-7 = 7.8e-3) and embed.weight, where two of
    its 20480 elements (rows of rare tokens whose gradients nearly cancel; Adam normalizes the rounding noise into
    a full-size step) end 1.8e-2 apart. Every weight moves at least 2.3e-2 in the run, the embedding 3.2e-2, so a
    weight that is never updated falls outside the tolerances."""
    common = [cache, "memory.precision=bf16"]
    ref_losses, ref_weights, initial, slower = _tracking_references(str(tmp_path), common)
    results = run_ranks(2, _train, str(tmp_path), 1, 2, [*common, "parallel.sequence_parallel=true"])
    for losses, _ in results:
        assert_losses_track(losses, ref_losses, 2e-3, wrong={"lr 5% lower": slower})
    weights = _assemble([pieces for _, pieces in results])
    rest = [n for n in weights if n != "embed.weight"]
    assert_weights_track(
        {n: weights[n] for n in rest}, {n: ref_weights[n] for n in rest}, {n: initial[n] for n in rest}, 1e-2
    )
    embed = ["embed.weight"]
    assert_weights_track(
        {n: weights[n] for n in embed}, {n: ref_weights[n] for n in embed}, {n: initial[n] for n in embed}, 2.5e-2
    )


def test_default_eps_tracks_one_process(tmp_path, cache):
    """Adam's default eps (1e-8) at tp=2 with sequence parallel, against one process with it (20 steps).

    Measured: losses within 1.3e-7 relative (a learning rate 5% lower: 1.6e-2); weights within 6.6e-6 (3.8e-7
    with eps=1e-6: near-zero gradient elements, whose fp32 rounding differs between layouts, get updates of up to
    lr * g / (|g| + eps)), at tp=4 within 2.8e-6. The tolerance, 3e-5, is 4.5x the worst of these and far below
    the smallest move of any weight (2.3e-2)."""
    ref_losses, ref_weights, initial, slower = _tracking_references(str(tmp_path), [cache], eps=None)
    results = run_ranks(2, _train, str(tmp_path), 1, 2, [cache, "parallel.sequence_parallel=true"], eps=None)
    for losses, _ in results:
        assert_losses_track(losses, ref_losses, 1e-4, wrong={"lr 5% lower": slower})
    assert_weights_track(_assemble([pieces for _, pieces in results]), ref_weights, initial, 3e-5)


def _samples(tmp, tp, overrides, prompt, n_tokens):
    tr = _trainer(tmp, 1, tp, [*overrides, "train.sample_top_k=40"], steps=6)
    for _ in range(6):
        tr.train_step()
    out = []
    for temperature in (0.0, 0.8):
        tr.cfg.train.sample_temperature = temperature
        out.append(tr.sample(prompt, n_tokens))
    return out


def test_sampling_matches_one_process(tmp_path, cache):
    """After a few steps, tp=2 (with and without sequence parallel) samples exactly the text one process samples:
    greedy, and at temperature 0.8 with top-k 40 from the seeded generator (which draws the same numbers on every
    rank, so every rank must pick the same token from the gathered logits). Greedy decoding of a model this young
    repeats its most frequent token; the seeded sample walks through many tokens, and the cache, at many positions."""
    prompt, n_tokens = "import ", 20
    ((greedy, sampled),) = run_ranks(1, _samples, str(tmp_path), 1, [cache], prompt, n_tokens)
    assert len(sampled) > len(prompt) + n_tokens // 2 and len(set(sampled[len(prompt) :])) > 5, sampled  # a varied text
    for sp in (False, True):
        for rank, texts in enumerate(
            run_ranks(
                2,
                _samples,
                str(tmp_path),
                2,
                [cache, f"parallel.sequence_parallel={str(sp).lower()}"],
                prompt,
                n_tokens,
            )
        ):
            assert texts == [greedy, sampled], (sp, rank, texts, [greedy, sampled])


# ---- communication counted -----------------------------------------------------------------


def _one_step_ledger(tmp, overrides):
    tr = _trainer(tmp, 1, torch.distributed.get_world_size(), overrides, steps=2)
    tr.train_step()
    tr.topo.ledger.reset()
    tr.train_step()
    return tr.model_cfg, tr.micro_batch, tr.topo.ledger.snapshot()


@pytest.mark.parametrize("tp", [2, 4])
def test_collectives_per_step_match_megatron(tmp_path, cache, tp):
    (cfg, micro, plain), *_ = run_ranks(tp, _one_step_ledger, str(tmp_path), [cache])
    (_, _, seq_par), *_ = run_ranks(tp, _one_step_ledger, str(tmp_path), [cache, "parallel.sequence_parallel=true"])
    L, tokens = cfg.n_layers, micro * 32
    act = tokens * cfg.d_model * 4  # one activation [b, s, d] in fp32
    ring = (tp - 1) / tp
    # the cross-entropy's three [tokens] all-reduces (max, target logit, sum of exponentials) and the
    # squared gradient norm; kv heads replicated (tp=4 on 2 kv heads) add their partial gradients
    kv_partial = 0 if cfg.kv_heads % tp == 0 else 2 * L * cfg.kv_heads * cfg.head_dim * cfg.d_model * 4
    small = [tokens * 4] * 3 + [4] + ([kv_partial] if kv_partial else [])
    # two all-reduces per block forward (attention, MLP exits) and two backward (their entries),
    # the embedding's exit forward and the final norm's entry backward
    n_act = 4 * L + 2
    assert set(plain) == {"all_reduce/tp"}
    assert plain["all_reduce/tp"]["calls"] == n_act + len(small)
    assert plain["all_reduce/tp"]["bytes"] == n_act * act + sum(small)
    all_reduce_wire = n_act * 2 * ring * act  # (the ledger rounds each call; these sizes divide by tp)
    assert plain["all_reduce/tp"]["wire_bytes"] == all_reduce_wire + sum(2 * ring * b for b in small)
    # sequence parallel: each all-reduce becomes a reduce-scatter (of the activation) + all-gather (of a 1/tp
    # shard) pair of the same wire volume; each region's input is gathered again in backward (attention, MLP,
    # output layer)
    regathers = 2 * L + 1
    assert seq_par["reduce_scatter/tp"] == {"calls": n_act, "bytes": n_act * act, "wire_bytes": n_act * ring * act}
    assert seq_par["all_gather/tp"] == {
        "calls": n_act + regathers,
        "bytes": (n_act + regathers) * act // tp,
        "wire_bytes": (n_act + regathers) * (tp - 1) * act // tp,
    }
    assert n_act * ring * act + n_act * (tp - 1) * act // tp == all_reduce_wire  # the pairs' wire volume
    norms = (2 * L + 1) * cfg.d_model * 4  # norm weights see only their positions: partial gradients summed
    assert seq_par["all_reduce/tp"]["calls"] == 5  # all partial gradients in one all-reduce
    assert seq_par["all_reduce/tp"]["bytes"] == sum(small) + norms
    partial = kv_partial + norms  # the gradient norm, then the partial gradients
    assert seq_par["all_reduce/tp"]["wire_bytes"] == sum(2 * ring * b for b in [tokens * 4] * 3 + [4, partial])
    assert set(seq_par) == {"reduce_scatter/tp", "all_gather/tp", "all_reduce/tp"}
    # the library states these formulas once (the planner's time model reads them): the same numbers
    for got, sp in ((plain, False), (seq_par, True)):
        formula = {f"{op}/tp": v for op, v in region_wire_bytes(tokens, cfg.d_model, 4, tp, sp, L).items()}
        partial = partial_grad_elements(cfg, tp, sp) * 4
        calls, nbytes, wire = formula["all_reduce/tp"]
        step = [4] + ([partial] if partial else [])  # the gradient norm and the partial gradients, once a step
        formula["all_reduce/tp"] = (
            calls + len(step),
            nbytes + sum(step),
            wire + sum(round(2 * ring * b) for b in step),
        )
        assert {k: (v["calls"], v["bytes"], v["wire_bytes"]) for k, v in got.items()} == formula, (sp, got, formula)


# ---- activation memory ---------------------------------------------------------------------


def _entry_after_a_step(tmp, cache):
    tr = _trainer(tmp, 1, 2, [cache, "parallel.sequence_parallel=true"], steps=1)
    tr.train_step()
    return tr.model.output.ctx._entry is None


def test_sequence_parallel_model_keeps_no_region_entry_past_its_forward(tmp_path, cache):
    """The latest gathered activation (the next column-parallel layer reuses it) is dropped when the model's forward
    ends, so none is held past it (the pipeline stage's twin: test_pipeline.py)."""
    assert run_ranks(2, _entry_after_a_step, str(tmp_path), cache) == [True, True]


def _activations(tmp, cache, preset, sp, seq=64, batch=4):
    tp = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    tr = _trainer(
        tmp,
        1,
        tp,
        [
            cache,
            f"model.preset={preset}",
            f"parallel.sequence_parallel={str(sp).lower()}",
            f"data.seq_len={seq}",
            f"train.micro_batch={batch}",
            f"train.global_batch={batch}",
        ],
        steps=1,
    )
    x, y = tr.train_data.micro_batches(0, batch, batch)[0]
    with ActivationMeter(tr.model) as meter:
        loss = tr._loss(x, y)
    loss.backward()
    return tr.model_cfg, meter.per_layer


@pytest.mark.parametrize("preset", ["tiny", "gpt2-tiny"])
def test_sequence_parallel_shrinks_activations_as_megatron_predicts(tmp_path, cache, preset):
    """Every byte each rank saves, per layer and for the head, equals the formula (tp=4 replicates llama's kv heads)."""
    ((cfg, one),) = run_ranks(1, _activations, str(tmp_path), cache, preset, False)
    base = one["layers.0"]
    assert base == activation_bytes(cfg, 4, 64)["layer"]
    for tp in (2, 4):
        plain = [m for _, m in run_ranks(tp, _activations, str(tmp_path), cache, preset, False)]
        seq = [m for _, m in run_ranks(tp, _activations, str(tmp_path), cache, preset, True)]
        for name, per_rank in (("tp", plain), ("tp+sp", seq)):
            predicted = activation_bytes(cfg, 4, 64, tp=tp, sequence_parallel=name == "tp+sp")
            expected = {"head": predicted["head"], **{f"layers.{i}": predicted["layer"] for i in range(cfg.n_layers)}}
            for rank, measured in enumerate(per_rank):
                assert measured == expected, (name, tp, rank)
        # Megatron: tp alone splits only the matmul parts (heads, MLP width); what the norms keep
        # (and the linears after them) stays whole -- with sequence parallel it is split too
        plain, seq = plain[0], seq[0]
        norms_whole = plain["layers.0"] - seq["layers.0"]
        assert norms_whole * tp == (tp - 1) * _norm_bytes(cfg, 4 * 64)
        if cfg.kv_heads % tp == 0:  # every part of the layer split: exactly 1/tp of one device's activations
            assert seq["layers.0"] * tp == base


def _norm_bytes(cfg, tokens):
    """What a layer's two norms keep for backward over ``tokens`` positions (fp32)."""
    d = cfg.d_model
    one = (
        8 * tokens * d + 4 * tokens if cfg.flavor == "llama" else 8 * tokens * d + 8 * tokens
    )  # llama: input, 1/rms, output
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


def test_checkpoint_resume_with_dropout_same_layout(tmp_path, cache):
    """Shards with their global shapes and offsets; per-rank random states restored: dropout continues exactly."""
    common = [cache, "parallel.sequence_parallel=true", "model.dropout=0.1", "parallel.zero=1"]
    first = run_ranks(4, _first_half, str(tmp_path), 2, 2, common, "a")
    path = first[0][0]
    second = run_ranks(4, _second_half, str(tmp_path), 2, 2, common, path, "b")
    for (tail, _), (_, s, _) in zip(second, first):
        assert tail == s[4:]
    final, resumed = _assemble([f[2] for f in first[:2]]), _assemble([s[1] for s in second[:2]])
    for n in final:
        assert torch.equal(final[n], resumed[n]), n


def test_checkpoint_loads_at_another_layout(tmp_path, cache):
    """tp=2 with sequence parallel -> dp=2 with ZeRO-1, and -> tp=4: the same continuation."""
    (path, straight, _), _ = run_ranks(
        2, _first_half, str(tmp_path), 1, 2, [cache, "parallel.sequence_parallel=true"], "a"
    )
    for tail, _ in run_ranks(2, _second_half, str(tmp_path), 2, 1, [cache, "parallel.zero=1"], path, "b"):
        assert tail == pytest.approx(straight[4:], rel=1e-4)
    for tail, _ in run_ranks(4, _second_half, str(tmp_path), 1, 4, [cache], path, "c"):
        assert tail == pytest.approx(straight[4:], rel=1e-4)


# ---- memory report -------------------------------------------------------------------------


def _report(tmp, dp, tp, overrides):
    from trickles.memory.report import measure, predict

    tr = _trainer(tmp, dp, tp, [*overrides, "train.global_batch=4", "data.seq_len=64"], steps=3)
    rep = predict(tr.cfg, tr.topo.dims, tr.model_cfg, dp_rank=tr.dp.rank)  # ZeRO ranks own different segments
    measure(tr, rep, steps=2)
    return rep.predicted, rep.measured


# (elementwise recomputation drops each norm's and the activation's output from what the report predicts without it:
# the plain terms are checked through it)
@pytest.mark.parametrize(
    "dp,tp,extra",
    [
        (1, 2, ["parallel.sequence_parallel=true", "memory.recompute=elementwise"]),
        (2, 2, ["parallel.zero=1", "memory.recompute=elementwise"]),
        (1, 4, ["parallel.sequence_parallel=true", "memory.recompute=selective"]),
    ],
    ids=["tp2-sp-elementwise", "dp2-tp2-zero1-elementwise", "tp4-sp-selective"],
)
def test_memory_report_predicts_each_tensor_parallel_rank(tmp_path, cache, dp, tp, extra):
    """The report's prediction for each rank equals what that rank holds, to the byte."""
    for rank, (predicted, measured) in enumerate(run_ranks(dp * tp, _report, str(tmp_path), dp, tp, [cache, *extra])):
        for key in ("parameters", "gradients", "optimizer", "activations", "head"):
            assert measured[key] == predicted[key], (rank, key, measured[key] - predicted[key], predicted, measured)
