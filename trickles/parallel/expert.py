"""Expert parallelism: the experts of every mixture-of-experts block split over the ``ep`` ranks.

Layout. ``ep`` divides the ``R = dp x cp`` ranks holding the same (pipeline, tensor) part of the model
(:meth:`~trickles.topology.Topology.replicas`); they form blocks of ``ep`` consecutive ranks (the ``ep``
group, :meth:`~trickles.topology.ParallelDims._ep_group`), and rank ``r`` of a block holds experts
``[r E_l, (r+1) E_l)``, ``E_l = E / ep``, of every MoE block (the stacked expert weights' leading axis,
described to checkpoints as that block of the global ``[E, ...]`` tensor, so they reshard like
tensor-parallel blocks). Every other weight -- attention, norms, dense MLPs, the routers -- is whole on
every rank. The ranks holding the same experts (one per block: the ``edp`` group, ``R / ep`` ranks) are
the data-parallel group of the experts.

Dispatch (per MoE block, forward). Each rank routes its own tokens (:func:`~trickles.models.moe.route`)
and sorts its kept assignments by global expert, hence by the rank that holds it. One all-to-all trades
the counts per expert (``[ep, E_l]`` int64); a second sends each assignment's input row to its expert's
rank (``all_to_all_single`` with those split sizes); the rank runs its experts on what it received
(grouped by local expert); a third all-to-all returns the outputs to the tokens' ranks, which weight them by
the routing weights and add them up. Backward runs the two row all-to-alls in reverse. Bytes on the wire
per rank and MoE block (per micro-batch), ``d`` the model width, ``e`` bytes per element, ``m_out`` the
assignments this rank sends to experts on other ranks (after capacity) and ``m_in`` those it receives for its
own experts: forward ``(m_out + m_in) d e`` (the rows out, the outputs back) plus the counts
``(ep - 1) / ep x E x 8``; backward again ``(m_out + m_in) d e``. Summed over a block of ranks,
``m_in`` and ``m_out`` are both the assignments routed off-rank, so the total is ``2 x (off-rank
assignments) x d x e`` forward and the same backward.

Gradients. The engine averages the experts' gradients over ``edp`` (their data-parallel group) and every other
weight's over all ``R`` replicas (:attr:`~trickles.parallel.engine.Engine.groups`: two groups of buckets, each
reduced in its own index order); then the experts' are divided by ``ep``: an expert's gradient already sums the
contributions of every token sent to it from the ``ep`` ranks of its block, so the sum over ``edp`` covers all
``R`` ranks' losses, whose mean is wanted. ZeRO shards each group over its own ranks, as Megatron's distributed
optimizer does: the experts' state over ``edp``, the rest over all ``R`` (ZeRO-3: each block's ``Experts`` is a
unit of its own, gathered over ``edp``). In the gradient norm every rank's owned parts sum over the ``R``
replicas (without ZeRO each weight counts on the first rank of its group).

**Split sequences** (:func:`split_sequence`: context parallelism, and sequence parallelism under tensor
parallelism). A rank then holds ``t = T / n`` tokens of every sequence (``n`` the cp or tp ranks). Routing,
the experts and the z-loss are per token and run on those; what is defined per sequence is completed over
the ``n`` ranks, so every layout routes and drops exactly what one process does:

* capacity: the ranks all-gather their tokens' choices (``[B, t, k]`` int64: ``(n - 1) B t k 8`` bytes in per
  rank), put them at their global positions, and each computes the whole sequences' keep mask and takes its
  tokens' part (the queue order is (choice, global position));
* load balancing: ``f_e`` (the fraction of the sequence's assignments to ``e``, no gradient) is the mean over the
  ranks of the local fractions (an all-reduce of ``[B, E]`` fp32; the ranks hold equal token counts), and each
  rank's loss is ``E sum_e f_e P_e^local``: their mean over the ranks is the sequence's ``E sum_e f_e P_e``;
  the z-loss is a mean over tokens, so the mean of the ranks' means.

Under context parallelism the engine averages gradients over ``dp x cp``, which takes that mean. Under
sequence parallelism the ``tp`` ranks' gradients of the router, the experts and the norm before them are
summed (``partial_grad``), so each rank starts its auxiliary losses' gradient at ``1 / tp``
(:attr:`~trickles.models.moe.MoE.aux_grad_factor`) and hard routing's per-token labels are cut to the rank's
sequence shard.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..comm import GroupComm
from ..models.moe import MoE
from ..models.transformer import Transformer
from .sequence import positions, unshard_sequence
from .tensor.layers import TPSpec, set_spec


class _AllToAllRows(torch.autograd.Function):
    """Rows ``send[i]`` go to rank ``i`` (in order), ``recv[i]`` rows come from it; backward the reverse."""

    @staticmethod
    def forward(ctx, x, comm: GroupComm, send: list[int], recv: list[int]):
        ctx.comm, ctx.send, ctx.recv = comm, send, recv
        return comm.all_to_all_uneven(x.contiguous(), send, recv)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_to_all_uneven(grad.contiguous(), ctx.recv, ctx.send), None, None, None


def expert_dispatch(layer: MoE, comm: GroupComm):
    """The expert-parallel ``dispatch`` of ``layer`` (same contract as :meth:`MoE.dispatch`)."""
    n_ep, el = comm.size, layer.experts.count

    def dispatch(x, experts, weights, keep):
        n, k = experts.shape
        flat_keep = keep.flatten()
        token = torch.arange(n, device=x.device).repeat_interleave(k)[flat_keep]
        expert = experts.flatten()[flat_keep]
        weight = weights.flatten()[flat_keep]
        order = torch.argsort(expert, stable=True)
        token, expert, weight = token[order], expert[order], weight[order]
        counts = torch.bincount(expert, minlength=n_ep * el).view(n_ep, el)
        got = comm.all_to_all(counts, 0, 0)  # [source rank, local expert]
        send, recv = counts.sum(1).tolist(), got.sum(1).tolist()
        rows = _AllToAllRows.apply(x[token], comm, send, recv)  # source-major, then by expert
        local = torch.arange(el, device=x.device).repeat(n_ep).repeat_interleave(got.flatten())
        by_expert = torch.argsort(local, stable=True)
        y = layer.experts(rows[by_expert], got.sum(0).tolist())
        back = torch.empty_like(y).index_copy(0, by_expert, y) if y.shape[0] else y  # received order again
        back = _AllToAllRows.apply(back, comm, recv, send)
        out = torch.zeros_like(x)
        out.index_add_(0, token, back * weight[:, None].to(x.dtype))
        return out

    return dispatch


def apply_expert_parallel(model: Transformer, comm: GroupComm) -> None:
    """Keeps this rank's ``E / ep`` experts of every MoE block (on the meta device, before allocation) and
    routes their tokens over ``comm`` (the ``ep`` group)."""
    r, n_ep = comm.rank, comm.size
    for block in model.layers.values():
        layer = block.mlp
        if not isinstance(layer, MoE):
            continue
        ex = layer.experts
        e = ex.count
        el = e // n_ep
        for lin in [m for m in (getattr(ex, "gate_proj", None), ex.up_proj, ex.down_proj) if m is not None]:
            for name in ("weight", "bias"):
                p = getattr(lin, name)
                if p is None:
                    continue
                local = torch.nn.Parameter(torch.empty((el, *p.shape[1:]), device=p.device, dtype=p.dtype))
                # whole on every tensor-parallel rank (experts are not split by tp), a block of the experts here
                spec = TPSpec(tuple(p.shape), (r * el,) + (0,) * (p.dim() - 1), replicated=True, ep_sharded=True)
                setattr(lin, name, set_spec(local, spec))
        ex.first = r * el
        object.__setattr__(layer, "dispatch", expert_dispatch(layer, comm))


def split_sequence(
    layer: MoE, comm: GroupComm, layout: str, active: Callable[[], bool], aux_grad_factor: float = 1.0
) -> None:
    """Makes ``layer`` route this rank's ``T / n`` tokens of every sequence exactly as one process routes the
    whole sequences (module docstring: "Split sequences"). ``comm``: the ``n`` ranks sharing the sequences;
    ``layout``: which positions each holds (``"ring"``: chunks ``i`` and ``2n - 1 - i`` of ``2n``; otherwise
    contiguous, :func:`~trickles.parallel.sequence.positions`); ``active()``: whether the forward now running
    is split (not when decoding with a KV cache)."""
    plain_keep, plain_fraction = layer.keep, layer.load_fraction
    n = comm.size
    mine: dict[tuple[int, str], torch.Tensor] = {}  # this rank's global positions, per local length and device

    def keep(experts: torch.Tensor) -> torch.Tensor:
        if not active() or layer.capacity_factor <= 0:  # dropless keeps everything: nothing to complete
            return plain_keep(experts)
        t = experts.shape[1]
        gathered = comm.all_gather(experts.contiguous(), dim=1)  # [B, n t, k], rank after rank
        whole = unshard_sequence(list(gathered.chunk(n, dim=1)), layout)  # at their global positions
        key = (t, str(experts.device))
        if key not in mine:
            mine[key] = positions(t * n, n, comm.rank, layout).to(experts.device)
        return plain_keep(whole)[:, mine[key]]

    def fraction(experts: torch.Tensor) -> torch.Tensor:
        f = plain_fraction(experts)
        return comm.all_reduce(f, op="mean") if active() else f

    object.__setattr__(layer, "keep", keep)
    object.__setattr__(layer, "load_fraction", fraction)
    layer.aux_grad_factor = aux_grad_factor


def expert_modules(model: Transformer) -> list[torch.nn.Module]:
    """The ``Experts`` module of every mixture-of-experts block (ZeRO-3 shards each as a unit over ``edp``)."""
    return [block.mlp.experts for block in model.layers.values() if isinstance(block.mlp, MoE)]


def dispatch_wire_bytes(m_out: int, m_in: int, d: int, e: int, experts: int, ep: int, blocks: int) -> tuple[int, int]:
    """``(calls, bytes sent)`` of one rank's ``ep`` all-to-alls over ``blocks`` MoE block passes (MoE blocks x
    micro-batches) of a step, the module docstring's formula: per block pass five all-to-alls -- forward the counts
    (``(ep-1)/ep x E x 8`` bytes), the rows out and the outputs back, backward the two row exchanges -- carrying
    ``2 (m_out + m_in) d e`` in all, ``m_out`` the assignments (summed over the block passes) the rank sends to
    experts on other ranks and ``m_in`` those it receives for its own. Under a balanced load ``m_out = m_in =
    (ep-1)/ep x m``, ``m`` the rank's kept assignments (:func:`~trickles.memory.moe_activations.moe_assignments`)."""
    if ep <= 1:
        return 0, 0
    return 5 * blocks, 2 * (m_out + m_in) * d * e + blocks * (ep - 1) * experts * 8 // ep
