"""What each step of ``gpu_check.py`` reports: its numbers, read from the JSON the step's benchmark wrote (or from the
output: pytest's summary, the trainer's ``metrics.jsonl``), as a headline for the table and a detail table.

Each reader takes the run's :class:`Ctx` and the step's output and returns ``{"headline": str, "numbers": dict,
"header": [...], "rows": [[...]]}``; a reader that fails (the step died before writing its file) is caught by the
caller, which records why.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Ctx:
    """What every step's command and summary read: the mode, a scratch directory and the Python to run."""

    cuda: bool
    work: str
    python: str = sys.executable


def out(ctx: Ctx, name: str) -> str:
    """A file or directory of the run's scratch space."""
    return os.path.join(ctx.work, name)


# ---- readers --------------------------------------------------------------------------------------------------------


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def ratio(a, b) -> str:
    return f"{a / b:.3f}x" if a is not None and b else "-"


def ms(seconds) -> str:
    return f"{seconds * 1e3:.2f}" if seconds is not None else "-"


def pytest_summary(ctx: Ctx, output: str) -> dict:
    """Counts from pytest's last line (run, or collected), and the names of the failed tests; without either, no
    numbers (it raises)."""
    counts = {
        k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", output)
    }
    collected = re.search(r"(\d+)(?:/\d+)? tests? collected", output)
    if collected:
        counts["collected"] = int(collected.group(1))
    failed = re.findall(r"^FAILED (\S+)", output, re.M)[:10]
    if not counts and not failed:
        raise ValueError("no pytest summary line in the output")
    headline = ", ".join(f"{n} {k}" for k, n in counts.items())
    return {
        "headline": headline + (" (collected only: no CUDA)" if not ctx.cuda else ""),
        "numbers": {**counts, "failed_tests": failed},
        "header": ["failed test"],
        "rows": [[f] for f in failed],
    }


def kernels_summary(ctx: Ctx, output: str) -> dict:
    """Per kernel: ours (Triton; the chunked PyTorch cross-entropy where Triton does not run) against eager, compile
    and liger, and the peaks; the headline adds the fused cross-entropy's time and peak."""
    doc = load(out(ctx, "kernels.json"))
    rows, heads, loss = [], [], ""
    for kernel, r in doc["results"].items():
        c = r["contestants"]
        mine = "ours-triton" if "ours-triton" in c else ("ours-chunked" if "ours-chunked" in c else None)
        med = {n: v["median"] for n, v in c.items()}
        peak = {n: v["peak_bytes"] / 2**20 for n, v in c.items()}
        m = med.get(mine)
        rows.append(
            [
                kernel,
                mine or "-",
                ms(m),
                ratio(m, med.get("eager")),
                ratio(m, med.get("compile")),
                ratio(m, med.get("liger")),
                f"{peak[mine]:.0f}" if mine else "-",
                f"{peak['eager']:.0f}",
                f"{peak['liger']:.0f}" if "liger" in peak else "-",
            ]
        )
        if mine:
            heads.append(f"{kernel} {ratio(m, med.get('eager'))}")
        if mine and kernel == "cross_entropy":
            loss = f"; cross-entropy ({mine}) {ms(m)} ms, peak {peak[mine]:.0f} MiB (eager {peak['eager']:.0f})"
    liger = doc.get("liger_kernel", "-")
    measured = measured_rows(doc) if ctx.cuda else ""
    if measured:
        print(
            "rows for trickles.kernels.MEASURED (what model.kernels=auto reads; docs/kernels.md shows them):\n"
            + measured
        )
    return {
        "headline": f"ours/eager: {', '.join(heads) or '-'}{loss}; "
        + (f"liger-kernel {liger}" if liger != "-" else "liger did not run"),
        "numbers": {**doc["results"], "MEASURED rows": measured},
        "header": [
            "kernel",
            "ours",
            "ours ms",
            "/ eager",
            "/ compile",
            "/ liger",
            "ours peak MiB",
            "eager peak MiB",
            "liger peak MiB",
        ],
        "rows": rows,
    }


def measured_rows(doc: dict) -> str:
    """``benchmarks/kernels.py``'s JSON as the entries of ``trickles.kernels.MEASURED``: each kernel whose Triton
    version, eager and compile contestants all ran, in milliseconds, with the device, software and date."""
    import datetime

    import triton

    where = (
        f"{doc['device_name']}, torch {doc['torch'].split('+')[0]}, Triton {triton.__version__}, "
        f"{datetime.date.today().isoformat()}"
    )
    lines = []
    for kernel, r in doc["results"].items():
        med = {n: v["median"] * 1e3 for n, v in r["contestants"].items()}
        if not {"ours-triton", "eager", "compile"} <= med.keys():
            continue
        liger = f"{med['liger']:.4f}" if "liger" in med else "None"
        lines.append(
            f'    "{kernel}": Measured({med["ours-triton"]:.4f}, {med["eager"]:.4f}, {med["compile"]:.4f}, '
            f'{liger}, "{where}"),'
        )
    return "\n".join(lines)


def single_summary(name: str) -> Callable[[Ctx, str], dict]:
    def summary(ctx: Ctx, output: str) -> dict:
        doc = load(out(ctx, name))
        check = doc["check"]
        if not doc.get("results"):
            return {
                "headline": f"agreement check failed: fp32 logits {check['logits_fp32_rel_diff']:.1e}, "
                f"loss {max(check['loss_rel_diff']):.1e}",
                "numbers": check,
                "header": [],
                "rows": [],
            }
        res = doc["results"]
        rows = [
            [
                n,
                ms(r["median"]),
                f"{r['tokens_per_s']:,.0f}",
                f"{r['mfu']:.1%}" if r.get("mfu") else "-",
                ratio(r["median"], res["hf-llama"]["median"]),
                f"{r['paired_ratio']:.3f}x",
                f"{r['step_alloc_bytes'] / 2**30:.1f}" if r.get("step_alloc_bytes") else "-",
            ]
            for n, r in res.items()
        ]
        heads = [
            f"{n} {ratio(r['median'], res['hf-llama']['median'])} HF"
            + (f", MFU {r['mfu']:.1%}" if r.get("mfu") else "")
            for n, r in res.items()
            if n != "hf-llama"
        ]
        return {
            "headline": "; ".join(heads) + f" (agreement: fp32 logits {check['logits_fp32_rel_diff']:.1e}, "
            f"loss {max(check['loss_rel_diff']):.1e})",
            "numbers": {
                "check": check,
                "results": {n: {k: v for k, v in r.items() if k != "times"} for n, r in res.items()},
            },
            "header": ["model", "median ms", "tokens/s", "MFU", "vs HF", "paired", "step GiB"],
            "rows": rows,
        }

    return summary


def train_summary(name: str) -> Callable[[Ctx, str], dict]:
    """tokens/s, MFU and step time from the run's ``metrics.jsonl``: step 1 (which compiles) apart, the median of the
    others."""

    def summary(ctx: Ctx, output: str) -> dict:
        with open(os.path.join(out(ctx, name), "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
        later = records[1:] or records
        tps = statistics.median(r["tokens_per_s"] for r in later)
        mfus = [r["mfu"] for r in later if r.get("mfu") is not None]
        mfu = statistics.median(mfus) if mfus else None
        step = statistics.median(r["step_time"] for r in later)
        rows = [
            [
                r["step"],
                f"{r['loss']:.4f}",
                f"{r['step_time'] * 1e3:.0f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-",
            ]
            for r in records
        ]
        return {
            "headline": f"{tps:,.0f} tokens/s, MFU {f'{mfu:.1%}' if mfu is not None else '-'}, "
            f"{step * 1e3:.0f} ms a step (median of steps 2-{len(records)}); step 1 {records[0]['step_time']:.1f} s",
            "numbers": {
                "tokens_per_s": tps,
                "mfu": mfu,
                "step_time": step,
                "first_step_time": records[0]["step_time"],
                "steps": len(records),
            },
            "header": ["step", "loss", "ms", "tokens/s", "MFU"],
            "rows": rows,
        }

    return summary


def inference_summary(ctx: Ctx, output: str) -> dict:
    res = load(out(ctx, "inference.json"))["results"]
    tps = {n: r["tokens_per_s"] for n, r in res.items()}
    acc = tps.get("accelerate offload")
    peer = (re.search(r"\(b\) peer: (.*)", output) or [None, "-"])[1]
    head = f"resident {ratio(tps['ours resident'], tps['HF generate'])} HF's tokens/s; streamed " + (
        f"{ratio(tps['ours streamed'], acc)} accelerate's" if acc else f"alone ({peer.split(chr(59))[0]})"
    )
    return {
        "headline": head,
        "numbers": tps,
        "header": ["contestant", "median ms", "tokens/s"],
        "rows": [[n, ms(r["median"]), f"{r['tokens_per_s']:.1f}"] for n, r in res.items()],
    }


def quantization_summary(ctx: Ctx, output: str) -> dict:
    res = load(os.path.join(out(ctx, "quantization"), "quantization.json"))["results"]
    return {
        "headline": ", ".join(f"{n} {r['speed_vs_bf16']:.2f}x" for n, r in res.items() if n.startswith("int8"))
        + " bf16's tokens/s",
        "numbers": {n: {k: v for k, v in r.items() if k != "times"} for n, r in res.items()},
        "header": ["model", "tokens/s", "vs bf16", "greedy = fp32"],
        "rows": [
            [n, f"{r['tokens_per_s']:.1f}", f"{r['speed_vs_bf16']:.2f}x", f"{r['greedy_agreement']:.0%}"]
            for n, r in res.items()
        ],
    }


def compared_rows(res: dict) -> list[list]:
    return [
        [
            n,
            ms(r["median"]),
            r.get("peer") or "-",
            f"{r['ratio']:.3f}x" if r.get("ratio") else "-",
            f"{r['paired_ratio']:.3f}x" if r.get("paired_ratio") else "-",
        ]
        for n, r in res.items()
    ]


def moe_summary(ctx: Ctx, output: str) -> dict:
    res = load(out(ctx, "moe.json"))["single"]["results"]
    ours = [n for n, r in res.items() if r.get("peer")]
    return {
        "headline": "; ".join(f"{n}/{res[n]['peer']} {res[n]['ratio']:.3f}x" for n in ours),
        "numbers": {n: {k: v for k, v in r.items() if k != "times"} for n, r in res.items()},
        "header": ["implementation", "median ms", "peer", "vs peer", "paired"],
        "rows": compared_rows(res),
    }


def cp_summary(ctx: Ctx, output: str) -> dict:
    doc = load(out(ctx, "cp.json"))
    res, mem = doc["results"], doc["memory"]
    rows = [
        row + [f"{mem[n]['saved'] / 2**20:.0f}", f"{mem[n]['peak'] / 2**20:.0f}" if mem[n].get("peak") else "-"]
        for n, row in zip(res, compared_rows(res))
    ]
    return {
        "headline": "; ".join(f"{n}/{r['peer']} {r['ratio']:.3f}x" for n, r in res.items() if r.get("peer")),
        "numbers": {
            "results": {n: {k: v for k, v in r.items() if k != "times"} for n, r in res.items()},
            "memory": mem,
        },
        "header": ["implementation", "median ms", "peer", "vs peer", "paired", "saved MiB", "peak MiB"],
        "rows": rows,
    }


def documents_summary(ctx: Ctx, output: str) -> dict:
    doc = load(out(ctx, "documents.json"))
    rows = [[n, ms(doc["median_s"][n])] for n in doc["median_s"]]
    return {
        "headline": f"documents/causal {doc['ratio']:.3f}x (paired {doc['paired_ratio']:.3f}x), "
        f"{doc['documents']} documents in {doc['seq']} tokens, agreement {doc['agreement']:.1e}",
        "numbers": {k: doc[k] for k in ("ratio", "paired_ratio", "agreement", "median_s", "documents", "seq", "batch")},
        "header": ["attention", "median ms"],
        "rows": rows,
    }


def split_summary(ctx: Ctx, output: str) -> dict:
    doc = load(out(ctx, "split.json"))
    rows = [[n, ms(doc["median_s"][n])] for n in doc["median_s"]] + [
        ["split: B", ms(doc["b_s"])],
        ["split: W", ms(doc["w_s"])],
    ]
    return {
        "headline": f"split/whole {doc['ratio']:.3f}x (paired {doc['paired_ratio']:.3f}x), {doc['layers']} layers of "
        f"{doc['preset']}, {doc['restarts']} W restarts, agreement {doc['agreement']:.1e}",
        "numbers": {
            k: doc[k]
            for k in (
                "ratio",
                "paired_ratio",
                "agreement",
                "median_s",
                "b_s",
                "w_s",
                "restarts",
                "layers",
                "seq",
                "batch",
            )
        },
        "header": ["backward", "median ms"],
        "rows": rows,
    }


def decoding_summary(ctx: Ctx, output: str) -> dict:
    doc = load(out(ctx, "decoding.json"))
    agree = {k: {s: v.count(s) for s in ("equal", "tie", "differ")} for k, v in doc["agreement"].items()}
    rows = [
        [
            n,
            ms(doc["median_s"][n]),
            f"{doc['new_tokens_per_s'][n]:.0f}",
            f"{doc['ours_over_hf'][n]:.3f}x" if n in doc["ours_over_hf"] else "-",
        ]
        for n in doc["median_s"]
    ]
    return {
        "headline": ", ".join(f"{n}/HF {v:.3f}x" for n, v in doc["ours_over_hf"].items())
        + "; rows "
        + ", ".join(f"{k} {v['equal']} equal {v['tie']} tie" for k, v in agree.items()),
        "numbers": {
            "ours_over_hf": doc["ours_over_hf"],
            "new_tokens_per_s": doc["new_tokens_per_s"],
            "agreement": agree,
        },
        "header": ["contestant", "median ms", "new tokens/s", "ours/HF"],
        "rows": rows,
    }


def serving_summary(ctx: Ctx, output: str) -> dict:
    doc = load(out(ctx, "serving.json"))
    rows = [
        [
            n,
            f"{r['tokens_per_s']:.0f}",
            ms(r["ttft_p50"]),
            ms(r["ttft_p99"]),
            ms(r["latency_p99"]),
            f"{r['answered']}/{r['sent']}",
        ]
        for n, r in doc["results"].items()
    ]
    return {
        "headline": ", ".join(f"{k} {v:.2f}x" for k, v in doc["ratios"].items()),
        "numbers": {"ratios": doc["ratios"], "results": doc["results"]},
        "header": ["contestant", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "latency p99 ms", "answered"],
        "rows": rows,
    }
