"""Pipeline parallel: layout invariance of every schedule (alone and with dp, tp, ZeRO-1, sequence parallel and
recomputation; also with Adam's default eps), live micro-batches counted in the executor, point-to-point bytes against
the formula, the executed and traced action order against the schedule's and the bubble counted on its timeline,
fp16 overflow skipping through the stages, checkpoints, evaluation and sampling through the stages.

Timing the bubble is a benchmark's business (``benchmarks/pipeline_parallel.py`` prints it measured next to the
formula)."""

import os
from fractions import Fraction

import pytest
import torch
from helpers import assert_losses_track, assert_weights_track, tiny_config

from trickles.parallel.pipeline.schedules import Shape, build, compute_order
from trickles.parallel.pipeline.stages import send_bytes
from trickles.parallel.pipeline.timeline import simulate
from trickles.testing import run_ranks
from trickles.train.load import load_for_inference
from trickles.train.trainer import Trainer

STEPS = 10
INVARIANCE_STEPS = 6  # the fp32 layout-invariance cases: a wrong gradient, shard or message shows in the first steps
CPU = torch.device("cpu")
# Adam eps as in the tensor-parallel tests: with tp in the layout, fp32 rounding of near-zero gradients
# would otherwise dominate the weight comparison (see test_tensor_parallel.py); the default eps has its own case
# (test_default_eps_through_stages_and_tensor_parallel_tracks_one_process).
COMMON = ("parallel.bucket_mb=0.05", "train.eps=1e-6", "train.micro_batch=2")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """This run's tokenized-data cache, shared by the module's tests (spawned ranks get it in their overrides)."""
    return f"data.cache_dir={tmp_path_factory.mktemp('pipeline-cache')}"


def _trainer(tmp, dp, tp, pp, overrides, steps=STEPS):
    cfg = tiny_config(tmp, *COMMON, f"parallel.tp={tp}", f"parallel.pp={pp}", *overrides, steps=steps)
    return Trainer(cfg, cfg.validate(dp * tp * pp).build(CPU), quiet=True)


def _pieces(engine):
    """``{name: (tensor, global shape, offset)}`` of every parameter this rank holds."""
    out, specs = {}, engine.placements()
    for name, p in engine.full_state().items():
        spec = specs.get(name)
        shape, offset = (spec.global_shape, spec.offset) if spec else (tuple(p.shape), (0,) * p.dim())
        out[name] = (p.detach().float().clone(), shape, offset)
    return out


def _assemble(per_rank):
    """Whole parameters from the pieces of the ranks of one data-parallel replica (stages x tp ranks);
    pieces of the same region held twice (tp-replicated, or a weight tied across stages) must agree."""
    whole, seen = {}, {}
    for pieces in per_rank:
        for name, (t, shape, offset) in pieces.items():
            full = whole.setdefault(name, torch.full(shape, float("nan")))
            block = tuple(slice(o, o + n) for o, n in zip(offset, t.shape))
            key = (name, tuple(offset))
            if key in seen:
                assert torch.equal(t, seen[key]), f"the copies of {name} drifted apart"
            seen[key] = t
            full[block] = t
    for name, full in whole.items():
        assert not full.isnan().any(), f"the pieces of {name} do not cover it"
    return whole


def _train(tmp, dp, tp, pp, overrides, steps=STEPS, initial=False):
    """Losses, this rank's pieces, peak live micro-batches, bytes sent in the last step, micro-batch, d_model
    (``initial``: and this rank's pieces before the first step)."""
    tr = _trainer(tmp, dp, tp, pp, overrides, steps)
    start = _pieces(tr.engine) if initial else None
    losses = []
    for i in range(steps):
        if i == steps - 1:
            tr.topo.ledger.reset()
        losses.append(tr.train_step()["loss"])
    sent = {k: v["bytes"] for k, v in tr.topo.ledger.snapshot().items() if k.startswith("send/")}
    peak = tr.pipeline.peak_alive if tr.pipeline else None
    out = losses, _pieces(tr.engine), peak, sent, tr.micro_batch, tr.model_cfg.d_model
    return (*out, start) if initial else out


_REFERENCE = {}


def reference(tmp, cache, preset, layers, extra=()):
    """One process's losses and weights, computed once per run (keyed by the run's cache directory too)."""
    key = (cache, preset, layers, tuple(extra))
    if key not in _REFERENCE:
        losses, pieces, *_ = _train(
            tmp, 1, 1, 1, [cache, f"model.preset={preset}", f"model.n_layers={layers}", *extra], INVARIANCE_STEPS
        )
        _REFERENCE[key] = losses, _assemble([pieces])
    return _REFERENCE[key]


# (preset, layers, dp, tp, pp, schedule, extra)
# (plain pp=2 1f1b is covered by the uneven 7-layer case and by the recomputed one)
CASES = [
    ("tiny", 8, 1, 1, 2, "gpipe", ()),
    ("tiny", 8, 1, 1, 4, "1f1b", ()),
    ("tiny", 8, 1, 1, 4, "interleaved", ("parallel.virtual_stages=2",)),
    ("tiny", 7, 1, 1, 2, "1f1b", ()),  # uneven: [4, 3]
    ("tiny", 7, 1, 1, 3, "gpipe", ("parallel.pipeline_layers=[1, 4, 2]",)),
    ("gpt2-tiny", 8, 1, 1, 2, "1f1b", ()),  # tied embedding on the first and last stage
    ("tiny", 8, 2, 1, 2, "1f1b", ("parallel.zero=1",)),
    ("tiny", 8, 1, 1, 2, "1f1b", ("memory.recompute=full",)),
    # tensor x pipeline, interleaved, with sequence parallelism; each rank's first two layers recomputed whole (their
    # linears keep the gathered input), the other two selectively (memory.recompute_num_layers)
    (
        "gpt2-tiny",
        8,
        1,
        2,
        2,
        "interleaved",
        (
            "parallel.virtual_stages=2",
            "train.micro_batch=1",
            "parallel.sequence_parallel=true",
            "memory.recompute=full",
            "memory.recompute_num_layers=2",
            "memory.recompute_rest=selective",
        ),
    ),
]


def _case_id(c):
    preset, layers, dp, tp, pp, schedule, extra = c
    return f"{preset}-L{layers}-dp{dp}-tp{tp}-pp{pp}-{schedule}" + "".join(
        f"-{e.split('.')[-1].split('=')[0]}" for e in extra
    )


@pytest.mark.parametrize("preset,layers,dp,tp,pp,schedule,extra", CASES, ids=[_case_id(c) for c in CASES])
def test_layout_invariance(tmp_path, cache, preset, layers, dp, tp, pp, schedule, extra):
    """Every rank's losses within 1e-4 relative of one process's, gathered weights within 1e-5, over 6 steps."""
    ref_losses, ref_weights = reference(str(tmp_path), cache, preset, layers)
    overrides = [cache, f"model.preset={preset}", f"model.n_layers={layers}", f"parallel.schedule={schedule}", *extra]
    results = run_ranks(dp * tp * pp, _train, str(tmp_path), dp, tp, pp, overrides, INVARIANCE_STEPS, timeout=600)
    for losses, *_ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-4)
    inner = dp * tp
    for d in range(dp):  # the stages x tp ranks of each data-parallel replica together hold the model
        replica = [results[s * inner + d * tp + t][1] for s in range(pp) for t in range(tp)]
        weights = _assemble(replica)
        assert weights.keys() == ref_weights.keys()
        for n, w in weights.items():
            assert torch.allclose(w, ref_weights[n], atol=1e-5, rtol=0), (n, (w - ref_weights[n]).abs().max())
    _check_memory_and_messages(results, dp, tp, pp, schedule, extra)


def _check_memory_and_messages(results, dp, tp, pp, schedule, extra):
    """Live micro-batches as the schedule promises; activations and gradients sent as the formula says."""
    v = 2 if "parallel.virtual_stages=2" in extra else 1
    sp = "parallel.sequence_parallel=true" in extra
    for rank, (_, _, peak, sent, micro, d) in enumerate(results):
        stage = rank // (dp * tp)
        m = 8 // dp // micro
        if schedule == "gpipe":
            assert peak == m
        elif schedule == "1f1b":
            assert peak == min(pp - stage, m) <= pp
        else:
            assert peak == min(2 * (pp - stage - 1) + (v - 1) * pp + 1, v * m)
        act = micro * (32 // (tp if sp else 1)) * d * 4  # one [b, T (/ tp), d] fp32 tensor
        chunks = [c * pp + stage for c in range(v)]
        forward = sum(s < pp * v - 1 for s in chunks) * m * act
        backward = sum(s > 0 for s in chunks) * m * act
        assert send_bytes(Shape(pp, v, m), stage, act) == (forward, backward)  # the library's statement of it
        assert sent.get("send/pp", 0) == forward and sent.get("send/pp_grad", 0) == backward, (rank, sent)


# ---- the schedule as executed, and its bubble ---------------------------------------------


def _executed(tmp, overrides, schedule, v):
    """One traced step: the actions this rank's executor ran (messages as posted, computes as run), in order; the
    compute actions its trace recorded; the schedule's lists; the gathered trace's rows (pipeline rank 0)."""
    tr = _trainer(
        tmp,
        1,
        1,
        torch.distributed.get_world_size(),
        [
            *overrides,
            "model.n_layers=8",
            "train.micro_batch=1",
            f"parallel.schedule={schedule}",
            f"parallel.virtual_stages={v}",
            "train.pipeline_trace=x.png",
        ],
        steps=1,
    )
    runner, ran = tr.pipeline, []
    post, forward, backward, weight = runner._post, runner._forward, runner._backward, runner._weight
    runner._post = lambda run, micro: (ran.extend(run), post(run, micro))[1]
    runner._forward = lambda a, *args: (ran.append(a), forward(a, *args))[1]
    runner._backward = lambda a, *args: (ran.append(a), backward(a, *args))[1]
    runner._weight = lambda a: (ran.append(a), weight(a))[1]
    tr.train_step()
    timeline = runner.gather_trace()
    rows = None if timeline is None else [[(a, s, e) for a, s, e in row] for row in timeline.spans]
    traced = [a for a, _, _ in runner.last_trace]
    return ran, traced, runner.shape, runner.early_receives, rows


@pytest.mark.parametrize("schedule,pp,v", [("gpipe", 2, 1), ("1f1b", 4, 1), ("interleaved", 2, 2)])
def test_each_rank_runs_its_schedule_in_order_and_its_timeline_has_the_formula_bubble(tmp_path, cache, schedule, pp, v):
    """By order and counts, not by the clock: every rank's executor posts and runs exactly its list from
    :func:`build` (gloo: early receives), in that order; the trace records each compute once, in the schedule's
    order, and the gathered trace has every rank's row; replaying the executed lists on unit slots (forward and
    backward one slot each, or 1 and 2) every rank is busy ``2 v m`` (``3 v m``) slots and idle exactly
    ``(p - 1)(t_f + t_b)``: the idle fraction is ``(p - 1) / (v m + p - 1)`` exactly.
    (The bubble timed on real stages is printed by ``benchmarks/pipeline_parallel.py``.)"""
    results = run_ranks(pp, _executed, str(tmp_path), [cache], schedule, v)
    shape = results[0][2]
    assert shape == Shape(pp, v, 8)  # global batch 8 in micro-batches of 1
    lists = build(schedule, shape, early_receives=results[0][3])
    assert results[0][3]  # gloo posts a step's receives early
    for rank, (ran, traced, _, _, _) in enumerate(results):
        assert ran == lists[rank], rank  # every message and compute once, in the list's order
        assert traced == [a for a in ran if a.is_compute] == compute_order(schedule, shape, rank), rank
    rows = results[0][4]
    assert [[a for a, _, _ in row] for row in rows] == [r[1] for r in results]  # rank 0 gathered every stage's row
    for row in rows:  # each rank's computes one after another, none overlapping the next
        assert all(s <= e for _, s, e in row) and all(e <= s2 for (_, _, e), (_, s2, _) in zip(row, row[1:]))

    executed = [r[0] for r in results]
    p, vm = shape.p, shape.v * shape.m
    for tf, tb in ((1, 1), (1, 2)):
        timeline = simulate(executed, shape, float(tf), float(tb))  # raises on a deadlock or a mismatched message
        makespan = Fraction(timeline.makespan)
        assert makespan == (vm + p - 1) * (tf + tb)
        for row in timeline.spans:
            forwards = sum(a.kind == "F" for a, _, _ in row)
            backwards = sum(a.kind == "B" for a, _, _ in row)
            busy = sum(Fraction(e) - Fraction(s) for _, s, e in row)
            assert forwards == backwards == vm and busy == vm * (tf + tb)
            assert makespan - busy == (p - 1) * (tf + tb)
            assert (makespan - busy) / makespan == Fraction(p - 1, vm + p - 1)


# ---- checkpoints, evaluation, sampling -----------------------------------------------------


def _first_half(tmp, dp, tp, pp, overrides):
    tr = _trainer(tmp, dp, tp, pp, [*overrides, f"train.out_dir={tmp}/a", "train.eval_batches=2"], steps=8)
    losses = [tr.train_step()["loss"] for _ in range(4)]
    path = tr.save_checkpoint()
    straight = losses + [tr.train_step()["loss"] for _ in range(4)]
    return path, straight, tr.evaluate(), tr.sample("def ", 16)


def _second_half(tmp, dp, tp, pp, overrides, path):
    tr = _trainer(tmp, dp, tp, pp, [*overrides, f"train.out_dir={tmp}/b", "train.eval_batches=2"], steps=8)
    tr.load_checkpoint(path)
    return [tr.train_step()["loss"] for _ in range(4)]


def _cached_decoding_gap(tmp, cache):
    from trickles.parallel.pipeline.runner import PipelinedModel

    tr = _trainer(tmp, 1, 1, 2, [cache, "model.preset=gpt2-tiny", "model.n_layers=4"], steps=1)
    model = PipelinedModel(tr.pipeline, tr.model, tr.model_cfg.vocab_size).eval()
    tokens = tr.train_data.micro_batches(0, 1, 1)[0][0][:, :8]
    with torch.no_grad():
        whole = [model(tokens[:, : i + 1])[:, -1] for i in range(8)]  # each prefix through the stages, no cache
        kv = model.new_cache(1, 8)
        cached = [model(tokens[:, i : i + 1], cache=kv, start=i)[:, -1] for i in range(8)]  # one token at a time
    return max(float((a - b).abs().max()) for a, b in zip(whole, cached))


def test_decoding_through_the_stages_with_their_caches_gives_the_whole_sequences_logits(tmp_path, cache):
    """``generate`` through a pipeline feeds one token at a time to the stages' key/value caches: every position's
    logits equal the whole prefix's (fp32, summation order aside). An 8-step model's samples barely depend on
    their context, so comparing samples alone would not see a cache that is not kept."""
    assert all(gap < 1e-4 for gap in run_ranks(2, _cached_decoding_gap, str(tmp_path), cache))


def test_checkpoint_each_stage_saves_its_part_and_loads_at_another_layout(tmp_path, cache):
    """pp=2 (gpt2, tied) -> the same layout exactly, -> one process and -> pp=4 interleaved approximately; the
    checkpoint also loads whole for inference. Evaluation and sampling through the stages match one process."""
    common = [cache, "model.preset=gpt2-tiny", "model.n_layers=8"]
    first = run_ranks(2, _first_half, str(tmp_path), 1, 1, 2, common)
    path, straight, val, sample = first[0]
    assert all(f[1] == straight and f[2] == val and f[3] == sample for f in first)
    names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    assert names == [
        "model-rank00000.safetensors",
        "model-rank00001.safetensors",
        "optimizer-rank00000.safetensors",
        "optimizer-rank00001.safetensors",
    ]
    for tail in run_ranks(2, _second_half, str(tmp_path), 1, 1, 2, common, path):
        assert tail == straight[4:]
    ((one_path, one_straight, one_val, one_sample),) = run_ranks(1, _first_half, str(tmp_path / "one"), 1, 1, 1, common)
    assert one_straight == pytest.approx(straight, rel=1e-5) and one_val == pytest.approx(val, rel=1e-5)
    assert one_sample == sample
    (tail,) = run_ranks(1, _second_half, str(tmp_path), 1, 1, 1, common, path)
    assert tail == pytest.approx(straight[4:], rel=1e-4)
    for tail in run_ranks(
        4,
        _second_half,
        str(tmp_path),
        1,
        1,
        4,
        [*common, "parallel.schedule=interleaved", "parallel.virtual_stages=2"],
        path,
    ):
        assert tail == pytest.approx(straight[4:], rel=1e-4)
    model, _, meta = load_for_inference(path)
    assert meta["layout"]["pp"] == 2 and len(model.layers) == 8
    assert model.output.weight is model.embed.weight


# ---- one call per step ---------------------------------------------------------------------


def _api_step(tmp, cache):
    from trickles.optim import lr_at

    # a tied embedding: its gradient is summed over the first and last stage by the step's finish_backward
    overrides = [
        cache,
        "model.n_layers=4",
        "parallel.schedule=1f1b",
        "train.grad_clip=0.5",
        "model.tie_embeddings=true",
    ]
    by_trainer = _trainer(tmp, 1, 1, 2, overrides, steps=4)
    by_api = _trainer(tmp, 1, 1, 2, overrides, steps=4)
    t = by_api.cfg.train
    losses = [], []
    for step in range(2):
        losses[0].append(by_trainer.train_step()["loss"])
        micro = by_api.train_data.micro_batches(step * t.global_batch, t.global_batch, by_api.micro_batch)
        tokens, targets = torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])
        lr = lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
        losses[1].append(by_api.pipeline.train_step(tokens, targets, lr, t.grad_clip))
    return losses, _pieces(by_trainer.engine), _pieces(by_api.engine), len(by_api.pipeline.last_trace)


def test_pipeline_train_step_is_one_call_per_step(tmp_path, cache):
    """``engine.pipeline.train_step(tokens, targets, lr, clip)`` does what the trainer's step does (and records no
    timeline unless asked: ``--pipeline-trace``)."""
    for (by_trainer, by_api), a, b, traced in run_ranks(2, _api_step, str(tmp_path), cache):
        assert by_api == by_trainer and traced == 0
        assert a.keys() == b.keys() and all(torch.equal(a[n][0], b[n][0]) for n in a)


# ---- low precision and the default eps: the same precision on one process, tolerances that reject a wrong run ----


def _tracked(tmp, cache, pp, tp, overrides, steps):
    """Every rank's losses, the replica's whole weights after ``steps`` and before the first (a helper for the
    checks below: one process and a pipeline of ``pp`` stages x ``tp`` tensor-parallel ranks, the same settings)."""
    results = run_ranks(pp * tp, _train, tmp, 1, tp, pp, [cache, *overrides], steps, initial=True)
    return [r[0] for r in results], _assemble([r[1] for r in results]), _assemble([r[-1] for r in results])


def _lr_off(tmp, overrides):
    """The same run with a learning rate 5% too low: a wrong run every tolerance here must reject."""
    return [*overrides, f"train.lr={0.95 * tiny_config(tmp).train.lr!r}"]


_ONE_PROCESS = {}


@pytest.mark.parametrize("precision,steps,schedule", [("bf16", 10, "1f1b"), ("fp16", 8, "1f1b"), ("bf16", 10, "zb-h1")])
def test_low_precision_through_the_stages_tracks_one_process(tmp_path, cache, precision, steps, schedule):
    """Low-precision activations and gradients cross the stages; fp16 scales the loss on the last stage. The
    pipeline's losses and weights track one process at the same precision, closer than a run with a learning
    rate 5% off and than a weight never updated. (fp16: fewer steps; this CPU emulates fp16 matmuls slowly.)
    ZB-H1: the weights' gradients computed apart from the input's (W after B) in bf16."""
    overrides = ["model.n_layers=4", f"memory.precision={precision}"]
    key = (cache, precision, steps)  # one process's runs serve every schedule at this precision
    if key not in _ONE_PROCESS:
        _ONE_PROCESS[key] = (
            _tracked(str(tmp_path), cache, 1, 1, overrides, steps),
            _tracked(str(tmp_path), cache, 1, 1, _lr_off(str(tmp_path), overrides), steps)[0],
        )
    ((one,), one_w, initial), (off,) = _ONE_PROCESS[key]
    losses, weights, _ = _tracked(str(tmp_path), cache, 2, 1, [*overrides, f"parallel.schedule={schedule}"], steps)
    for rank_losses in losses:
        # the first forward computes the same numbers; later steps drift apart by rounding alone (the gradient norm
        # is summed over the stages in another order, and a low-precision weight then rounds differently now and then)
        assert rank_losses[0] == pytest.approx(one[0], rel=1e-6)
        assert_losses_track(rank_losses, one, LOW_LOSS_TOL[precision], wrong={"lr 5% off": off})
    assert_weights_track(weights, one_w, initial, LOW_WEIGHT_TOL[precision])


# Measured (4 layers, pp=2 vs one process): bf16 over 10 steps, losses and weights equal (the lr-5%-off run: 1.1e-2;
# the least-moved weight moved 1.3e-2; over 20 steps a norm weight rounded the other way, 7.8e-3 = one bf16 ulp in
# [1, 2), and losses 6.6e-4 apart); fp16 over 8 steps, losses 1.1e-6 and weights 1.5e-4 apart (lr 5% off: 9.2e-3;
# least moved 1.2e-2). Tolerances: bf16 about one
# ulp (2^-8 relative = 3.9e-3 for the losses; 1e-2 absolute for the weights, above one ulp at 1.0, below the least
# move); fp16 about two ulps (2^-11 relative = 4.9e-4; 2^-10 absolute at 1.0 = 9.8e-4).
LOW_LOSS_TOL = {"bf16": 4e-3, "fp16": 1e-3}
LOW_WEIGHT_TOL = {"bf16": 1e-2, "fp16": 2e-3}


def _overflow(tmp, cache):
    """fp16 through 2 stages; at step 3 an inf enters the gradients on stage 0 only (behind layer 0, so
    stage 1's own gradients stay finite). Returns what the skipped step did and how the scale went on."""
    tr = _trainer(
        tmp,
        1,
        1,
        2,
        [
            cache,
            "memory.precision=fp16",
            "memory.loss_scale_hysteresis=1",
            "memory.loss_scale_growth_interval=3",
            "memory.loss_scale=1024",
        ],
        steps=6,
    )
    for _ in range(2):
        tr.train_step()
    weights = {k: v.clone() for k, v in tr.engine.full_state().items()}
    state = {k: v[0].clone() for k, v in tr.engine.optimizer.state_tensors().items()}
    scale, local = tr.scaler.scale, {}
    handle = None
    if tr.pipeline.rank == 0:

        def poison(module, args, out):
            out.register_hook(lambda g: torch.full_like(g, float("inf")))

        handle = tr.model.layers["0"].register_forward_hook(poison)
    grads_of = tr.engine.clip_grad_norm

    def clip(max_norm):  # what this stage's own gradients held before the norm was summed over the stages
        local["finite"] = all(bool(torch.isfinite(g).all()) for g in tr.engine.owned_grads())
        return grads_of(max_norm)

    tr.engine.clip_grad_norm = clip
    bad = tr.train_step()
    del tr.engine.clip_grad_norm
    if handle is not None:
        handle.remove()
    untouched = all(torch.equal(weights[k], v) for k, v in tr.engine.full_state().items()) and all(
        torch.equal(state[k], v[0]) for k, v in tr.engine.optimizer.state_tensors().items()
    )
    backed_off = tr.scaler.scale
    good = [tr.train_step() for _ in range(3)]
    return (
        local["finite"],
        bad["skipped"],
        tr.skipped,
        untouched,
        scale,
        backed_off,
        tr.scaler.scale,
        [g["skipped"] for g in good],
        [g["loss_scale"] for g in good],
    )


def test_fp16_overflow_on_one_stage_skips_the_step_on_every_stage(tmp_path, cache):
    """An inf gradient on stage 0 alone: the gradient norm summed over the stages is inf on both, so both skip the
    step -- weights and Adam state bit for bit as before -- the scale halves (hysteresis 1), and three good steps
    (growth interval 3) bring it back."""
    (finite0, *first), (finite1, *second) = run_ranks(2, _overflow, str(tmp_path), cache)
    assert not finite0 and finite1  # the overflow was stage 0's alone
    assert first == second
    skipped, total, untouched, scale, backed_off, grown, later, scales = first
    assert skipped and total == 1
    assert untouched, "weights and optimizer state must not change on a skipped step"
    assert backed_off == scale / 2
    assert later == [False, False, False] and scales == [scale / 2] * 3 and grown == scale


def test_default_eps_through_stages_and_tensor_parallel_tracks_one_process(tmp_path, cache):
    """Adam's default eps (1e-8; the other cases use 1e-6): pp=2 x tp=2 tracks one process with the same eps."""
    from trickles.train.config import TrainConfig

    overrides = [
        "model.n_layers=4",
        "parallel.schedule=1f1b",
        f"train.eps={TrainConfig().eps!r}",
    ]  # back to the default
    (one,), one_w, initial = _tracked(str(tmp_path), cache, 1, 1, overrides, STEPS)
    (off,), _, _ = _tracked(str(tmp_path), cache, 1, 1, _lr_off(str(tmp_path), overrides), STEPS)
    losses, weights, _ = _tracked(str(tmp_path), cache, 2, 2, overrides, STEPS)
    # measured over 10 steps of 4 layers: losses 1.1e-7 relative, weights 2.4e-6 absolute (the lr-5%-off run: 1.1e-2
    # in loss; 20 steps: 1.9e-7, 1.0e-5, 2.0e-2), so Adam's default eps under pp x tp is about as tight as the
    # 1e-4 / 1e-5 of the fp32 cases; tolerances 5-100x the measured gap
    for rank_losses in losses:
        assert_losses_track(rank_losses, one, 2e-5, wrong={"lr 5% off": off})
    assert_weights_track(weights, one_w, initial, 5e-5)


def _entries_after_a_step(tmp, cache):
    tr = _trainer(tmp, 1, 2, 2, [cache, "parallel.sequence_parallel=true"], steps=1)
    tr.train_step()
    return tr.engine.pipeline.tp_ctx._entry is None


def test_sequence_parallel_stage_keeps_no_region_entry_past_its_forward(tmp_path, cache):
    """Each stage's forward under sequence parallelism forgets its last region entry (the gathered activation it
    kept for a column-parallel layer's backward) once the forward is over, as the whole model's forward does."""
    assert run_ranks(4, _entries_after_a_step, str(tmp_path), cache) == [True] * 4


def _outputs_alive_at_each_backward(tmp, cache):
    """Per backward of pipeline rank 0 (1F1B, 4 micro-batches): which of its earlier forwards' outputs still exist."""
    tr = _trainer(tmp, 1, 1, 2, [cache, "train.global_batch=8"], steps=1)
    runner, storages, alive = tr.pipeline, {}, []
    hand, backward = runner._hand_over, runner._backward

    def handing(a, t):
        storages[a.micro] = t.untyped_storage()._weak_ref()
        return hand(a, t)

    def backwards(a, grad):
        alive.append(sorted(i for i, ref in storages.items() if not torch.UntypedStorage._expired(ref)))
        return backward(a, grad)

    runner._hand_over, runner._backward = handing, backwards
    tr.train_step()
    return alive


def test_a_stage_output_is_freed_once_sent(tmp_path, cache):
    """The first stage keeps its outputs only until their sends are seen through (its backward starts from the
    output's place in the graph): at each of its backwards none of the outputs it sent is still alive."""
    first, _ = run_ranks(2, _outputs_alive_at_each_backward, str(tmp_path), cache)
    assert first == [[], [], [], []]
