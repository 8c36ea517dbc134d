"""Checkpoint stall: how long training is blocked by a save -- our asynchronous save, our synchronous one, and
``torch.distributed.checkpoint.async_save`` of the same state -- on one process.

What is compared
    One trainer (``--layers`` blocks of width ``--d-model``, AdamW), after a training step, saves its checkpoint
    (the model and the optimizer state: what ``trickles train`` writes) three ways:

    * ``ours-async`` (``train.async_checkpoint``): the snapshot -- the rank's tensors copied to host memory, the
      RNG states -- on the training thread, the files written by a background thread while ``--steps-between``
      training steps run; the next save (here: :meth:`Saver.settle` after those steps) waits for it if it is not done;
    * ``ours-sync``: the same save written on the training thread;
    * ``dcp-async``: ``torch.distributed.checkpoint.async_save`` of the same tensors (staged to the host by DCP, written
      by its executor) while the same steps run, then its future waited for.

    **blocked** is the training thread's time inside the save calls plus the wait at the end (a contestant's clock
    stops only when everything its save started has finished: the wait joins it), the save call's share shown apart
    (the rest is waiting for a write that outlasted the steps between); **copy** the host copy alone
    (:func:`trickles.train.saver.host_copy`); **write** the whole save's wall time when nothing else runs (sync).

Claims (CPU, a checkpoint that takes seconds to write): ours-async blocks at most about the copy time and at least
5x less than ours-sync, and no more than DCP's async save.

Examples::

    python benchmarks/checkpoint_stall.py                       # 12 x 768, about 1.1 GB written a save
    python benchmarks/checkpoint_stall.py --layers 2 --d-model 64 --rounds 1   # the suite's smoke run
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import device_name, one_device, rotations, table, write_json  # noqa: E402

from trickles.config import Config  # noqa: E402
from trickles.topology import ParallelDims  # noqa: E402
from trickles.train.saver import host_copy  # noqa: E402
from trickles.train.trainer import Trainer  # noqa: E402

NAMES = ["ours-async", "ours-sync", "dcp-async"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps-between", type=int, default=2, help="training steps run while a background save writes")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch.distributed.checkpoint as dcp

    device = one_device("cpu", threads=2)
    root = Path(args.dir or tempfile.mkdtemp(prefix="trickles_stall_"))
    cfg = Config.load(
        None,
        [
            "model.preset=tiny",
            f"model.n_layers={args.layers}",
            f"model.d_model={args.d_model}",
            f"model.n_heads={max(1, args.d_model // 64)}",
            f"model.n_kv_heads={max(1, args.d_model // 64)}",
            f"model.ffn_hidden={4 * args.d_model}",
            "data.seq_len=32",
            "data.max_bytes=120000",
            f"data.cache_dir={root}/cache",
            "train.global_batch=2",
            "train.steps=1000000",
            "train.eval_every=0",
            "train.sample_tokens=0",
            "train.plot=false",
            f"train.out_dir={root}/run",
            "train.keep_checkpoints=1",
        ],
    )
    tr = Trainer(cfg, ParallelDims().build(device), quiet=True)
    tr.train_step()
    files = tr.engine.checkpoint_files(0)
    nbytes = sum(t.numel() * t.element_size() for f in files.values() for t, _ in f.values())

    def between():
        for _ in range(args.steps_between):
            tr.train_step()

    def save(name: str) -> float:
        """The training thread's blocked seconds of one save by ``name`` (the steps between are not counted); the
        save call's own share is appended to ``calls``."""
        if name == "dcp-async":
            state = {
                f"{f}/{k}": t for f, tensors in tr.engine.checkpoint_files(0).items() for k, (t, _) in tensors.items()
            }
            target = root / "dcp"
            shutil.rmtree(target, ignore_errors=True)
            t0 = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=str(target))
            blocked = time.perf_counter() - t0
            calls[name].append(blocked)
            between()
            t0 = time.perf_counter()
            future.result()
            return blocked + time.perf_counter() - t0
        tr.saver.background = name == "ours-async"
        t0 = time.perf_counter()
        tr.save_checkpoint(wait=False)
        blocked = time.perf_counter() - t0
        calls[name].append(blocked)
        between()
        t0 = time.perf_counter()
        tr.saver.settle()
        return blocked + time.perf_counter() - t0

    blocked: dict[str, list[float]] = {n: [] for n in NAMES}
    calls: dict[str, list[float]] = {n: [] for n in NAMES}  # the save call alone (the rest: waiting at the end)
    copies = []
    for _, name in rotations(NAMES, args.rounds):
        blocked[name].append(save(name))
        t0 = time.perf_counter()
        host_copy(tr.engine.checkpoint_files(0), device)
        copies.append(time.perf_counter() - t0)
    med = {n: statistics.median(v) for n, v in blocked.items()}
    copy = statistics.median(copies)
    print(
        f"checkpoint stall on {device_name(device)}: {args.layers} x {args.d_model}, {nbytes / 2**20:.0f} MiB of "
        f"tensors a save, {args.rounds} rounds, {args.steps_between} steps between"
    )
    call = {n: statistics.median(v) for n, v in calls.items()}
    rows = [
        [n, f"{med[n] * 1e3:.1f} ms", f"{call[n] * 1e3:.1f} ms", f"{med[n] / med['ours-async']:.2f}x"] for n in NAMES
    ]
    rows.append(["host copy alone", f"{copy * 1e3:.1f} ms", "", f"{copy / med['ours-async']:.2f}x"])
    print(table(["contestant", "blocked (median)", "in the save call", "vs ours-async"], rows))
    verdict = {
        "async_within_copy": med["ours-async"] <= 1.5 * copy,
        "sync_over_async": med["ours-sync"] / med["ours-async"],
        "dcp_over_async": med["dcp-async"] / med["ours-async"],
    }
    print(
        f"ours-async blocks {med['ours-async'] / copy:.2f}x the host copy; ours-sync blocks "
        f"{verdict['sync_over_async']:.1f}x as long (target >= 5x); DCP's async save {verdict['dcp_over_async']:.2f}x "
        f"(target >= 1)"
    )
    doc = {
        "bytes": nbytes,
        "blocked_s": blocked,
        "call_s": calls,
        "copy_s": copies,
        "median": med,
        "copy": copy,
        "verdict": verdict,
        "args": vars(args),
    }
    write_json(args.json, doc)
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return doc


if __name__ == "__main__":
    main()
