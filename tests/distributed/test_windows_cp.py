"""Sliding windows under context parallelism (ring and all-to-all), with and without packed documents:

* the ring's attention with a window (and soft-capped scores, a scale, documents) equals the whole sequence's in one
  process, forward and backward, on every block kernel, with windows shorter than a chunk, equal to one, across
  several, and as long as the sequence;
* the ring computes exactly the chunk pairs the window reaches (the others are skipped, never passed to a kernel),
  and far fewer scores than without the window;
* training at cp=2, ring and all-to-all, a layer pattern mixing full and windowed layers, with and without packed
  documents: losses and weights those of one process (fp32, 1e-5) over 3 steps."""

import itertools
import math

import pytest
import torch
from helpers import efficient_attention_stand_in, short_documents
from test_context_parallel import _train

from trickles.models.documents import document_ids
from trickles.parallel.ring_blocks import Matmul
from trickles.parallel.sequence import positions
from trickles.testing import run_ranks
from trickles.topology import ParallelDims

CPU = torch.device("cpu")


def reference(q, k, v, window, scale=None, softcap=None, documents=None):
    """Plain fp32 attention on the whole sequence: causal, within ``window``, soft-capped, within documents."""
    t, rep = q.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(t)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - (window or t))
    if documents is not None:
        mask = mask & (documents[:, None, :, None] == documents[:, None, None, :])
    return s.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def _ring_case(seq, window, blocks=None, softcap=None, scale=None, documents=False, slab_min=None, record=None):
    """This rank's relative errors of the ring's output and gradients of q, k, v against :func:`reference`, with
    ``record`` the scores of each kernel call (a causal block its triangle), and the bytes it sent (the ledger's)."""
    import trickles.parallel.ring as ring
    import trickles.parallel.ring_plan as plan

    comm = ParallelDims(cp=torch.distributed.get_world_size()).build(CPU).comm("cp")
    real_kernel, real_slab = ring.kernel_for, plan.SLAB_MIN
    plan._plan.cache_clear()
    if slab_min is not None:
        plan.SLAB_MIN = slab_min
    kernel = {None: None, "matmul": Matmul, "cuda": efficient_attention_stand_in()}[blocks]
    calls = []
    if kernel is not None or record:
        chosen = kernel

        class Counting:  # the device's (or the chosen) kernel, every forward call recorded
            def __init__(self, inner):
                self.inner, self.takes_delta = inner, inner.takes_delta

            def forward(self, q, k, v, scale, causal, mask=None):
                rows, keys = q.shape[2], k.shape[2]
                # the scores it computes: row r of a causal block sees keys 0..r
                calls.append(keys * (keys + 1) // 2 + (rows - keys) * keys if causal else rows * keys)
                return self.inner.forward(q, k, v, scale, causal, mask)

            def backward(self, *a):
                return self.inner.backward(*a)

        ring.kernel_for = lambda q: Counting(chosen or real_kernel(q))
    try:
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(2, n, seq, 8, generator=g) for n in (4, 2, 2))
        dout = torch.randn(2, 4, seq, 8, generator=g)
        ids = None
        if documents:
            tokens = torch.randint(1, 9, (2, seq), generator=g)
            tokens[0, [3, seq // 2 - 1, seq // 2 + 2]] = 0
            tokens[1, [seq // 4]] = 0
            ids = document_ids(tokens, 0)
        whole = [x.clone().requires_grad_() for x in (q, k, v)]
        want = reference(*whole, window, scale, softcap, ids)
        want.backward(dout)
        pos = positions(seq, comm.size, comm.rank, "ring")
        mine = [x[:, :, pos].clone().requires_grad_() for x in (q, k, v)]
        docs = None if ids is None else ring.RingDocuments(ids, ids)
        comm.ledger.reset()
        out = ring.ring_attention(*mine, comm, docs, window, scale, softcap)
        out.backward(dout[:, :, pos])
        rel = lambda a, b: float((a.detach() - b).norm() / b.norm())  # noqa: E731
        errors = [rel(out, want[:, :, pos])] + [rel(m.grad, w.grad[:, :, pos]) for m, w in zip(mine, whole)]
        return errors, calls, comm.ledger.snapshot().get("send/cp", {}).get("bytes", 0)
    finally:
        ring.kernel_for, plan.SLAB_MIN = real_kernel, real_slab
        plan._plan.cache_clear()


CASES = [  # (world, seq, window, kwargs): c = seq / (2 world) tokens a chunk
    (2, 32, 8, {}),  # a window of one chunk, a quarter of the sequence
    (2, 32, 8, {"slab_min": 2}),  # ... the window's edge computed in slabs of 2 query rows
    (2, 32, 5, {"slab_min": 2, "blocks": "matmul"}),  # shorter than a chunk, not a multiple of the slab
    (2, 32, 13, {"slab_min": 3, "blocks": "cuda"}),  # the glue around CUDA's kernel, its masks as its bias
    (4, 48, 7, {"slab_min": 2}),  # 4 ranks: blocks of whole rings skipped
    (4, 48, 20, {}),  # a window across several chunks
    (2, 32, 32, {}),  # as long as the sequence: plain causal
    (2, 32, 6, {"softcap": 2.0, "scale": 0.3, "slab_min": 2}),  # soft-capped scores, another scale
    (2, 32, 6, {"documents": True, "slab_min": 2}),  # packed documents within the window
    (4, 48, 9, {"documents": True, "slab_min": 4, "softcap": 3.0}),
    (2, 32, None, {"documents": True, "softcap": 1.5, "blocks": "cuda"}),  # soft cap on the documents' blocks
]


@pytest.mark.parametrize(
    "world,seq,window,kwargs",
    CASES,
    ids=["-".join([f"cp{c[0]}-T{c[1]}-w{c[2]}", *(f"{k}={v}" for k, v in c[3].items())]) for c in CASES],
)
def test_the_ring_with_a_window_equals_the_whole_sequence(world, seq, window, kwargs):
    """Output and the gradients of q, k and v within 1e-5 (relative, 2-norm over the tensor) of plain fp32 attention
    on the whole sequence with the same window, scale, soft cap and documents."""
    for errors, _, _ in run_ranks(world, _ring_case, seq, window, **kwargs):
        assert max(errors) < 1e-5, errors


@pytest.mark.parametrize("cut_diagonal", [True, False])
def test_the_pieces_of_a_block_cover_each_pair_the_window_shows_once(monkeypatch, cut_diagonal):
    """Every (query, key) pair a query sees lies in exactly one piece, no piece reaches a pair outside the block, a
    ``full`` piece's pairs are all seen, a ``causal`` one's exactly its lower triangle, a ``band`` one has a pair seen;
    for blocks on and off the diagonal, windows shorter and longer than the block, and pieces down to 1 and 3 rows."""
    import trickles.parallel.ring_plan as plan

    for slab in (1, 3):
        monkeypatch.setattr(plan, "SLAB_MIN", slab)
        for c, a, b, w in itertools.product((5, 12), range(3), range(3), (None, 1, 2, 5, 12, 13, 40)):
            if b > a:
                continue
            q0, k0 = a * c, b * c
            i = torch.arange(q0, q0 + c)[:, None] - k0
            j = torch.arange(c)[None, :]
            seen = (j <= i) & (j > i - (w or 10**6))
            cover = torch.zeros(c, c, dtype=torch.int)
            for i0, i1, j0, j1, kind in plan.window_pieces(q0, k0, c, w, cut_diagonal):
                part = seen[i0:i1, j0:j1]
                assert 0 <= i0 < i1 <= c and 0 <= j0 < j1 <= c and part.any(), (c, a, b, w, i0, i1, j0, j1)
                if kind == "full":
                    assert part.all()
                elif kind == "causal":
                    assert q0 + i0 == k0 + j0 and torch.equal(part, torch.ones_like(part).tril())
                cover[i0:i1, j0:j1] += 1
            assert (cover <= 1).all() and (cover[seen] == 1).all(), (c, a, b, w)


def _chunk_pairs(world, window, seq):
    """Per rank, the (query chunk, key chunk) pairs in which some query sees some key under the window."""
    c = seq // (2 * world)
    i = torch.arange(seq)
    seen = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    return [
        {
            (a, b)
            for a in (r, 2 * world - 1 - r)
            for b in range(2 * world)
            if seen[a * c : a * c + c, b * c : b * c + c].any()
        }
        for r in range(world)
    ]


@pytest.mark.parametrize("world,seq,window,slab_min,bound", [(2, 64, 16, 4, 0.55), (4, 64, 8, None, 0.36)])
def test_blocks_wholly_outside_the_window_are_skipped(monkeypatch, world, seq, window, slab_min, bound):
    """A window of one chunk: the ring plans (and its kernels receive) exactly the pieces of the chunk pairs the window
    reaches -- the diagonal and the pair below it -- and computes far fewer scores than plain causal attention
    (counted per kernel call, a causal piece as its triangle; measured: at cp=2 0.40 and 0.54 of them, the diagonal
    triangles staying, at cp=4 at most 0.354). It sends just the chunks :func:`route` says travel (at cp=2 one chunk
    of keys and values each way and one of their gradients, 3/16 of the causal ring's bytes)."""
    import trickles.parallel.ring_plan as plan
    from trickles.parallel.ring_plan import plain_blocks, route

    c = seq // (2 * world)
    chunk = 2 * 2 * 2 * c * 8 * 4  # keys and values of one chunk (B 2, H_kv 2, D 8, fp32), or their gradient
    for rank, ((_, windowed, sent), (_, causal, sent_causal)) in enumerate(
        zip(*(run_ranks(world, _ring_case, seq, w, slab_min=slab_min, record=True) for w in (window, None)))
    ):
        monkeypatch.setattr(plan, "SLAB_MIN", slab_min or plan.SLAB_MIN)  # as the ranks planned
        plan._plan.cache_clear()
        pairs = set()
        for step in range(world):
            src = (rank - step) % world
            for qs, ks, _, _ in plain_blocks(rank, src, world, c, window, "cpu"):
                pairs.add(((rank, 2 * world - 1 - rank)[qs.start // c], (src, 2 * world - 1 - src)[ks.start // c]))
        assert pairs == _chunk_pairs(world, window, seq)[rank]
        assert all(a - b <= 1 for a, b in pairs)  # nothing two chunks back: those blocks are skipped
        assert len(windowed) == sum(
            len(plain_blocks(rank, (rank - s) % world, world, c, window, "cpu")) for s in range(world)
        )
        computed, plain = sum(windowed), sum(causal)
        assert computed < bound * plain, (computed, plain)
        way = route(rank, world, c, window)
        assert sent == chunk * (2 * sum(map(sum, way.sent)) + sum(map(sum, way.grad_sent))), (sent, way)
        assert sent_causal == 2 * chunk * (2 * (world - 1) + world)  # every block and its gradient whole
        assert world > 2 or sent == 3 * chunk
    plan._plan.cache_clear()


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
def test_what_travels_is_what_the_ranks_further_on_see(cp):
    """:func:`route`: a rank receives what its predecessor sends, keys and values as gradients; it holds every chunk
    its plan's pieces read; each message carries the chunks some rank further on sees, and a block's gradient, summed
    along the ring, brings home the part of every rank that sees it (the owner's kept at home); without a window
    (or one as long as the sequence) everything travels whole."""
    from trickles.parallel.ring_plan import BOTH, NONE, plain_blocks, route

    either = lambda *xs: tuple(any(x) for x in zip(*xs, NONE))  # noqa: E731
    for c, window in itertools.product((3, 4), (None, 1, 2, 3, 4, 5, 8, 9, 24, 40)):
        ways = [route(r, cp, c, window) for r in range(cp)]
        seen = {  # (rank, block) -> the block's chunks the rank's planned pieces read
            (r, (r - s) % cp): tuple(
                any(ks.start // c == x for _, ks, _, _ in plain_blocks(r, (r - s) % cp, cp, c, window, "cpu"))
                for x in (0, 1)
            )
            for r in range(cp)
            for s in range(cp)
        }
        whole = window is None or window >= 2 * cp * c
        for r, way in enumerate(ways):
            prev = ways[r - 1]
            assert way.held[0] == BOTH and way.held[1:] == prev.sent and way.grad_recv == prev.grad_sent
            if whole:
                assert cp == 1 or (way.sent + way.grad_sent == (BOTH,) * (2 * cp - 1) and not way.keep_home)
                continue
            for s in range(cp):
                j = (r - s) % cp
                assert way.seen[s] == seen[r, j] and either(way.seen[s], way.held[s]) == way.held[s]
                later = either(*(seen[(j + u) % cp, j] for u in range(s + 1, cp)))
                assert s == cp - 1 or way.sent[s] == later, (cp, c, window, r, s)
                summed = either(way.seen[s], way.grad_recv[s - 1]) if s else NONE  # the owner's part stays home
                assert way.grad_sent[s] == summed, (cp, c, window, r, s)
            arrived = either(way.grad_recv[-1], way.seen[0] if way.keep_home else NONE)
            assert arrived == either(*(seen[u, r] for u in range(cp))), (cp, c, window, r)


# ---- training: one process against cp=2 --------------------------------------------------------------------------

STEPS = 3
WINDOW = ["model.sliding_window=8", "model.window_layers=[true, false]"]  # a quarter of 32 tokens, first layer only


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("windows-cp")
    return (f"data.cache_dir={tmp}", *short_documents(tmp / "lines.jsonl"))


_REFERENCE = {}


def _reference(tmp, overrides):
    key = tuple(overrides)
    if key not in _REFERENCE:
        losses, pieces = run_ranks(1, _train, tmp, {}, list(overrides), STEPS)[0]
        _REFERENCE[key] = losses, {n: t for n, (t, _) in pieces.items()}
    return _REFERENCE[key]


CAPPED = ["model.attn_softcap=1.0", "model.query_pre_attn_scalar=4"]  # Gemma's soft cap and scale, felt by tiny scores
TRAINING = [  # (mode, documents, extra)
    ("ring", False, []),
    ("ring", True, []),
    ("ulysses", False, []),
    ("ulysses", True, []),
    ("ring", True, CAPPED),
    ("ulysses", False, CAPPED),
]


@pytest.mark.parametrize(
    "mode,documents,extra",
    TRAINING,
    ids=[f"{m}-{'documents' if d else 'plain'}{'-softcap' if e else ''}" for m, d, e in TRAINING],
)
def test_windowed_layers_at_cp2_train_like_one_process(tmp_path, cache, mode, documents, extra):
    """Losses within 1e-5 relative and weights within 1e-5 of one process after 3 steps; the window changes the
    model by far more than that (so each layout really applies it)."""
    model = [*cache, *(["data.document_mask=true"] if documents else []), *extra]
    ref_losses, ref_weights = _reference(str(tmp_path), [*model, *WINDOW])
    full_losses, _ = _reference(str(tmp_path), model)
    assert max(abs(a - b) / b for a, b in zip(full_losses[1:], ref_losses[1:])) > 1e-3
    for losses, pieces in run_ranks(
        2, _train, str(tmp_path), {"cp": 2}, [*model, *WINDOW, f"parallel.cp_mode={mode}"], STEPS
    ):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, (w, _) in pieces.items():
            assert (w - ref_weights[name]).abs().max() <= 1e-5, (name, (w - ref_weights[name]).abs().max())
    assert math.isfinite(ref_losses[-1])
