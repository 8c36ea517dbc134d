"""A stage's backward cut in two: ``B``, the input's gradient (on the critical path), and ``W``, the weights'
(deferred into the schedule's idle time), as zero-bubble schedules need.

For one micro-batch through one chunk, ``y = f(x; w)``: ``B`` computes ``dx`` from ``dy`` and nothing else,
``W`` computes every ``dw`` later, from what ``B`` left behind -- without running any part of ``B`` again.

**How, on the autograd graph** (no change to the model). Call ``D`` the graph's nodes that lead to the input
``x`` (the ones ``B`` must run). Every other node of the graph hangs off some node of ``D`` through an edge
that leaves ``D``; such a node of ``D`` is an *intermediate* (a linear's ``mm``: one edge toward ``x``, one
toward ``w``). ``B`` runs ``torch.autograd.backward(y, dy, inputs=[x], retain_graph=True)``, which executes
exactly ``D`` (asking each node only for the gradients toward ``x``), while a pre-hook on every intermediate
records the gradient arriving at it. ``W`` then starts the engine again *at the intermediates*
(``GradientEdge(node, k)`` with the recorded gradients) asking for the weights only, which runs each
intermediate once more -- now only its edges toward the weights (``dw = dy^T x`` of each linear) -- and the
nodes between it and the weights. Each weight's gradient arrives through ``AccumulateGrad``, so the
data-parallel engine's post-accumulate-grad hooks fire in ``W`` exactly as in a whole backward.

The intermediates form *groups*: those whose weight-side parts share a node (one weight used twice) are one
group. One restart may not hold two intermediates of which one lies below the other in ``D``: the engine would
carry the upper one's gradient down ``D`` to the lower one, which already has its own recorded. So a restart
holds the groups whose intermediates all sit at one *depth* (the longest path in ``D`` down to the input: two
nodes at the same depth are never above one another) -- a layer's query, key and value projections together,
its gate and up projections together -- in the order the whole
backward reaches them (latest first), so every tensor-parallel rank issues their collectives in the same order.
Each restart costs the engine a walk over the graph below it, so fewer of them is most of ``W``'s overhead on
small stages. A weight reached from
two intermediates of which one lies *below* the other in ``D`` (the same weight used in two layers of one
chunk) would have its gradient counted twice by that restart; for such a chunk ``W`` runs the whole backward
again from the output, asking for the weights only (correct, at the price of ``B``'s work twice). A chunk that
reads no activation (the first stage) has no ``B``: its ``W`` is its whole backward (:attr:`Deferred.whole`).

**Functions that compute both gradients in one backward** (tensor-parallel linears under sequence
parallelism) ask :func:`phase`: during ``B`` they compute the input's gradient only, during ``W`` the
weights' only -- a plain backward (``phase() is None``) computes both. Other such functions (fused kernels)
are correct without asking, at the price of recomputing their input's gradient in ``W``.

**Recomputation.** Selective recomputation redoes the attention core in ``B`` only (``W`` reads no tensor of it).
Full recomputation would redo a block's forward in every ``W`` restart that reads one of its saved inputs (each
restart is a graph task of its own), so the configuration refuses it with the zero-bubble schedules.

**Memory.** ``B`` keeps the graph (``retain_graph``): the chunk's saved activations stay until its ``W``
(each ``W`` call frees what it ran), plus the recorded gradients at the intermediates -- one ``[tokens,
d_out]`` tensor per linear, what ``W`` multiplies by the saved input.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

# Which part of a split backward is running. A plain module variable, not a context variable: on CUDA the autograd
# engine runs the nodes on its own device thread, which sees no context variable the caller set; ``B`` and ``W``
# block the calling thread until the engine is done, so the value holds exactly while they run.
_PHASE: list[str | None] = [None]


def phase() -> str | None:
    """``"input"`` during a ``B``, ``"weight"`` during a ``W``, None in a whole backward."""
    return _PHASE[0]


@contextlib.contextmanager
def _in_phase(name: str):
    before, _PHASE[0] = _PHASE[0], name
    try:
        yield
    finally:
        _PHASE[0] = before


@dataclass
class _Group:
    nodes: list  # intermediates, latest first
    params: list[torch.Tensor]
    grads: dict = field(default_factory=dict)  # node -> the gradients recorded arriving at it


@dataclass
class Deferred:
    """What ``B`` leaves for ``W``: the groups to restart from, or (``whole``) the whole backward to run."""

    groups: list[_Group]
    whole: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (output, its gradient): W runs from there
    inputs: list[torch.Tensor] | None = None  # with ``whole``: the weights W asks for (None: every leaf)


def _children(node) -> list:
    return [n for n, _ in node.next_functions if n is not None]


def _graph(root) -> tuple[list, dict]:
    """The nodes reachable from ``root``, each after every node that feeds it (children before their parent, as
    backward runs them the other way), and each node's children."""
    kids = {root: _children(root)}
    order, stack = [], [(root, iter(kids[root]))]
    while stack:
        node, it = stack[-1]
        child = next(it, None)
        if child is None:
            stack.pop()
            order.append(node)
        elif child not in kids:
            kids[child] = _children(child)
            stack.append((child, iter(kids[child])))
    return order, kids


def _plan(root, target) -> list[_Group] | None:
    """The restarts below ``root`` for input node ``target``, latest first (each a group of intermediates or a level
    of groups, merged); None when a weight would be counted twice."""
    order, kids = _graph(root)
    in_d, depth = {}, {}
    for node in order:  # children first: a node leads to the input if it is it or a child does
        below = [depth[c] for c in kids[node] if in_d[c]]
        in_d[node] = node is target or bool(below)
        if in_d[node]:
            depth[node] = 1 + max(below) if below else 0
    parent = {}

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    owner: dict = {}  # node off D -> the intermediate that reached it first
    inter = [n for n in order if in_d[n] and any(not in_d[c] for c in kids[n])]
    for n in inter:
        parent[n] = n
        stack = [c for c in kids[n] if not in_d[c]]
        while stack:
            c = stack.pop()
            if c in owner:
                a, b = find(owner[c]), find(n)
                if a is not b:
                    parent[a] = b
                continue
            owner[c] = n
            stack += kids[c]
    members: dict = {}
    for n in inter:
        members.setdefault(find(n), []).append(n)
    params: dict = {}
    for c, n in owner.items():
        if hasattr(c, "variable"):
            params.setdefault(find(n), []).append(c.variable)
    rank = {n: i for i, n in enumerate(order)}
    restarts: dict = {}  # a depth (or a group spanning several) -> one restart
    for key, nodes in members.items():
        levels = {depth[n] for n in nodes}
        if len(levels) > 1 and _nested(nodes, in_d, kids):
            return None
        r = restarts.setdefault(levels.pop() if len(levels) == 1 else key, _Group([], []))
        r.nodes += nodes
        r.params += params.get(key, [])
    out = list(restarts.values())
    for r in out:
        r.nodes.sort(key=rank.get, reverse=True)
    out.sort(key=lambda r: rank[r.nodes[0]], reverse=True)
    return out


def _nested(nodes: list, in_d: dict, kids: dict) -> bool:
    """Whether one of ``nodes`` lies below another inside ``D``."""
    others = set(nodes)
    for top in nodes:
        seen, stack = {top}, [c for c in kids[top] if in_d[c]]
        while stack:
            c = stack.pop()
            if c in others:
                return True
            if c not in seen:
                seen.add(c)
                stack += [g for g in kids[c] if in_d[g]]
    return False


def backward_input(
    output: torch.Tensor | GradientEdge, grad: torch.Tensor | None, inp: torch.Tensor | None
) -> Deferred:
    """``B``: ``inp.grad`` from ``output``'s gradient ``grad`` (None: ``output`` is the loss; ``output`` may be its
    :class:`GradientEdge`); returns what ``W`` needs."""
    root = output.node if isinstance(output, GradientEdge) else output.grad_fn  # (a stage's output: its edge)
    if inp is None or root is None:
        return Deferred([], whole=(output, grad))
    groups = _plan(root, get_gradient_edge(inp).node)
    if groups is None:  # a weight reached twice along the input's path: W runs from the output again
        with _in_phase("input"):
            torch.autograd.backward(output, grad, inputs=[inp], retain_graph=True)
        params = [n.variable for n in _graph(root)[0] if hasattr(n, "variable") and n.variable is not inp]
        return Deferred([], whole=(output, grad), inputs=params)
    handles = []
    for g in groups:
        for node in g.nodes:
            handles.append(node.register_prehook(_recorder(g.grads, node)))
    try:
        with _in_phase("input"):
            torch.autograd.backward(output, grad, inputs=[inp], retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return Deferred(groups)


def _recorder(store: dict, node):
    def hook(grad_outputs):
        store[node] = grad_outputs

    return hook


def backward_weight(deferred: Deferred) -> None:
    """``W``: every weight's gradient accumulated into ``.grad`` (through autograd, hooks included)."""
    if deferred.whole is not None:
        if deferred.inputs is None:
            torch.autograd.backward(*deferred.whole)
        elif deferred.inputs:
            with _in_phase("weight"):
                torch.autograd.backward(*deferred.whole, inputs=deferred.inputs)
        return
    with _in_phase("weight"):
        for g in deferred.groups:
            edges, grads = [], []
            for node in g.nodes:
                for k, dy in enumerate(g.grads.get(node, ())):
                    if dy is not None:
                        edges.append(GradientEdge(node, k))
                        grads.append(dy)
            if edges and g.params:
                torch.autograd.backward(edges, grads, inputs=g.params)
            g.grads.clear()
