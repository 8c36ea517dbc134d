"""Collectives, their autograd pairs and byte accounting on spawned CPU ranks (gloo)."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from trickles import comm as C
from trickles.testing import RankError, RankTimeout, run_ranks
from trickles.topology import ParallelDims


def _collectives():
    n, r = dist.get_world_size(), dist.get_rank()
    topo = ParallelDims(dp=n).build()
    c = topo.comm("dp")
    x = torch.arange(6, dtype=torch.float32) + r
    c.all_reduce(x)
    m = torch.full((4,), float(r))
    c.all_reduce(m, op="mean")
    mx = torch.tensor([float(r)])
    c.all_reduce(mx, op="max")
    g0 = c.all_gather(torch.full((2, 3), float(r)), dim=0)
    g1 = c.all_gather(torch.full((2, 3), float(r)), dim=1)
    full = torch.arange(2 * 4 * n, dtype=torch.float32).view(2, 4 * n)
    rs = c.reduce_scatter(full, dim=1)
    rs0 = c.reduce_scatter(torch.ones(2 * n, 3), dim=0, op="mean")
    a2a = c.all_to_all(torch.arange(2 * n, dtype=torch.float32) + 100 * r, 0, 0)
    b = torch.full((3,), float(r))
    c.broadcast(b, src=1)
    buf = torch.zeros(3)
    for h in c.batch_p2p([("send", torch.full((3,), float(r)), (r + 1) % n), ("recv", buf, (r - 1) % n)]):
        h.wait()
    h = c.all_reduce(torch.ones(5), async_op=True)
    uneven = c.all_to_all_uneven(*_uneven_rows(n, r))
    return dict(
        x=x,
        m=m,
        mx=mx,
        g0=g0,
        g1=g1,
        rs=rs,
        rs0=rs0,
        a2a=a2a,
        b=b,
        buf=buf,
        h=h.wait(),
        uneven=uneven,
        ledger=topo.ledger.snapshot(),
    )


def _uneven_rows(n: int, r: int):
    """Rank 0 sends no rows at all; rank ``r > 0`` keeps one row of ``[2]`` for itself and sends ``r - 1`` rows to the
    next rank (rank 1: one row in all), rows valued ``10 r + destination``: ``(t, send_counts, recv_counts)`` for
    ``all_to_all_uneven``."""

    def sends(src: int) -> list[int]:
        counts = [0] * n
        if src > 0:
            counts[src] += 1
            counts[(src + 1) % n] += src - 1
        return counts

    send = sends(r)
    t = torch.cat([torch.full((k, 2), float(10 * r + dst)) for dst, k in enumerate(send)])
    return t, send, [sends(src)[r] for src in range(n)]


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_and_ledger(n):
    out = run_ranks(n, _collectives)
    tri = n * (n - 1) / 2
    for r, o in enumerate(out):
        assert torch.equal(o["x"], torch.arange(6.0) * n + tri)
        assert torch.allclose(o["m"], torch.full((4,), tri / n))
        assert o["mx"].item() == n - 1
        assert torch.equal(o["g0"], torch.cat([torch.full((2, 3), float(i)) for i in range(n)]))
        assert torch.equal(o["g1"], torch.cat([torch.full((2, 3), float(i)) for i in range(n)], dim=1))
        full = torch.arange(2 * 4 * n, dtype=torch.float32).view(2, 4 * n) * n
        assert torch.equal(o["rs"], full.chunk(n, dim=1)[r])
        assert torch.equal(o["rs0"], torch.ones(2, 3))
        assert torch.equal(o["a2a"], torch.tensor([float(2 * r + k % 2 + 100 * (k // 2)) for k in range(2 * n)]))
        assert torch.equal(o["b"], torch.full((3,), 1.0))
        assert torch.equal(o["buf"], torch.full((3,), float((r - 1) % n)))
        assert torch.equal(o["h"], torch.full((5,), float(n)))
        led = o["ledger"]
        # all-reduce: 3 sync (24 + 16 + 4 bytes) + 1 async (20 bytes); ring volume 2(n-1)/n
        assert led["all_reduce/dp"]["calls"] == 4 and led["all_reduce/dp"]["bytes"] == 24 + 16 + 4 + 20
        assert led["all_reduce/dp"]["wire_bytes"] == round(2 * (n - 1) / n * 24) + round(2 * (n - 1) / n * 16) + round(
            2 * (n - 1) / n * 4
        ) + round(2 * (n - 1) / n * 20)
        assert led["all_gather/dp"] == {"calls": 2, "bytes": 48, "wire_bytes": 2 * (n - 1) * 24}
        rs_bytes = 2 * 4 * n * 4 + 2 * n * 3 * 4
        assert led["reduce_scatter/dp"]["bytes"] == rs_bytes
        # uneven: the rows from each source in rank order; on the wire every row but the one kept (8 bytes each)
        recv = _uneven_rows(n, r)[2]
        assert torch.equal(
            o["uneven"], torch.cat([torch.full((k, 2), float(10 * src + r)) for src, k in enumerate(recv)])
        )
        assert led["all_to_all/dp"]["wire_bytes"] == round((n - 1) / n * 2 * n * 4) + 8 * max(r - 1, 0)
        assert led["send/dp"] == {"calls": 1, "bytes": 12, "wire_bytes": 12}
        assert led["broadcast/dp"]["wire_bytes"] == (12 if r == 1 else 0)


def _autograd_pairs():
    """Each autograd collective against the same math done densely on one rank."""
    n, r = dist.get_world_size(), dist.get_rank()
    c = ParallelDims(dp=n).build().comm("dp")
    torch.manual_seed(0)
    full = torch.randn(2, 4 * n, 3)  # identical on all ranks
    w = torch.randn(2, 4 * n, 3)
    res = {}

    def grad_of(fn, x, weight=w):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        (y * weight[tuple(slice(0, s) for s in y.shape)]).sum().backward()
        return y.detach(), x.grad

    local = full.chunk(n, dim=1)[r]
    res["scatter"] = grad_of(lambda x: C.scatter_to_region(x, c, dim=1), full)
    res["gather"] = grad_of(lambda x: C.gather_from_region(x, c, dim=1), local)
    res["gather_seq"] = grad_of(lambda x: C.gather_sequence(x, c, dim=1), local)
    res["rs_seq"] = grad_of(lambda x: C.reduce_scatter_sequence(x, c, dim=1), full * (r + 1))
    res["copy"] = grad_of(lambda x: C.copy_to_region(x, c), full)
    res["reduce"] = grad_of(lambda x: C.reduce_from_region(x, c), full * (r + 1))
    wa = torch.randn(2 * n, 4, 3)  # weights the all-to-all's output [2n, 4, 3]
    res["a2a"] = grad_of(lambda x: C.all_to_all(x, c, scatter_dim=1, gather_dim=0), full * (r + 1), wa)
    return res


def test_autograd_collectives_match_dense_math():
    n = 2
    out = run_ranks(n, _autograd_pairs)
    torch.manual_seed(0)
    full = torch.randn(2, 4 * n, 3)
    w = torch.randn(2, 4 * n, 3)
    wa = torch.randn(2 * n, 4, 3)
    s = sum(range(1, n + 1))
    for r, o in enumerate(out):
        y, g = o["scatter"]
        assert torch.equal(y, full.chunk(n, 1)[r])
        # backward all-gathers the local grads of every rank: each rank's chunk saw w[:, :4]
        assert torch.allclose(g, torch.cat([w[:, :4]] * n, dim=1))
        y, g = o["gather"]
        assert torch.equal(y, full)
        assert torch.allclose(g, w.chunk(n, 1)[r])
        y, g = o["gather_seq"]
        assert torch.equal(y, full)
        assert torch.allclose(g, (w * n).chunk(n, 1)[r])  # reduce-scatter of identical grads
        y, g = o["rs_seq"]
        assert torch.allclose(y, (full * s).chunk(n, 1)[r])
        assert torch.allclose(g, torch.cat([w[:, :4]] * n, dim=1))
        y, g = o["copy"]
        assert torch.equal(y, full) and torch.allclose(g, w * n)
        y, g = o["reduce"]
        assert torch.allclose(y, full * s) and torch.allclose(g, w)
        y, g = o["a2a"]
        assert y.shape == (2 * n, 4, 3)
        # rank r receives chunk r of dim 1 from every rank k (scaled by k+1), stacked along dim 0
        assert torch.allclose(y, torch.cat([(full * (k + 1)).chunk(n, 1)[r] for k in range(n)], dim=0))
        # rows 2r..2r+2 of every rank's output came from this rank, one column chunk per peer
        assert torch.allclose(g, torch.cat([wa[2 * r : 2 * r + 2]] * n, dim=1))


def _mesh_groups():
    topo = ParallelDims(dp=2, tp=2, pp=2).build()
    members = {}
    for name in ("dp", "tp", "pp", "cp", "ep", "world"):
        c = topo.comm(name)
        t = torch.tensor([float(topo.rank)])
        members[name] = sorted(int(v) for v in c.all_gather(t).tolist())
    return topo.coords, members


def _ep_groups():
    topo = ParallelDims(dp=4, ep=2).build()
    return topo.comm("ep").all_gather(torch.tensor([float(topo.rank)])).tolist()


def test_mesh_groups_have_the_documented_members():
    out = run_ranks(8, _mesh_groups)
    for rank, (coords, m) in enumerate(out):
        base = rank - coords["tp"]
        assert m["tp"] == [base, base + 1]
        assert m["dp"] == sorted({rank % 2 + 4 * coords["pp"], rank % 2 + 4 * coords["pp"] + 2})
        assert m["pp"] == [rank % 4, rank % 4 + 4]
        assert m["cp"] == [rank] and m["ep"] == [rank] and m["world"] == list(range(8))
    eps = run_ranks(4, _ep_groups)
    assert eps == [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0]]


def _skip_collective(marker):
    """Rank 0 enters an all-reduce rank 1 never joins; rank 1 returns only once rank 0 is on its way into it."""
    c = ParallelDims(dp=dist.get_world_size()).build().comm("dp")
    if dist.get_rank() == 0:
        open(marker, "w").close()
        c.all_reduce(torch.ones(4))
    else:
        while not os.path.exists(marker):
            time.sleep(0.01)
    return "done"


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    return 1


def test_hang_is_reported_with_rank_and_collective(tmp_path):
    # The pool's timeout is the mechanism under test; the events it reports are ordered by the marker (rank 1 has
    # returned, rank 0 is inside the all-reduce), and they take well under a second, far inside the timeout.
    with pytest.raises(RankTimeout) as e:
        run_ranks(2, _skip_collective, str(tmp_path / "rank0 entering"), timeout=4)
    msg = str(e.value)
    assert "did not finish on 1 of 2 ranks" in msg, msg
    assert "rank 0: all_reduce on group 'dp' (2 ranks, (4,) float32)" in msg
    assert "rank 1" not in msg
    # the pool is replaced and works again
    assert run_ranks(2, _ok) == [7, 7]


def _ok():
    return 7


def test_rank_error_carries_traceback():
    with pytest.raises(RankError, match="(?s)rank 1 raised.*ValueError: boom on rank one"):
        run_ranks(2, _raise_on_rank_one)


def _barrier_orders(tmp):
    comm = C.GroupComm("world", dist.group.WORLD, C.CommLedger())
    marker = os.path.join(tmp, "written-before-the-barrier")
    if comm.rank == 0:
        time.sleep(0.5)  # rank 1 reaches the barrier first
        open(marker, "w").close()
    comm.barrier()
    return os.path.exists(marker)


def test_barrier_waits_for_every_rank(tmp_path):
    """What rank 0 does before the barrier is done when any rank leaves it (an order, not a time)."""
    assert run_ranks(2, _barrier_orders, str(tmp_path)) == [True, True]
