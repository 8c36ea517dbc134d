"""Tensor- and expert-parallel serving: rank 0 schedules and samples, every rank runs each model call.

``trickles serve CKPT --nproc N --tp T --ep E`` starts ``N = T x E`` ranks (tensor parallel over ``T``, the experts
of mixture-of-experts blocks split over ``E``: :func:`trickles.parallel.plan.parallelize`). Rank 0 runs the HTTP
front and the continuous-batching :class:`~trickles.infer.engine.Engine`; it alone decides admissions, block tables,
preemption and the prefix cache, and alone samples. The other ranks hold their shard of the model and a
:class:`~trickles.infer.paged.BlockPool` of the same number of blocks (their shard of the key/value heads), and make
every model call rank 0 makes, with the same inputs, so the collectives inside the model pair up.

**The protocol** (:class:`Leader` on rank 0, :func:`follow` on the others), over a gloo group of every rank of its
own (CPU tensors, also beside NCCL on GPUs; its timeout is long, since a follower waits there while the server is
idle), by ``torch.distributed.broadcast`` from rank 0 of ``int64`` tensors, two per message (no pickling, unlike
``broadcast_object_list``):

* a header of 4 values (32 bytes): ``(kind, a, b, c)``. ``HELLO`` before the first call, ``(HELLO, blocks,
  block_size, 0)``: the pool to build. ``LAST`` / ``EVERY``, ``(kind, B, T, W)``: a model call of ``B`` rows of
  ``T`` tokens whose longest block table has ``W`` blocks. ``STOP``: the server is shutting down, the follower returns;
* for a call, a body of ``B * (W + 2 + T)`` values (``8 * B * (W + T + 2)`` bytes): the block tables padded to
  ``W`` with :data:`PAD` (:data:`~trickles.infer.paged.FREED` entries as they are), the cached positions ``[B]``,
  the new counts ``[B]`` and the tokens ``[B, T]`` -- what :class:`~trickles.infer.paged.PagedCall` is built from.
  A decode step of 32 sequences of 8 blocks sends 2,816 bytes; a prefill chunk of 256 tokens about 2 KB. With LoRA
  adapters (``--lora``: every rank holds a bank of its parts of them, :mod:`trickles.adapters.multi`) the body ends
  with each row's slot ``[B]`` (-1: the base) and which adapter each of the ``S`` slots holds ``[S]`` (-1: none), rank
  0's choices, which the followers' banks mirror: ``8 (B + S)`` bytes more.

Every rank then runs the model on the call and gathers the vocabulary shards of the output projection (it is
column-parallel: ``logits_fn``, an all-gather over the tensor-parallel group) for the last position of each row
(``LAST``), or for every position (``EVERY``: a row of the call wants its prompt's log-probabilities), so rank 0
samples from the full vocabulary. Followers drop their copy.

**Failures** never hang the server. Any exception in a model call, on any rank, is fatal (the ranks could no longer
agree on the pool's contents): a follower writes one line on stderr naming its rank, the call and the error, and
exits with status 1; rank 0, whose collective then fails or waits, gives the launcher (:mod:`trickles.launch`, which
watches every rank and stops them all when one ends) :data:`FATAL_GRACE_S` to report the rank that failed first,
then writes its own line and exits with status 1. A rank stuck inside a collective is ended by its watchdog
(:mod:`trickles.watchdog`, ``parallel.timeout_s``); a rank killed outright is seen by the launcher at once.

Injected faults (tests): ``TRICKLES_FAIL_SERVING=K`` makes every follower raise before its ``K``-th model call, and
``TRICKLES_FAIL_SERVING=PATH`` before its first call once the file ``PATH`` exists; with ``:kill`` after either, the
follower kills itself (SIGKILL) there instead.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..config import Config
from ..errors import EXIT_ERROR, ConfigError, UserError
from ..models.transformer import Transformer
from ..parallel.plan import parallelize
from ..process import env_world_size, exit_process
from .paged import BlockPool, PagedCall

__all__ = ["Leader", "follow", "shard", "control_group", "serving_config", "FAULT_ENV"]

HELLO, LAST, EVERY, STOP = 3, 1, 2, 0  #: header kinds
PAD = -2  #: a block table entry past the end of its row's table
IDLE_TIMEOUT = datetime.timedelta(days=365)  #: the control group's timeout: a follower waits there while idle
FATAL_GRACE_S = 5.0  #: after a failed call, how long rank 0 leaves the launcher to stop it and name the cause
FAULT_ENV = "TRICKLES_FAIL_SERVING"  #: injected faults (tests): see the module's notes


def serving_config(checkpoint: str, context: int, nproc: int | None, tp: int, ep: int, device: str, refused=()):
    """None for one process; else ``(world, dims, cfg)`` for serving ``checkpoint`` (resolved, or a Hugging Face
    directory) of ``context`` positions on ``nproc`` ranks (None: ``tp x ep``, or torchrun's ranks), ``tp`` x ``ep``
    (the experts split over the ``ep`` replicas of the rest). Checked before any process group exists: every mistake,
    and any of the flags ``refused`` (given, and not served on several ranks yet), a one-line UserError."""
    for flag, value in (("--nproc", nproc), ("--tp", tp), ("--ep", ep)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    torchrun = env_world_size() > 1
    if nproc is not None and torchrun:
        raise UserError("--nproc starts local ranks itself; under torchrun leave it out (its --nproc-per-node decides)")
    world = env_world_size() if torchrun else nproc or tp * ep
    if world == 1 and tp * ep == 1:
        return None
    if refused:
        it = "it" if len(refused) == 1 else "them"
        raise UserError(
            f"{' and '.join(refused)} cannot serve on several ranks yet: drop {it} or serve from one process"
        )
    if world != tp * ep:
        ranks = f"torchrun's {world} ranks" if torchrun else f"--nproc {world}"
        raise UserError(
            f"{ranks} must be --tp x --ep = {tp} x {ep} = {tp * ep}: every rank serves its own part of the model (no "
            "data-parallel copies)"
        )
    layout = [f"parallel.tp={tp}", f"parallel.ep={ep}", f"parallel.dp={ep}", "parallel.sequence_parallel=false"]
    try:
        cfg = Config.load(None, [f"train.init_from={checkpoint}", f"data.seq_len={context}", *layout])
        cfg.train.device = device
        dims = cfg.validate(world)
    except ConfigError as e:
        raise UserError(re.sub(r"parallel\.(tp|ep)", r"--\1", str(e))) from None
    if cfg.model.moe_experts and cfg.model.moe_router == "hard":
        raise UserError(
            "this model routes its experts by label (model.moe_router=hard); trickles serve has no label field yet: "
            "use trickles generate --label L"
        )
    return world, dims, cfg


def control_group():
    """The gloo group of every rank that carries the calls (collective: every rank calls it once)."""
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def shard(full: Transformer, topo, cfg) -> tuple[torch.nn.Module, Callable]:
    """``(model, logits_fn)``: this rank's part of ``full`` (a whole model, loaded) on ``topo``'s layout as ``cfg``
    (its ``parallel`` and ``memory`` sections) says, in eval mode without gradients; ``logits_fn`` gathers its output's
    vocabulary shards (identity without tensor parallelism)."""
    with torch.device("meta"):
        net = Transformer(full.cfg)
    state = full.state_dict()
    engine = parallelize(net, topo, cfg, 0, init=lambda name, p: state[name])
    model, logits_fn = engine.model, engine.full_logits
    del engine  # (the training engine's gradient buffer and optimizer go with it)
    dtype = next(full.parameters()).dtype
    with torch.no_grad():
        for p in model.parameters():
            p.grad = None
            p.requires_grad_(False)
            if p.dtype != dtype and p.is_floating_point():
                p.data = p.data.to(dtype)
        for name, b in model.named_buffers():  # persistent buffers (a router's bias) are whole on every rank
            if name in state and state[name].shape == b.shape:
                b.copy_(state[name])
    return model.eval(), logits_fn


def _pack(tables, cached, new, tokens: torch.Tensor, every: bool, bank=None) -> tuple[torch.Tensor, torch.Tensor]:
    b, t = tokens.shape
    w = max(len(row) for row in tables)
    padded = [list(row) + [PAD] * (w - len(row)) for row in tables]
    header = torch.tensor([EVERY if every else LAST, b, t, w], dtype=torch.int64)
    body = torch.cat(
        [
            torch.tensor(padded, dtype=torch.int64).reshape(-1),
            torch.tensor([*cached, *new], dtype=torch.int64),
            tokens.detach().to("cpu", torch.int64).reshape(-1),
            torch.tensor(_adapters(bank), dtype=torch.int64),
        ]
    )
    return header, body


def _adapters(bank) -> list[int]:
    """The LoRA part of a call's body: each row's slot (-1: the base), then what each slot holds (-1: nothing)."""
    if bank is None:
        return []
    return [-1 if s is None else s for s in bank.selected] + bank.residency()


def _unpack(b: int, t: int, w: int, body: torch.Tensor, bank=None):
    rows = body[: b * w].view(b, w).tolist()
    tables = [[x for x in row if x != PAD] for row in rows]
    counts = body[b * w : b * w + 2 * b].tolist()
    end = b * (w + 2 + t)
    if bank is not None:  # rank 0's slots: the same adapters in the same slots here, the same rows selected
        extra = body[end:].tolist()
        bank.mirror(extra[b:])
        bank.select([None if s < 0 else s for s in extra[:b]])
    return tables, counts[:b], counts[b:], body[b * w + 2 * b : end].view(b, t)


def _run(model, logits_fn, call: PagedCall, tokens: torch.Tensor, every: bool) -> torch.Tensor:
    out = model(tokens, cache=call, start=call.start, positions=call.positions, pad_mask=call.pad_mask)
    return logits_fn(out if every else out[:, -1:])


def _where(e: BaseException) -> str:
    """``Type: message (file:line)`` of ``e``, where it was raised."""
    frames = traceback.extract_tb(e.__traceback__)
    at = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {e}{at}"


class Leader:
    """Rank 0's side: ``forward(call, tokens, every)`` is the engine's model call (``Engine(forward=...)``), sent to
    every rank before it runs here (the first one preceded by ``HELLO`` with its pool's size); ``stop()`` releases the
    followers. ``bank``: the LoRA adapters' bank the engine selects rows in (None: none)."""

    def __init__(self, model, logits_fn, group, bank=None):
        self.model, self.logits_fn, self.group, self.bank = model, logits_fn, group, bank
        self.calls, self.failed, self.pool = 0, False, None

    def _send(self, *tensors: torch.Tensor) -> None:
        for x in tensors:
            dist.broadcast(x, 0, group=self.group)

    def forward(self, call: PagedCall, tokens: torch.Tensor, every: bool) -> torch.Tensor:
        """The full-vocabulary logits ``[B, 1 or T, V]`` of the call (every position's with ``every``)."""
        try:
            if self.pool is None:
                self.pool = call.pool
                self._send(torch.tensor([HELLO, call.pool.num_blocks, call.pool.block_size, 0], dtype=torch.int64))
            elif call.pool is not self.pool:
                raise RuntimeError("every call of a served model must use the one pool the other ranks mirror")
            self.calls += 1
            self._send(*_pack(*call.inputs, tokens, every, self.bank))
            return _run(self.model, self.logits_fn, call, tokens, every)
        except Exception as e:  # noqa: BLE001 -- the ranks no longer agree: the server stops (module notes)
            self.failed = True
            time.sleep(FATAL_GRACE_S)  # the launcher stops this rank first when a peer ended: it names that one
            line = f"[trickles] serving stopped: model call {self.calls} failed on rank 0 ({_where(e)})\n"
            os.write(2, line.encode())
            exit_process(EXIT_ERROR)

    def stop(self) -> None:
        """Tells the followers the server is done (they return from :func:`follow`)."""
        if not self.failed:
            self._send(torch.tensor([STOP, 0, 0, 0], dtype=torch.int64))


def _fault() -> tuple[int | str, str] | None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    when, kill = (spec[: -len(":kill")], "kill") if spec.endswith(":kill") else (spec, "raise")
    return (int(when) if when.isdigit() else when), kill


def _strike(fault: tuple[int | str, str] | None, calls: int) -> None:
    """Raises, or kills this process, where ``TRICKLES_FAIL_SERVING`` says (the module's notes)."""
    if fault is None or not (calls == fault[0] if isinstance(fault[0], int) else os.path.exists(fault[0])):
        return
    if fault[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault ({FAULT_ENV})")


def follow(model, logits_fn, group, rank: int, bank=None) -> int:
    """A follower's loop (see the module's notes): builds its pool on ``HELLO``, makes every call rank 0 sends, returns
    the number of calls made on ``STOP``; ``bank``: its LoRA adapters' bank, mirroring rank 0's. A failed call ends
    this process: one line on stderr, status 1."""
    header, pool = torch.empty(4, dtype=torch.int64), None
    device = next(model.parameters()).device
    fault, calls = _fault(), 0
    model.eval()
    with torch.no_grad():
        while True:
            dist.broadcast(header, 0, group=group)
            kind, b, t, w = header.tolist()
            if kind == STOP:
                return calls
            if kind == HELLO:
                pool = BlockPool(model, b, t, device=device)  # (blocks, block size)
                continue
            body = torch.empty(b * (w + 2 + t) + (0 if bank is None else b + bank.max_loras), dtype=torch.int64)
            dist.broadcast(body, 0, group=group)
            calls += 1
            try:
                _strike(fault, calls)
                tables, cached, new, tokens = _unpack(b, t, w, body, bank)
                call = PagedCall(pool, tables, cached, new)
                _run(model, logits_fn, call, tokens.to(device), kind == EVERY)
            except Exception as e:  # noqa: BLE001 -- one line, and the launcher stops the others
                sys.stdout.flush()
                line = f"[trickles] rank {rank}: model call {calls} failed ({_where(e)}); stopping the server\n"
                os.write(2, line.encode())
                exit_process(EXIT_ERROR)
