"""Context-parallel attention: trickles' ring and all-to-all attention vs DeepSpeed-Ulysses (and PyTorch's
``context_parallel`` where it runs), same run.

What is compared
    One layer's attention core -- causal attention, forward and backward -- on a sequence split over
    ``N`` context-parallel ranks (``--world``): from this rank's ``q [B, t, H, D]``, ``k, v [B, t, H_kv, D]``
    (``t = T / N``; the layout the projections produce) to the heads side by side ``[B, t, H D]`` that
    ``o_proj`` takes, and back to the gradients of ``q``, ``k`` and ``v`` from a fixed upstream gradient:

    * ours: ``trickles.parallel.context.ring_attention`` (tokens in the load-balanced ring layout, rank
      ``i`` holding chunks ``i`` and ``2N-1-i``) and ``ulysses_attention`` (contiguous slices; SDPA on whole
      sequences of ``H / N`` heads as ``attend``), over ``ParallelDims(cp=N).build(device).comm("cp")``,
      called as ``Attention.core`` calls its ``_attend`` (inputs transposed to ``[B, H, t, D]`` views, output
      transposed back and flattened);
    * peers: ``deepspeed.sequence.layer.DistributedAttention`` (DeepSpeed-Ulysses: all-to-all of q, k, v
      and the output, ``scatter_idx=2, gather_idx=1``, batch first, the same SDPA as local attention) for
      both of our modes -- it solves the same problem; and PyTorch's
      ``torch.distributed.tensor.experimental.context_parallel`` (ring over a 1-D device mesh, the same
      head-tail layout as ours) as the ring's peer where it runs (it needs the CUDA flash / efficient /
      cuDNN attention kernels: on CPU it fails, reported, and the ring is compared with DeepSpeed);
    * a reference row: one process running SDPA on the whole sequence (no peer; its step time and
      saved bytes show what a device would do and hold without context parallelism).
    * ours ring with packed documents' masks (``data.document_mask``: ``--documents K`` documents per sequence,
      8 unless told, 0 leaves this row out; cut at random places; :class:`trickles.parallel.context.RingDocuments`
      masks each block pair and skips the blocks no document spans), against our ring without masks -- what the
      masks cost or save; its agreement check is against SDPA with the same-document causal mask on the whole
      sequence. It runs on every rank at once, so on a shared CPU it sees the same contention as the others.

    At ``--world 1`` (cp=1: one process, nothing sent) the ring and the all-to-all are timed against that
    reference row instead: what their attention blocks cost against ``F.scaled_dot_product_attention`` on
    the same device (the ring's blocks run PyTorch's fused CPU kernel on a CPU and fp32 matmuls elsewhere,
    ``trickles/parallel/ring.py``). DeepSpeed and PyTorch's ``context_parallel`` are left out there.

How
    * Same data: the whole ``q, k, v`` and upstream gradient from a fixed generator on every rank;
      every contestant takes its rank's tokens of them in its own layout (ring: ``positions(T, N, r,
      "ring")``; all-to-all and DeepSpeed: contiguous slices).
    * Agreement check before timing: each contestant's output and gradients of ``q``, ``k``, ``v`` are
      gathered from every rank, put back in sequence order by their positions
      (``unshard_sequence``) and compared with SDPA on the whole sequence in one process; relative error
      ``||a - b|| / ||b||`` over the whole tensor must be at most ``--tol`` (1e-5 in fp32, 2e-2 in bf16),
      else the run stops.
    * Memory per rank, in one more untimed step: the bytes autograd saves for backward during the
      forward, distinct storages counted once (a ``saved_tensors_hooks`` pack hook, the count of
      ``trickles.memory.activations.ActivationMeter``), plus the output's storage
      unless already saved (``o_proj`` keeps it as its input in a model) -- the same count for every
      contestant; on CUDA also ``torch.cuda.max_memory_allocated`` during the step above what was
      allocated before it (the inputs).
    * Bytes sent per rank in the same step: ours from the topology's ``CommLedger`` (wire bytes of every
      send and all-to-all on the ``cp`` group), next to the formulas in ``trickles/parallel/ring.py``'s and
      ``context.py``'s docstrings; DeepSpeed's by wrapping ``deepspeed.comm.all_to_all_single`` (``(N-1)/N`` of each
      input, what leaves the rank).
    * Timing: after ``--warmup`` untimed rounds, ``--steps`` rounds in which every contestant runs one
      step, the order rotating each round so noise falls on all of them alike. Each step starts after a
      barrier and its clock stops when its backward has returned and the device is synchronized (every
      send, receive and all-to-all it started has completed); its time is the slowest rank's. The table
      gives median and mean step time, the ratio of medians against the peer (``vs peer``) and the
      paired ratio (median over rounds of ours/peer in the same round).
    * CPU: ``torch.set_num_threads(cores // N)`` in every rank (``--threads`` overrides); gloo. CUDA:
      one GPU per rank, NCCL, under ``torchrun``.

Communication formulas (bytes one rank sends per step, ``e`` bytes per element, ``t = T / N``)
    * ring: a key/value block is ``2 B H_kv t D``; forward sends ``N-1`` blocks, backward ``N-1`` blocks
      and ``N`` fp32 gradient blocks: ``(N-1) 2 B H_kv t D e x 2 + N 2 B H_kv t D 4``;
    * all-to-all (ours and DeepSpeed): four all-to-alls each way, each sending ``(N-1)/N`` of its tensor:
      ``2 (N-1)/N B t D e (2 H + 2 H_kv')``; ours repeats the key/value heads ``f = N / gcd(H_kv, N)``
      times when ``N`` does not divide them (``H_kv' = f H_kv``), DeepSpeed splits them unevenly instead
      (and needs ``H_kv >= N``).

Target
    ours/peer median step time <= 1.0x, at no more saved bytes per rank, for ring and all-to-all.

Examples::

    python benchmarks/context_parallel.py                      # CPU, 2 ranks, B 1, H 8, T 2048, D 64, fp32
    python benchmarks/context_parallel.py --world 4 --steps 6
    python benchmarks/context_parallel.py --kv-heads 2 --json out/cp.json     # grouped-query attention
    python benchmarks/context_parallel.py --world 1 --device cuda --seq 8192 --heads 16   # cp=1: ring vs SDPA
    torchrun --nproc-per-node 8 benchmarks/context_parallel.py --device cuda --seq 65536 --heads 32 --precision bf16
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _deepspeed import CountSent  # noqa: E402
from _deepspeed import load as load_deepspeed
from _ranks import (
    PAIRED_NOTE,
    Contestant,
    compare_times,
    device_line,
    entry,
    finish,
    gather,
    refuse,
    setup_rank,  # noqa: E402
    time_rounds,
    times_table,
)
from _timing import device_name, rel_error, sync, table, write_json  # noqa: E402

from trickles.models.documents import dense_mask  # noqa: E402
from trickles.parallel.context import (
    RingDocuments,
    kv_repeats,
    positions,
    ring_attention,
    ulysses_attention,  # noqa: E402
    unshard_sequence,
)
from trickles.topology import ParallelDims  # noqa: E402

DEFAULTS = {"cpu": {"seq": 2048, "precision": "fp32"}, "cuda": {"seq": 32768, "precision": "bf16"}}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {"fp32": 1e-5, "bf16": 2e-2}
REF, RING, ULYSSES, DS, TORCH_CP = (
    "sdpa, 1 process",
    "ours ring",
    "ours ulysses",
    "deepspeed ulysses",
    "torch cp (ring)",
)
RING_DOCS = "ours ring, documents"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--world", type=int, default=2, help="context-parallel degree (processes); under torchrun its WORLD_SIZE"
    )
    p.add_argument("--batch", type=int, default=1, help="sequences")
    p.add_argument("--heads", type=int, default=8, help="query heads H")
    p.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help="key/value heads H_kv (default: --heads; fewer: grouped-query attention)",
    )
    p.add_argument(
        "--seq",
        type=int,
        default=None,
        help=f"tokens per sequence T (default: cpu {DEFAULTS['cpu']['seq']}, cuda {DEFAULTS['cuda']['seq']})",
    )
    p.add_argument("--head-dim", type=int, default=64, help="head dimension D")
    p.add_argument(
        "--precision",
        choices=list(DTYPES),
        default=None,
        help=f"dtype of q, k, v (default: cpu {DEFAULTS['cpu']['precision']}, cuda {DEFAULTS['cuda']['precision']})",
    )
    p.add_argument("--steps", type=int, default=10, help="timed rounds (one step of every contestant per round)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds after the agreement check and the memory step")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads per rank on CPU (default: cores // world)"
    )
    p.add_argument(
        "--tol",
        type=float,
        default=None,
        help="largest relative error allowed in the agreement check (default: fp32 1e-5, bf16 2e-2)",
    )
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed's DistributedAttention out")
    p.add_argument("--no-torch-cp", action="store_true", help="do not try PyTorch's context_parallel")
    p.add_argument(
        "--documents",
        type=int,
        default=8,
        metavar="K",
        help="time our ring with packed documents' masks, K documents per sequence, against the ring without (0: not)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH (rank 0)")
    return p.parse_args(argv)


# ---- contestants ---------------------------------------------------------------------------


class Core(Contestant):
    """One attention core on this rank: its local ``q, k, v`` (leaves ``[B, t, H(_kv), D]``, in the layout
    ``mode`` of :func:`positions`, or the whole sequence), the upstream gradient and ``fn(q, k, v) -> [B, t, H D]``."""

    def __init__(self, name: str, peer: str | None, mode: str | None, fn, whole, dout, cp: int, rank: int):
        super().__init__(name)
        self.peer, self.mode, self.fn = peer, mode, fn
        pos = None if mode is None else positions(dout.shape[1], cp, rank, mode).to(dout.device)
        take = (lambda x: x) if pos is None else (lambda x: x[:, pos])
        self.inputs = [take(x).detach().clone().requires_grad_() for x in whole]
        self.dout = take(dout).contiguous()
        self.none = torch.zeros((), device=dout.device)

    def forward(self) -> torch.Tensor:
        return self.fn(*self.inputs)

    def step(self, x=None, y=None) -> torch.Tensor:
        for p in self.inputs:
            p.grad = None
        self.forward().backward(self.dout)
        return self.none  # run_step reads a "loss"; the step has none


class TorchCP(Core):
    """PyTorch's ``context_parallel``: SDPA inside the context runs the ring over ``mesh``; backward too."""

    def __init__(self, *a, mesh, seq: int, **kw):
        super().__init__(*a, **kw)
        self.mesh = mesh
        self.dummy = torch.zeros(1, seq, device=self.dout.device)  # the context shards (and restores) a buffer

    def step(self, x=None, y=None) -> torch.Tensor:
        from torch.distributed.tensor.experimental import context_parallel

        with context_parallel(self.mesh, buffers=[self.dummy], buffer_seq_dims=[1]):
            return super().step()


def sdpa(q, k, v):
    """Causal SDPA on ``[B, H, T, D]``, grouped-query heads shared by the kernel."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def heads_first(*xs):
    return [x.transpose(1, 2) for x in xs]


def flat(o: torch.Tensor) -> torch.Tensor:
    """``[B, H, t, D]`` -> ``[B, t, H D]`` as ``Attention.core`` does (a view when laid out ``[B, t, H, D]``)."""
    return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)


def make_deepspeed(device: torch.device):
    """DeepSpeed-Ulysses ``DistributedAttention`` over the default group, batch first (``[B, t, H, D]``);
    ``(module, version)``, or ``(None, why)`` where it cannot be had."""
    deepspeed, why = load_deepspeed(device)
    if deepspeed is None:
        return None, f"import failed ({why}); pip install deepspeed"
    from deepspeed.sequence.layer import DistributedAttention

    def local(q, k, v):  # [B, T, H/N, D] -> [B, T, H/N, D]
        return sdpa(*heads_first(q, k, v)).transpose(1, 2)

    return DistributedAttention(local, dist.group.WORLD, scatter_idx=2, gather_idx=1), deepspeed.__version__


# ---- formulas ------------------------------------------------------------------------------


def expected_sent(name: str, b: int, h: int, h_kv: int, seq: int, d: int, n: int, e: int) -> float | None:
    """Bytes one rank sends per step (forward and backward) by the formulas in the module docstring."""
    t = seq // n
    if n == 1 and name in (RING, RING_DOCS, ULYSSES):  # one rank: the ring and the all-to-all send nothing
        return 0.0
    if name in (RING, RING_DOCS):  # (masked or skipped blocks still pass their keys and values on)
        block = 2 * b * h_kv * t * d
        return (n - 1) * block * e * 2 + n * block * 4
    if name == ULYSSES:
        return 2 * (n - 1) / n * b * t * d * e * (2 * h + 2 * kv_repeats(h, h_kv, n) * h_kv)
    if name == DS:
        return 2 * (n - 1) / n * b * t * d * e * (2 * h + 2 * h_kv)
    return None


def _check_shape(b: int, h: int, h_kv: int, seq: int, n: int, documents: int = 0) -> str | None:
    if n < 1:
        return "--world must be at least 1"
    if h % h_kv:
        return f"--heads {h} is not a multiple of --kv-heads {h_kv}"
    if not 0 <= documents <= seq:
        return f"--documents {documents} must be between 0 (no documents row) and --seq {seq}"
    if seq % (2 * n):
        return f"--seq {seq} must be divisible by 2 x --world = {2 * n} (the ring holds two equal chunks per rank)"
    if h % n:
        return f"--heads {h} must be divisible by --world {n} (the all-to-all splits the query heads)"
    try:
        kv_repeats(h, h_kv, n)
    except ValueError as e:
        return str(e)
    return None


# ---- measurements --------------------------------------------------------------------------


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward while entered: the count of
    ``trickles.memory.activations.ActivationMeter`` (a ``saved_tensors_hooks`` pack hook, each storage once),
    without its per-layer split and model-state exclusion (there are no parameters here)."""

    def __init__(self):
        self.seen: set[int] = set()
        self.total = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() and st.data_ptr() not in self.seen and st.nbytes():
            self.seen.add(st.data_ptr())
            self.total += st.nbytes()
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _gather_whole(c: Core, t: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's ``t [B, t, ...]`` put back in sequence order (the whole-sequence row's own ``t``)."""
    if c.mode is None:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return unshard_sequence(parts, c.mode)


def check(c: Core, ref: list[torch.Tensor], world: int) -> list[float]:
    """Relative errors of output and the gradients of q, k, v against the whole-sequence reference."""
    for p in c.inputs:
        p.grad = None
    out = c.forward()
    out.backward(c.dout)
    got = [out.detach(), *(p.grad for p in c.inputs)]
    errors = []
    for g, r in zip(got, ref):
        whole = _gather_whole(c, g.float(), world)
        errors.append(rel_error(whole, r))
    return errors


def check_step(c: Core, ref, world) -> list[float]:
    if isinstance(c, TorchCP):
        from torch.distributed.tensor.experimental import context_parallel

        with context_parallel(c.mesh, buffers=[c.dummy], buffer_seq_dims=[1]):
            return check(c, ref, world)
    return check(c, ref, world)


def measure(c: Core, topo, device: torch.device, world: int) -> dict:
    """One untimed step: saved bytes (+ the output), CUDA peak above the step's start, bytes sent."""
    from contextlib import ExitStack, nullcontext

    for p in c.inputs:
        p.grad = None
    gc.collect()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    topo.ledger.reset()
    counter = CountSent(world) if c.name == DS and world > 1 else None
    with ExitStack() as stack:
        if isinstance(c, TorchCP):
            from torch.distributed.tensor.experimental import context_parallel

            stack.enter_context(context_parallel(c.mesh, buffers=[c.dummy], buffer_seq_dims=[1]))
        stack.enter_context(counter if counter else nullcontext())
        with SavedBytes() as meter:
            out = c.forward()
        meter.pack(out)  # o_proj keeps the output as its input (counted unless already saved)
        saved = meter.total
        out.backward(c.dout)
        del out
        sync(device)
    res = {"saved": saved, "peak": None, "sent": None, "ops": None}
    if device.type == "cuda":
        res["peak"] = torch.cuda.max_memory_allocated(device) - base
    if c.name in (RING, RING_DOCS, ULYSSES):
        snap = topo.ledger.snapshot()
        res["ops"] = {k: v for k, v in snap.items() if k.endswith("/cp")}
        res["sent"] = sum(v["wire_bytes"] for k, v in res["ops"].items() if not k.startswith("recv/"))
    elif counter is not None:
        calls, sent = counter.ops["all_to_all_single"]
        res["sent"], res["ops"] = sent, {"all_to_all_single": {"calls": calls, "wire_bytes": sent}}
    elif c.name == REF or world == 1:
        res["sent"] = 0
    return res


# ---- one rank ------------------------------------------------------------------------------


def rank_main(args) -> int:
    device, rank, world = setup_rank(args)
    seq = args.seq or DEFAULTS[device.type]["seq"]
    precision = args.precision or DEFAULTS[device.type]["precision"]
    dtype, tol = DTYPES[precision], args.tol if args.tol is not None else TOL[precision]
    b, h, d = args.batch, args.heads, args.head_dim
    h_kv = args.kv_heads or h
    problem = _check_shape(b, h, h_kv, seq, world, args.documents)
    if problem:
        return refuse(f"context_parallel.py: {problem}; change --world or the shape")
    topo = ParallelDims(dp=1, cp=world).build(device)
    comm = topo.comm("cp")

    g = torch.Generator().manual_seed(args.seed)
    q, k, v = (torch.randn(b, seq, n, d, generator=g) for n in (h, h_kv, h_kv))
    dout = torch.randn(b, seq, h * d, generator=g)
    ref_in = [x.to(device).requires_grad_() for x in (q, k, v)]  # the fp32 reference, one process, whole sequence
    ref_out = flat(sdpa(*heads_first(*ref_in)))
    ref_out.backward(dout.to(device))
    ref = [ref_out.detach(), *(x.grad for x in ref_in)]
    del ref_in, ref_out
    refs = {}  # a contestant's own reference, where it computes something else
    if args.documents:
        cuts = torch.zeros(b, seq, dtype=torch.int32)
        for row in range(b):
            cuts[row, torch.randperm(seq - 1, generator=g)[: args.documents - 1] + 1] = 1
        ids = torch.cumsum(cuts, dim=1, dtype=torch.int32)
        ref_in = [x.detach().to(device).clone().requires_grad_() for x in (q, k, v)]  # (own leaves: ref's grads stay)
        masked = [z.transpose(1, 2) for z in ref_in]
        rep = h // h_kv
        out = F.scaled_dot_product_attention(
            masked[0],
            masked[1].repeat_interleave(rep, 1),
            masked[2].repeat_interleave(rep, 1),
            attn_mask=dense_mask(ids.to(device)),
        )
        out = flat(out)
        out.backward(dout.to(device))
        refs[RING_DOCS] = [out.detach(), *(x.grad for x in ref_in)]
        del ref_in, masked, out
    whole = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
    dout = dout.to(device=device, dtype=dtype)
    del q, k, v

    peers: dict[str, str] = {}
    if world == 1:
        ds, why = None, "--world 1 (nothing to split; ours are compared with SDPA in one process)"
    else:
        ds, why = (None, "left out (--no-deepspeed)") if args.no_deepspeed else make_deepspeed(device)
    if ds is not None and h_kv % world and h_kv < world:
        ds, why = None, f"needs at least --world key/value heads (H_kv {h_kv} < {world})"
    peers[DS] = f"ran (deepspeed {why})" if ds is not None else f"did not run: {why}"

    kw = {"cp": world, "rank": rank}
    ring_peer = REF if world == 1 else (DS if ds is not None else None)  # cp=1: the ring's own cost against SDPA
    contestants: list[Core] = [
        Core(REF, None, None, lambda q, k, v: flat(sdpa(*heads_first(q, k, v))), whole, dout, **kw)
    ]
    torch_cp = None
    if args.no_torch_cp:
        peers[TORCH_CP] = "did not run: left out (--no-torch-cp)"
    elif world == 1:
        peers[TORCH_CP] = "did not run: --world 1"
    else:
        try:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.experimental import context_parallel  # noqa: F401

            mesh = init_device_mesh(device.type, (world,))
            torch_cp = TorchCP(
                TORCH_CP,
                None,
                "ring",
                lambda q, k, v: flat(
                    F.scaled_dot_product_attention(
                        *heads_first(q, k, v), is_causal=True, **({"enable_gqa": True} if h != h_kv else {})
                    )
                ),
                whole,
                dout,
                mesh=mesh,
                seq=seq,
                **kw,
            )
        except Exception as e:  # noqa: BLE001
            peers[TORCH_CP] = f"did not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    contestants.append(
        Core(
            RING,
            ring_peer,
            "ring",
            lambda q, k, v: flat(ring_attention(*heads_first(q, k, v), comm)),
            whole,
            dout,
            **kw,
        )
    )
    contestants.append(
        Core(
            ULYSSES,
            ring_peer,
            "ulysses",
            lambda q, k, v: flat(ulysses_attention(*heads_first(q, k, v), comm, sdpa)),
            whole,
            dout,
            **kw,
        )
    )
    if args.documents:
        docs = RingDocuments(ids, ids.to(device))
        contestants.append(
            Core(
                RING_DOCS,
                RING,
                "ring",
                lambda q, k, v: flat(ring_attention(*heads_first(q, k, v), comm, docs)),
                whole,
                dout,
                **kw,
            )
        )
    if ds is not None:
        contestants.append(
            Core(
                DS,
                None,
                "ulysses",
                lambda q, k, v: ds(q, k, v, 0).reshape(q.shape[0], q.shape[1], -1),
                whole,
                dout,
                **kw,
            )
        )

    # agreement check (PyTorch's context_parallel is tried here: where it fails it is dropped, with the reason)
    errors: dict[str, list[float]] = {}
    for c in contestants:
        errors[c.name] = check_step(c, refs.get(c.name, ref), world)
    if torch_cp is not None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                errors[TORCH_CP] = check_step(torch_cp, ref, world)
            failure = None
        except Exception as e:  # noqa: BLE001
            failure = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        failures = [None] * world
        dist.all_gather_object(failures, failure)
        failure = next((f for f in failures if f), None)
        if failure:
            peers[TORCH_CP] = f"did not run: {failure}"
            errors.pop(TORCH_CP, None)
        else:
            peers[TORCH_CP] = "ran"
            contestants.append(torch_cp)
            next(c for c in contestants if c.name == RING).peer = TORCH_CP  # ours ring against PyTorch's ring
    del ref, refs
    gc.collect()

    memory = {c.name: measure(c, topo, device, world) for c in contestants}
    time_rounds(contestants, None, None, args, device)
    everyone = gather({"times": {c.name: c.times for c in contestants}, "errors": errors, "memory": memory})
    shape = dict(batch=b, heads=h, kv_heads=h_kv, seq=seq, head_dim=d, precision=precision)
    status = report(args, everyone, contestants, peers, shape, tol, device, world) if rank == 0 else 0
    del contestants, topo
    return finish(status, device)


# ---- report (rank 0) -----------------------------------------------------------------------


def report(
    args,
    everyone: list[dict],
    contestants: list[Core],
    peers: dict[str, str],
    shape: dict,
    tol: float,
    device: torch.device,
    world: int,
) -> int:
    b, h, h_kv, seq, d = (shape[k] for k in ("batch", "heads", "kv_heads", "seq", "head_dim"))
    e = DTYPES[shape["precision"]].itemsize
    names = [c.name for c in contestants]
    print(
        f"trickles context-parallel attention (ring, all-to-all) vs DeepSpeed-Ulysses / PyTorch context_parallel, "
        f"causal attention core forward + backward, cp={world}"
    )
    print(f"  shape   B {b}, H {h}, H_kv {h_kv}, T {seq} ({seq // world} tokens per rank), D {d}, {shape['precision']}")
    print(device_line(device))
    for n, what in peers.items():
        print(f"  peer    {n}: {what}")
    print("  (ring-flash-attn and yunchang are not tried: they run on the flash-attn CUDA kernels only)")

    print(
        f"\nagreement check: output and input gradients, every rank's tokens put back in order, vs SDPA on the whole "
        f"sequence (fp32, one process; '{RING_DOCS}': with the same-document causal mask); relative error "
        f"||a-b||/||b||, tolerance {tol:g}"
    )
    rows, ok = [], True
    errors = everyone[0]["errors"]
    for n in names:
        good = max(errors[n]) <= tol
        ok &= good
        rows.append([n, *(f"{x:.1e}" for x in errors[n]), "ok" if good else "MISMATCH"])
    print(table(["implementation", "out", "dq", "dk", "dv", ""], rows))
    if not ok:
        print(
            f"an implementation disagrees with SDPA by more than --tol {tol:g}: the timings would be meaningless",
            file=sys.stderr,
        )
        return 1

    # memory and bytes (largest over the ranks)
    mem = {
        n: {
            f: max((r["memory"][n][f] for r in everyone if r["memory"][n][f] is not None), default=None)
            for f in ("saved", "peak", "sent")
        }
        for n in names
    }
    expect = {n: expected_sent(n, b, h, h_kv, seq, d, world, e) for n in names}
    mib = lambda x: "-" if x is None else f"{x / 2**20:.2f}"  # noqa: E731

    results, _ = compare_times(everyone, contestants, args.steps, b * seq)
    header = ["implementation", "median ms", "mean ms", "stdev ms", "peer", "vs peer", "paired", "saved MiB"]
    if device.type == "cuda":
        header.append("peak MiB")
    header += ["sent MiB", "formula MiB"]
    rows = []
    for c in contestants:
        n, r = c.name, results[c.name]
        row = [
            n,
            f"{r['median'] * 1e3:.1f}",
            f"{r['mean'] * 1e3:.1f}",
            f"{r['stdev'] * 1e3:.1f}",
            r["peer"] or "-",
            f"{r['ratio']:.3f}x" if r["peer"] else "-",
            f"{r['paired_ratio']:.3f}x" if r["peer"] else "-",
            mib(mem[n]["saved"]),
        ]
        if device.type == "cuda":
            row.append(mib(mem[n]["peak"]))
        row += [mib(mem[n]["sent"]), mib(expect[n])]
        rows.append(row)
    times_table(
        args,
        rows,
        header,
        how="; memory and bytes per rank (largest over the ranks)",
        note=PAIRED_NOTE + ". saved: bytes autograd keeps for backward plus the output (o_proj's input), distinct "
        "storages; sent: wire bytes this rank sends (ours: CommLedger; DeepSpeed: its all_to_all_single calls); "
        "formula: trickles/parallel/ring.py's and context.py's docstrings.",
    )
    for n in (RING, ULYSSES, *([RING_DOCS] if RING_DOCS in names else [])):
        ops = everyone[0]["memory"][n]["ops"]
        if ops:
            print(
                f"  {n}: "
                + ", ".join(
                    f"{k} x{v['calls']} {v['wire_bytes'] / 2**20:.2f} MiB"
                    for k, v in ops.items()
                    if not k.startswith("recv/")
                )
            )

    verdicts = []
    for n in (RING, ULYSSES):
        r = results[n]
        if not r["peer"]:
            verdicts.append(f"{n}: no peer ran")
            continue
        peer = r["peer"]
        mem_ratio = mem[n]["saved"] / mem[peer]["saved"]
        met = r["ratio"] <= 1.0 and mem_ratio <= 1.0
        verdicts.append(
            f"{n}/{peer} {r['ratio']:.3f}x (paired {r['paired_ratio']:.3f}x), saved {mem_ratio:.3f}x: "
            f"{'met' if met else 'NOT met'}"
        )
    print("\ntarget ours/peer <= 1.0x at no more memory:  " + ";  ".join(verdicts))
    if RING_DOCS in names:
        r = results[RING_DOCS]
        print(
            f"documents: {RING_DOCS}/{RING} {r['ratio']:.3f}x (paired {r['paired_ratio']:.3f}x), "
            f"{args.documents} documents a sequence (a measurement: skipped blocks cost nothing, masked ones the mask)"
        )

    if args.json:
        import importlib.metadata as md

        try:
            ds_version = md.version("deepspeed")
        except md.PackageNotFoundError:
            ds_version = None
        write_json(
            args.json,
            {
                "args": vars(args),
                "world": world,
                "shape": shape,
                "device": str(device),
                "device_name": device_name(device),
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "deepspeed": ds_version,
                "backend": dist.get_backend(),
                "peers": peers,
                "tol": tol,
                "errors": errors,
                "memory": mem,
                "expected_sent": expect,
                "ops": {n: everyone[0]["memory"][n]["ops"] for n in names},
                "results": results,
            },
        )
    return 0


# ---- entry ---------------------------------------------------------------------------------

main = entry(parse_args, rank_main)


if __name__ == "__main__":
    sys.exit(main())
