"""ZeRO stages 0-3 (with accumulation and CPU offload): layout invariance, memory and bytes counted."""

import gc
import os

import pytest
import torch
import torch.distributed as dist
from helpers import assert_losses_track, assert_updates_track, assert_weights_track, tiny_config

from trickles.comm import wire_bytes
from trickles.memory.accounting import FP32_ADAM, live_tensor_bytes, zero_model_state_bytes
from trickles.parallel.reduction import reduction_wire_bytes
from trickles.testing import run_ranks
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

STEPS = 20
INVARIANCE_STEPS = 6  # the fp32 layout-invariance cases: a wrong gradient, shard or message shows in the first steps


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """This run's tokenized-data cache, shared by the module's tests (spawned ranks get it in their overrides)."""
    return f"data.cache_dir={tmp_path_factory.mktemp('zero-cache')}"


def _trainer(tmp, dp, overrides, steps=STEPS):
    cfg = tiny_config(tmp, "parallel.bucket_mb=0.05", *overrides, steps=steps)
    return Trainer(cfg, ParallelDims(dp=dp).build(torch.device("cpu")), quiet=True)


def _train(tmp, dp, overrides, steps=STEPS, initial=False, norms=False):
    """Losses and the final weights (``initial``: and the weights before the first step; ``norms``: and each step's
    gradient norm before clipping)."""
    tr = _trainer(tmp, dp, overrides, steps)
    start = {k: v.clone() for k, v in tr.engine.full_state().items()} if initial else None
    records = [tr.train_step() for _ in range(steps)]
    losses = [r["loss"] for r in records]
    if norms:
        return losses, tr.engine.full_state(), [r["grad_norm"] for r in records]
    return (losses, tr.engine.full_state(), start) if initial else (losses, tr.engine.full_state())


_REFERENCE = {}


def reference(tmp, cache, accumulate):
    """One process's losses and weights, computed once per run (keyed by the run's cache directory too)."""
    key = (cache, accumulate)
    if key not in _REFERENCE:
        _REFERENCE[key] = _train(
            tmp, 1, [cache, *(["train.micro_batch=2"] if accumulate else [])], INVARIANCE_STEPS, norms=True
        )
    return _REFERENCE[key]


# one case per idea, not the cross-product: every stage at 2 and 4 ranks, with accumulation (ZeRO-2/3 reduce on
# every micro-step) and with the optimizer offloaded (stages 1-3), each pairing at least once
CASES = [
    (0, 2, False, False),
    (0, 4, True, False),
    (1, 2, True, False),
    (1, 4, False, True),
    (2, 2, False, True),
    (2, 4, True, False),
    (2, 2, True, True),
    (3, 2, True, False),
    (3, 4, False, True),
    (3, 2, True, True),
]


@pytest.mark.parametrize(
    "stage,dp,accumulate,offload",
    CASES,
    ids=[f"zero{s}-dp{d}{'-accum' if a else ''}{'-offload' if o else ''}" for s, d, a, o in CASES],
)
def test_layout_invariance(tmp_path, cache, stage, dp, accumulate, offload):
    ref_losses, ref_weights, ref_norms = reference(str(tmp_path), cache, accumulate)
    overrides = [cache, f"parallel.zero={stage}", f"memory.offload_optimizer={str(offload).lower()}"]
    if accumulate:
        overrides.append(f"train.micro_batch={8 // dp // 2}")
    for losses, weights, norms in run_ranks(dp, _train, str(tmp_path), dp, overrides, INVARIANCE_STEPS, norms=True):
        assert losses == pytest.approx(ref_losses, rel=1e-4)
        # the gradient itself, not only its effect: clipping and Adam forgive a gradient scaled by a constant
        # (summed instead of averaged over micro-batches or ranks), its norm does not
        assert norms == pytest.approx(ref_norms, rel=1e-4)
        assert weights.keys() == ref_weights.keys()
        for n, w in weights.items():
            assert torch.allclose(w, ref_weights[n], atol=1e-5, rtol=0), (n, (w - ref_weights[n]).abs().max())


ALIGN = 16  # flat.py pads every bucket to a multiple of dp * 16 elements: dp equal shards, each 16-aligned
# tensors of 40, 800 and 4000 elements (d_model 40, MLP width 100) that are not multiples of dp * 16,
# so that buckets carry padding and the count below has to get it right
ODD_SHAPES = ["model.d_model=40", "model.ffn_hidden=100"]


def _memory_and_bytes(tmp, cache, stage, accumulate=False):
    tr = _trainer(
        tmp,
        dist.get_world_size(),
        [cache, f"parallel.zero={stage}", *ODD_SHAPES, *(["train.micro_batch=1"] if accumulate else [])],
        steps=3,
    )
    tr.train_step()
    tr.topo.ledger.reset()
    tr.train_step()  # the second step: optimizer state exists
    gc.collect()
    # model buffers (rope tables) and the device mesh's rank table are the only tensors besides the model states
    others = sum(b.numel() * b.element_size() for b in [*tr.model.buffers(), tr.topo.mesh.mesh])
    engine = tr.engine
    layouts = [u.layout for u in engine.units] if stage == 3 else [engine.layout]
    buckets = [[(b.start, b.end, [s.numel for s in b.slots]) for b in layout.buckets] for layout in layouts]
    return tr.n_params, engine.memory(), live_tensor_bytes() - others, tr.topo.ledger.snapshot(), buckets


def _padded(numels, dp):
    """Elements of a bucket holding tensors of ``numels`` elements, padded to split into dp aligned shards."""
    unit = dp * ALIGN
    return -(-sum(numels) // unit) * unit


def _owned(buckets, dp, rank):
    """Elements and (parameter) segments of real parameters in ``rank``'s shard of every bucket: rank r holds
    elements [r * shard, (r + 1) * shard) of each padded bucket, the padding sits at its end."""
    elements = segments = 0
    for numels in buckets:
        shard = _padded(numels, dp) // dp
        lo, hi, pos = rank * shard, (rank + 1) * shard, 0
        for k in numels:
            overlap = min(hi, pos + k) - max(lo, pos)
            if overlap > 0:
                elements, segments = elements + overlap, segments + 1
            pos += k
    return elements, segments


def _wire(op, nbytes, dp):
    """Bytes one rank sends (trickles/comm/ledger.py's ring formulas, rounded per call as the ledger does)."""
    return int(round(wire_bytes(op, nbytes, dp)))


@pytest.mark.parametrize("dp", [2, 4])
def test_memory_and_communication_match_the_formulas(tmp_path, cache, dp):
    """Bytes held and sent per rank equal ZeRO's formulas evaluated on the padded flat layout, to the byte."""
    for stage, accumulate in [(0, False), (1, False), (1, True), (2, False), (3, False)]:
        for rank, (n, mem, live, ledger, layouts) in enumerate(
            run_ranks(dp, _memory_and_bytes, str(tmp_path), cache, stage, accumulate)
        ):
            buckets = [[numels for _, _, numels in layout] for layout in layouts]
            for layout in layouts:  # buckets end to end, each padded to the next multiple of dp * 16 elements
                assert [start for start, _, _ in layout] == [0] + [end for _, end, _ in layout[:-1]], layout
                assert [end - start for start, end, _ in layout] == [_padded(k, dp) for _, _, k in layout], layout
            flat = [k for bs in buckets for k in bs]
            assert sum(sum(k) for k in flat) == n
            padded = sum(_padded(k, dp) for k in flat)  # P: parameters plus padding
            assert padded > n  # these shapes do leave padding in some bucket
            owned, segments = _owned(flat, dp, rank) if stage >= 1 else (n, sum(len(k) for k in flat))
            # ZeRO's formula on P (data parallel keeps its parameters as they are: no padding), and Adam's two
            # fp32 moments for each owned element plus one fp32 step counter per owned parameter segment
            # (stage 1 keeps the whole gradient buffer only when it accumulates micro-batches; without, it reduces
            # each bucket into its shard as stage 2 does -- DeepSpeed's stage 1 holds no more either)
            formula = zero_model_state_bytes(padded, dp, 2 if stage == 1 and not accumulate else stage, FP32_ADAM)
            expected = {
                "parameters": 4 * n if stage == 0 else formula["parameters"],
                "gradients": formula["gradients"],
                "optimizer": 8 * owned + 4 * segments,
            }
            assert mem == expected, (stage, rank, mem, expected)
            # nothing else alive in the process (model buffers and the mesh aside): nothing else held whole
            assert live == sum(mem.values()), (stage, rank, live, mem)

            loss = _wire("all_reduce", 4, dp)  # the mean loss (the trainer's); the engine's own: the library's formula
            expected = {
                f"{op}/dp": v for op, v in reduction_wire_bytes([_padded(k, dp) for k in flat], dp, stage).items()
            }
            calls, sent = expected.get("all_reduce/dp", (0, 0))
            expected["all_reduce/dp"] = (calls + 1, sent + loss)
            # spelled out: stage 0 all-reduces each bucket; ZeRO reduce-scatters each and all-gathers each shard
            # (ZeRO-3 twice: forward and backward); ZeRO >= 1 also sums the squared gradient norm
            sizes = [4 * _padded(k, dp) for k in flat]
            if stage == 0:
                assert expected == {
                    "all_reduce/dp": (len(sizes) + 1, sum(_wire("all_reduce", b, dp) for b in sizes) + loss)
                }
            else:
                gathers = 2 if stage == 3 else 1
                assert expected == {
                    "reduce_scatter/dp": (len(sizes), sum(_wire("reduce_scatter", b, dp) for b in sizes)),
                    "all_gather/dp": (
                        gathers * len(sizes),
                        gathers * sum(_wire("all_gather", b // dp, dp) for b in sizes),
                    ),
                    "all_reduce/dp": (2, 2 * loss),
                }
            assert {k: (v["calls"], v["wire_bytes"]) for k, v in ledger.items()} == expected, (stage, ledger)
            ring = (
                4 * padded * (dp - 1) // dp
            )  # ZeRO's volumes: 2 (all-reduce, stages 0-2) or 3 (stage 3) x (N-1)/N x 4P
            if stage == 0:
                assert ledger["all_reduce/dp"]["wire_bytes"] == 2 * ring + loss
            else:
                assert (
                    ledger["reduce_scatter/dp"]["wire_bytes"] + ledger["all_gather/dp"]["wire_bytes"]
                    == (3 if stage == 3 else 2) * ring
                )


def test_zero_paper_worked_example():
    # ZeRO (Rajbhandari et al.), Figure 1: 7.5B parameters, 64 devices, mixed-precision Adam
    got = [zero_model_state_bytes(7.5e9, 64, s)["total"] / 1e9 for s in range(4)]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]


def _zero3_lifecycle(tmp, cache):
    tr = _trainer(tmp, dist.get_world_size(), [cache, "parallel.zero=3", "model.n_layers=4"], steps=2)
    engine = tr.engine
    shards_only = all(name.endswith("flat_shard") for name, _ in tr.model.named_parameters())
    gc.collect()
    set_up_bytes = live_tensor_bytes() - sum(
        b.numel() * b.element_size() for b in [*tr.model.buffers(), tr.topo.mesh.mesh]
    )
    peak, back = [], []  # gathered bytes as each block's forward ends, and as its backward begins

    def backward_begins(grad):
        back.append(sum(u.gathered_bytes() for u in engine.units))

    def forward_ends(module, args, out):
        peak.append(sum(u.gathered_bytes() for u in engine.units))
        if out.requires_grad:
            out.register_hook(backward_begins)

    for block in tr.model.layers.values():
        block.register_forward_hook(forward_ends)
    x, y = tr.train_data.micro_batches(0, 8, 8 // dist.get_world_size())[0]
    engine.zero_grad()
    with engine.micro_step(last=True):
        loss = tr._loss(x, y)
        after_forward = [u.gathered_bytes() for u in engine.units]
        loss.backward()
    engine.finish_backward()
    after_backward = [u.gathered_bytes() for u in engine.units]
    unit_bytes = {u.name: u._bytes for u in engine.units}
    return (
        shards_only,
        set_up_bytes,
        sum(u.shard.numel() for u in engine.units) * 4,
        peak + back,
        after_forward,
        after_backward,
        unit_bytes,
    )


def test_zero3_never_holds_the_whole_model(tmp_path, cache):
    for shards_only, set_up, shard_bytes, peak, after_fwd, after_bwd, unit_bytes in run_ranks(
        4, _zero3_lifecycle, str(tmp_path), cache
    ):
        assert shards_only
        # after set-up: this rank's parameter and gradient shards and nothing else (model buffers and the mesh aside)
        assert set_up == 2 * shard_bytes
        assert sum(after_fwd) == 0 and sum(after_bwd) == 0  # gathered copies freed after forward and after backward
        blocks = max(v for k, v in unit_bytes.items() if k != "<root>")
        # while a block runs, forward or backward: the root, that block and at most the prefetched next one (4 blocks:
        # a block kept after its backward would be a third)
        assert len(peak) == 8 and max(peak) <= unit_bytes["<root>"] + 2 * blocks


def _first_half(tmp, cache, stage, tag):
    tr = _trainer(tmp, dist.get_world_size(), [cache, f"parallel.zero={stage}", f"train.out_dir={tmp}/{tag}"], steps=8)
    losses = [tr.train_step()["loss"] for _ in range(4)]
    path = tr.save_checkpoint()
    straight = losses + [tr.train_step()["loss"] for _ in range(4)]
    return path, straight, tr.engine.full_state()


def _second_half(tmp, cache, stage, path, tag):
    tr = _trainer(tmp, dist.get_world_size(), [cache, f"parallel.zero={stage}", f"train.out_dir={tmp}/{tag}"], steps=8)
    tr.load_checkpoint(path)
    return [tr.train_step()["loss"] for _ in range(4)], tr.engine.full_state()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpoint_resume_same_layout(tmp_path, cache, stage):
    (path, straight, final), *_ = run_ranks(2, _first_half, str(tmp_path), cache, stage, "a")
    assert {f for f in os.listdir(path) if f.endswith(".safetensors")} == {
        0: {"model-rank00000.safetensors", "optimizer-rank00000.safetensors"},  # replicated: rank 0 writes it all
        1: {"model-rank00000.safetensors", "optimizer-rank00000.safetensors", "optimizer-rank00001.safetensors"},
        2: {"model-rank00000.safetensors", "optimizer-rank00000.safetensors", "optimizer-rank00001.safetensors"},
        3: {
            "model-rank00000.safetensors",
            "model-rank00001.safetensors",
            "optimizer-rank00000.safetensors",
            "optimizer-rank00001.safetensors",
        },
    }[stage]
    (tail, resumed), *_ = run_ranks(2, _second_half, str(tmp_path), cache, stage, path, "b")
    assert tail == pytest.approx(straight[4:], rel=1e-6)
    for n, w in resumed.items():
        assert torch.allclose(w, final[n], atol=1e-6, rtol=0), n


def test_checkpoint_records_global_shapes_and_loads_at_another_layout(tmp_path, cache):
    (path, straight, final), *_ = run_ranks(2, _first_half, str(tmp_path), cache, 3, "a")
    (tail, resumed), *_ = run_ranks(4, _second_half, str(tmp_path), cache, 1, path, "b")  # dp 2 -> 4, ZeRO-3 -> ZeRO-1
    assert tail == pytest.approx(straight[4:], rel=1e-4)
    for n, w in resumed.items():
        assert torch.allclose(w, final[n], atol=1e-5, rtol=0), n


_MEMORY_CASES = [(3, "full", "fp32"), (3, "elementwise", "bf16"), (2, "full", "bf16"), (1, "selective", "fp16")]
# Tolerances against the same precision and recomputation on one process, over 16 steps (measured gaps):
# fp32 as in the layout-invariance tests (losses 1.7e-7, weights 2.2e-6). bf16/fp16: the gradients are reduced in
# another order, so now and then a low-precision weight rounds to its neighbour -- losses within 1.0e-4 (bf16) and
# 6e-6 (fp16), against 1.5e-2 for a learning rate 5% lower; weights within 7.8e-3 (bf16: the norms, near 1.0, one bf16
# ulp, 2^-7) and 3.3e-3 (fp16), while every weight moves at least 1.95e-2 from its initial value (so a weight never
# updated lies 2x farther out than the tolerance). In low precision the embedding is compared by its update instead
# (``assert_updates_track``): a few elements of rare tokens' rows, whose gradients are near zero, take Adam steps of
# opposite sign a learning rate apart (bf16: 1.04e-2 at most) while the tensor tracks (1.8% of its update in norm).
_TRACK = {"fp32": (1e-4, 1e-5), "bf16": (2e-3, 1e-2), "fp16": (2e-3, 1e-2)}  # (losses, relative; weights, absolute)
_EMBED_UPDATE = 0.05  # low precision: the embedding's distance to the reference, as a share of the reference's update


@pytest.mark.parametrize(
    "stage,recompute,precision", _MEMORY_CASES, ids=[f"zero{s}-{r}-{p}" for s, r, p in _MEMORY_CASES]
)
def test_zero_composes_with_recompute_and_precision(tmp_path, cache, stage, recompute, precision):
    common = [cache, f"memory.recompute={recompute}", f"memory.precision={precision}", "memory.loss_scale=1024"]
    ref_losses, ref_weights, initial = _train(str(tmp_path), 1, common, steps=16, initial=True)
    slower, _ = _train(str(tmp_path), 1, [*common, "train.lr=2.85e-3"], steps=16)  # tiny_config's 3e-3, 5% lower
    loss_tol, weight_tol = _TRACK[precision]
    for losses, weights in run_ranks(2, _train, str(tmp_path), 2, [f"parallel.zero={stage}", *common], steps=16):
        assert_losses_track(losses, ref_losses, loss_tol, wrong={"lr 5% lower": slower})
        apart = {"embed.weight"} if precision != "fp32" else set()
        assert_weights_track(
            *({n: d[n] for n in d if n not in apart} for d in (weights, ref_weights, initial)), weight_tol
        )
        if apart:
            assert_updates_track(*({n: d[n] for n in apart} for d in (weights, ref_weights, initial)), _EMBED_UPDATE)


def _bucket_buffers(tmp, cache):
    tr = _trainer(tmp, 2, [cache, "parallel.zero=2", "parallel.bucket_mb=0.02", "train.micro_batch=2"], steps=2)
    counts = []
    for _ in range(2):
        tr.train_step()
        counts.append(tr.engine.buffers_allocated)
    return counts, len(tr.engine.layout.buckets), sum(t.numel() for ts in tr.engine._free.values() for t in ts)


def test_zero2_reuses_its_bucket_buffers(tmp_path, cache):
    """ZeRO-2 with gradient accumulation (two micro-steps per step) over many small buckets: each backward allocates
    only the few bucket buffers filled or in flight at once (at most MAX_INFLIGHT + 1), however many buckets it
    reduces, and holds none between steps (the memory formulas' tests check the bytes)."""
    from trickles.parallel.data.zero import MAX_INFLIGHT

    for counts, buckets, held in run_ranks(2, _bucket_buffers, str(tmp_path), cache):
        backwards = 2 * len(counts)
        assert buckets >= 4 * (MAX_INFLIGHT + 1), buckets  # enough buckets for reuse to show
        assert counts[-1] <= backwards * (MAX_INFLIGHT + 1), (counts, buckets)
        assert counts[-1] < backwards * buckets
        assert held == 0
