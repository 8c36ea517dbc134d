"""Timing one rank's compute for the calibration: GEMMs, attention, memory bandwidth, the model's block passes.

:func:`~trickles.planner.calibrate.calibrate` times these on this machine and fills the cluster's compute
numbers with them:

* **GEMMs**: each distinct ``[M, K] x [K, N]`` of the model's forward on one rank
  (:mod:`trickles.planner.compute`, for the run's micro-batch and layout) and a square reference, timed on the
  run's device and precision (CPU: one thread, one core being one "device" of the ``local`` cluster, on every
  local rank at once -- what a core does while all the ranks compute and take turns on it --
  :func:`~trickles.planner.calibrate.measure_on_ranks`). Each time is the median of its samples
  (:func:`_timeit`). On a CPU the fastest measured rate becomes the peak (nobody publishes one) and every shape's
  rate a fraction of it; on a GPU the peak is the datasheet's (:data:`trickles.train.flops.PEAKS`) where the device
  is known. The fractions fill ``gemm_table``.
* **Attention**: the fused kernel itself (``scaled_dot_product_attention``, forward and backward) at the run's
  per-rank shape (:func:`measure_attention`): it is no GEMM (its online softmax runs beside the products), and on a
  CPU it reaches a fraction of the matmul rate; the fractions fill ``attention_table``.
* **Memory bandwidth**: a large copy, ``2 x bytes / time`` (read and write).
* **Block passes**: the model's own block (a dense one) and its head (final norm, output layer, loss), forward and
  backward, at one sequence and at the run's micro-batch (:func:`measure_passes`): what they take beyond their
  GEMMs and attention (as the tables just measured predict them) is the element-wise work and a fixed cost per pass
  (operator dispatch, autograd). :func:`fit_passes` fits ``rest = passes x overhead + bytes / B`` over them, with
  ``bytes`` the element-wise bytes the time model counts (:mod:`trickles.planner.compute`): ``B`` fills
  ``elementwise_gbps`` and the overhead ``pass_overhead_us`` -- on a CPU the kernels run several times slower than
  a plain copy (small tensors, strided reads, fresh allocations), and a copy's bandwidth would miss that. A
  mixture-of-experts model's MoE block is timed too: what its tiny pass takes beyond a dense pass with its work
  (routing, sorting, gather and scatter: many small operations) fills ``moe_pass_overhead_us``
  (:func:`fit_moe_pass`).

What a run times comes from its config and layout: :func:`model_shapes` (its GEMMs), :func:`attention_shapes`,
:func:`pass_sizes` and :func:`pass_gemm_shapes` (the GEMMs of the timed passes, so that :func:`fit_passes` finds
them in the table).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Sequence

import torch

from .cluster import Cluster
from .compute import causal_pairs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TINY_PASS = 16  # tokens of the pass that measures the fixed cost


def _timeit(fn, repeats: int, min_s: float = 0.005) -> float:
    """Seconds one call of ``fn`` takes: the median of ``repeats`` samples, each a loop of as many calls as last at
    least ``min_s`` (so a short kernel's time is not the clock's resolution); the median rather than the fastest
    sample, so a machine that other processes share is measured as the steps that run on it see it."""
    t = time.perf_counter()
    fn()  # warm up, and how many calls make a sample
    calls = max(1, math.ceil(min_s / max(time.perf_counter() - t, 1e-9)))
    times = []
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls)
    return statistics.median(times)


@contextlib.contextmanager
def _one_thread(dev: torch.device):
    """On a CPU, run the body on one thread (one core is one "device" of a CPU cluster), then restore the count."""
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def measure_gemms(
    shapes: Sequence[tuple[int, int, int]],
    precision: str = "fp32",
    device: str = "cpu",
    repeats: int = 3,
    min_s: float = 0.005,
) -> dict[tuple[int, int, int], float]:
    """``{(m, n, k): FLOP/s}`` of ``[m, k] x [k, n]`` matmuls on ``device`` in ``precision`` (CPU: one thread), each
    sample at least ``min_s`` seconds (:func:`_timeit`)."""
    dev = torch.device(device)
    dtype = DTYPES[precision]
    out = {}
    with _one_thread(dev):
        for m, n, k in shapes:
            a = torch.randn(m, k, device=dev).to(dtype)
            b = torch.randn(k, n, device=dev).to(dtype)

            def run(a=a, b=b):
                a @ b
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)

            out[(m, n, k)] = 2.0 * m * n * k / max(_timeit(run, repeats, min_s), 1e-9)
    return out


class _Loopback:
    """Rank 0 of a ring of ``size`` ranks whose exchanges are local copies (what :func:`measure_attention` times: the
    ring's compute, not its links): each receive gets what was sent."""

    def __init__(self, size: int):
        self.size, self.rank = size, 0

    def batch_p2p(self, ops):
        send = next(t for kind, t, _ in ops if kind == "send")
        for kind, t, _ in ops:
            if kind == "recv":
                t.copy_(send)
        return []


def measure_attention(
    shapes: Sequence[tuple[int, int, int, int, int]],
    precision: str = "fp32",
    device: str = "cpu",
    repeats: int = 3,
    min_s: float = 0.005,
) -> dict[tuple[int, int, int], float]:
    """``{(q, k, d): FLOP/s}`` of the attention the model runs, forward and backward, for each
    ``(sequences, heads, q, k, d)``: ``q`` query rows against ``k`` keys of head size ``d``, causal. ``q == k``: the
    fused kernel (``scaled_dot_product_attention``); ``q < k``: rank 0's share of ring attention over
    ``cp = k / q`` ranks (:mod:`trickles.parallel.context`: its ``2 cp + 1`` blocks and their merges, forward and
    backward), the ring's exchanges a local copy (:class:`_Loopback`; the links are timed apart). The rate is
    counted as the time model counts it: ``3 x 4 d`` per entry the causal mask leaves, per sequence and head
    (:func:`~trickles.planner.compute.causal_pairs` of ``k`` keys, of which rank 0's share is ``q / k``)."""
    import torch.nn.functional as F

    from ..parallel.context import ring_attention

    dev = torch.device(device)
    dtype = DTYPES[precision]
    out = {}
    with _one_thread(dev):
        for b, h, q, k, d in shapes:
            ring = q < k
            xq = torch.randn(b, h, q, d, device=dev, dtype=dtype, requires_grad=True)
            xk, xv = (
                torch.randn(b, h, q if ring else k, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(2)
            )

            def run(ring=ring, xq=xq, xk=xk, xv=xv, q=q, k=k):
                if ring:
                    ring_attention(xq, xk, xv, _Loopback(k // q)).sum().backward()
                else:
                    F.scaled_dot_product_attention(xq, xk, xv, is_causal=True).sum().backward()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)

            flops = 3 * 4.0 * b * h * d * causal_pairs(k) * q / k
            out[(q, k, d)] = flops / max(_timeit(run, repeats, min_s), 1e-9)
    return out


def measure_memory_bandwidth(device: str = "cpu", mib: int = 64, repeats: int = 3) -> float:
    """Bytes/s of a ``mib`` MiB copy (read + write) on one thread (CPU) or the device."""
    dev = torch.device(device)
    n = mib * 2**20 // 4
    a, b = torch.ones(n, device=dev), torch.empty(n, device=dev)
    with _one_thread(dev):

        def run():
            b.copy_(a)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        return 2 * n * 4 / max(_timeit(run, repeats), 1e-9)


def _block_model(model_cfg, moe: bool = False):
    """A one-block model of ``model_cfg``'s shape: a dense MLP (the block whose passes calibrate the element-wise
    work), or with ``moe`` a mixture of experts (learned routing: a hard route needs labels)."""
    from ..models.transformer import Transformer

    one = (
        dataclasses.replace(model_cfg, n_layers=1, moe_every=1, moe_first_dense=0, moe_router="learned")
        if moe
        else dataclasses.replace(model_cfg, n_layers=1, moe_experts=0)
    )
    model = Transformer(one)
    model.init_weights(0)
    return model


def measure_passes(
    model_cfg,
    sizes: Sequence[tuple[int, int]],
    precision: str = "fp32",
    device: str = "cpu",
    repeats: int = 3,
    min_s: float = 0.05,
) -> dict[tuple[int, int], tuple[float, float]]:
    """``{(sequences, tokens): (block seconds, head seconds[, MoE block seconds])}``: one dense block of
    ``model_cfg`` and its head (final norm, output layer and loss) -- and, for a mixture-of-experts model, one of its
    MoE blocks, every expert local -- each forward and backward on ``sequences x tokens`` inputs, on ``device`` in
    ``precision`` (CPU: one thread; :func:`_timeit`)."""
    dev = torch.device(device)
    dtype = DTYPES[precision]
    model = _block_model(model_cfg).to(dev, dtype)
    block, d = model.layers["0"], model_cfg.d_model
    moe = _block_model(model_cfg, True).to(dev, dtype).layers["0"] if model_cfg.moe_experts else None
    out = {}
    with _one_thread(dev):
        for b, t in sizes:
            x = torch.randn(b, t, d, device=dev, dtype=dtype, requires_grad=True)
            target = torch.randint(0, model_cfg.vocab_size, (b, t), device=dev)
            rope = model.rope(0, t)
            rope = tuple(r.to(dtype) for r in rope) if rope is not None else None

            def run_block(x=x, rope=rope):
                block(x, rope).sum().backward()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)

            def run_head(x=x, target=target):
                model.head(x, target).backward()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)

            def run_moe(x=x, rope=rope):
                moe(x, rope).sum().backward()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)

            runs = (run_block, run_head, run_moe) if moe is not None else (run_block, run_head)
            out[(b, t)] = tuple(_timeit(run, repeats, min_s) for run in runs)
    return out


def _pass_work(model_cfg, sequences: int, tokens: int, p: int):
    """``(block, head[, MoE block])`` :class:`~trickles.planner.compute.Work` of the passes :func:`measure_passes`
    times (:func:`_block_model`), on one rank, ``p`` bytes an element."""
    from ..topology import ParallelDims
    from .compute import block_work, head_work

    dense = dataclasses.replace(model_cfg, moe_experts=0)
    work = (
        block_work(dense, ParallelDims(), sequences, tokens, False, False, p),
        head_work(dense, ParallelDims(), sequences, tokens, False, p),
    )
    if model_cfg.moe_experts:
        work += (block_work(model_cfg, ParallelDims(), sequences, tokens, True, False, p),)
    return work


def fit_passes(cluster: Cluster, model_cfg, passes: dict, precision: str, overhead: bool = True) -> tuple[float, float]:
    """``(bytes/s, seconds per pass)`` of the element-wise work and a pass's fixed cost (module docstring): for each
    measured block and head, ``rest`` = its time less its GEMMs and attention on ``cluster`` (whose tables are
    already filled), against the element-wise bytes ``x`` :mod:`trickles.planner.compute` counts for it (forward and
    backward: 3x the forward's), ``rest = o + s x``. The passes of at most :data:`TINY_PASS` tokens, whose kernels
    take next to nothing, pin the fixed cost (their mean: ``r_t = o + s x_t``) and the others the bandwidth ``1/s``
    (their sums: ``R = n o + s X``, which the largest passes dominate, as they do a step):
    ``s = (R - n r_t) / (X - n x_t)``. Without tiny passes, or where that gives a negative cost, or with
    ``overhead=False`` (a GPU, whose host queues the kernels ahead of them): ``o = 0``, ``s = R / X`` over the
    others. ``(0, 0)`` where nothing is left to fit."""
    from .cost import work_seconds

    p = 4 if precision == "fp32" else 2
    tiny, big = [], []  # (element-wise bytes of forward + backward, rest seconds)
    for (b, t), times in passes.items():
        for work, took in zip(_pass_work(model_cfg, b, t, p)[:2], times[:2]):
            gemm, _ = work_seconds(work, cluster, precision, 1.0)
            (tiny if b * t <= TINY_PASS else big).append((3 * work.elementwise_bytes, took - 3 * gemm))
    n, big_x, big_y = len(big), sum(x for x, _ in big), sum(y for _, y in big)
    if not big or big_x <= 0 or big_y <= 0:
        return 0.0, 0.0
    if overhead and tiny:
        x_t, r_t = (sum(v) / len(tiny) for v in zip(*tiny))
        if big_x > n * x_t:
            slope = (big_y - n * r_t) / (big_x - n * x_t)
            fixed = r_t - slope * x_t
            if slope > 0 and fixed >= 0:
                return 1.0 / slope, fixed
    return big_x / big_y, 0.0


def fit_moe_pass(cluster: Cluster, model_cfg, passes: dict, precision: str) -> float:
    """Seconds an MoE block's forward and backward takes beyond what a dense block's pass would cost with its work
    (module docstring): on the passes of at most :data:`TINY_PASS` tokens, the MoE block's time less its GEMMs and
    attention, its element-wise bytes at ``cluster``'s fitted bandwidth and one pass's fixed cost -- the routing,
    sorting, gather and scatter run as many small operations -- their mean, at least 0 (0 without tiny MoE passes)."""
    from .cost import work_seconds

    p = 4 if precision == "fp32" else 2
    extra = []
    for (b, t), times in passes.items():
        if b * t <= TINY_PASS and len(times) > 2:
            work = _pass_work(model_cfg, b, t, p)[2]
            gemm, elem = work_seconds(work, cluster, precision, 1.0)
            extra.append(times[2] - 3 * (gemm + elem) - cluster.pass_overhead_us * 1e-6)
    return max(0.0, sum(extra) / len(extra)) if extra else 0.0


def model_shapes(cfg, model_cfg, dims=None) -> list[tuple[int, int, int]]:
    """The distinct GEMM shapes of one rank's forward for ``cfg``'s micro-batch (one block of each kind and the
    head), ``dims`` the layout (default one rank)."""
    from ..topology import ParallelDims
    from .compute import chunk_work

    dims = dims or ParallelDims()
    micro, _ = cfg.batch_plan(dims.dp)
    sp = cfg.parallel.sequence_parallel and dims.tp > 1
    p = 4 if cfg.memory.precision == "fp32" else 2
    layers = sorted({0, *model_cfg.moe_layers[:1]})
    work = chunk_work(model_cfg, dims, micro, cfg.data.seq_len, layers, True, sp, p, cp_mode=cfg.parallel.cp_mode)
    return sorted({(g.m, g.n, g.k) for g in work.gemms if min(g.m, g.n, g.k) > 0})


def attention_shapes(cfg, model_cfg, dims=None) -> list[tuple[int, int, int, int, int]]:
    """``(sequences, heads, q, k, d)`` of one rank's attention core for ``cfg``'s micro-batch on layout ``dims``,
    as :mod:`trickles.planner.compute` shapes it: local heads (``/ tp``) on ``q = k = T`` (causal); under ring
    context parallelism ``q = T / cp`` queries against all ``k = T`` keys (the ring, :func:`measure_attention`);
    under all-to-all (``ulysses``) whole sequences on ``1/cp`` of the heads."""
    from ..topology import ParallelDims

    dims = dims or ParallelDims()
    micro, _ = cfg.batch_plan(dims.dp)
    seq = cfg.data.seq_len
    heads = max(1, model_cfg.n_heads // dims.tp)
    if dims.cp > 1 and cfg.parallel.cp_mode == "ring":
        return [(micro, heads, seq // dims.cp, seq, model_cfg.head_dim)]
    if dims.cp > 1:
        heads = max(1, heads // dims.cp)
    return [(micro, heads, seq, seq, model_cfg.head_dim)]


def pass_sizes(cfg, dims=None) -> list[tuple[int, int]]:
    """``(sequences, tokens)`` at which :func:`measure_passes` times the block and head: one sequence and the run's
    micro-batch on layout ``dims``, of the run's sequence length, and one sequence of :data:`TINY_PASS` tokens (its
    kernels take next to nothing: the fixed cost)."""
    from ..topology import ParallelDims

    micro, _ = cfg.batch_plan((dims or ParallelDims()).dp)
    seq = cfg.data.seq_len
    return sorted({(1, min(TINY_PASS, seq)), (1, seq), (micro, seq)})


def pass_gemm_shapes(model_cfg, sizes: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The GEMM shapes of the dense block and head :func:`measure_passes` times (so :func:`fit_passes` finds them in
    the table)."""
    out = set()
    for b, t in sizes:
        for work in _pass_work(model_cfg, b, t, 4):
            out.update((g.m, g.n, g.k) for g in work.gemms if g.name not in ("scores", "weighted"))
    return sorted(out)
