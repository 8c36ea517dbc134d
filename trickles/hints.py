"""Start-up hints: a configuration that is valid but slow on this device, for a known reason.

:func:`slow_config_hints` is a pure function of the configuration, what the device can do
(:class:`DeviceFacts`), the number of ranks on this machine and its CPU cores; it returns one line
per known slowdown, each saying what to change:

* ``memory.precision=fp16`` on a CPU without fp16 matmul instructions (AVX512-FP16 or AMX-FP16):
  PyTorch emulates them: the demo's training step runs about 18x slower than in fp32 on the 2-core
  AVX-512 box the tests run on (issue 21), a lone 512 x 512 matmul about 30x;
* ``memory.precision=bf16`` on a CUDA GPU without native bf16 (compute capability below 8.0,
  i.e. before Ampere): emulated, or not available at all;
* more ranks on this machine than CPU cores it may use: the ranks time-slice the cores, and every
  collective waits for the rank the scheduler put to sleep.

:func:`warn_slow_config` gathers the facts for a built :class:`~trickles.topology.Topology` and
prints the lines once, on rank 0, to stderr (not again after a restart).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

#: The slowdown of fp16 against fp32 on a CPU without fp16 matmuls: the demo's training step on the
#: 2-core AVX-512 (no AVX512-FP16) test box, torch 2.13.
FP16_CPU_SLOWDOWN = 18


@dataclass(frozen=True)
class DeviceFacts:
    """What matters about a device for the hints: its kind and which low-precision matmuls it has natively."""

    kind: str  # "cpu" or "cuda"
    name: str = ""
    fp16_matmul: bool = True  # native fp16 matrix multiplies (CPU: AVX512-FP16 / AMX-FP16; CUDA: always)
    bf16_matmul: bool = True  # native bf16 matrix multiplies (CPU: AVX512-BF16 / AMX-BF16; CUDA: capability >= 8.0)


def slow_config_hints(cfg, device: DeviceFacts, local_ranks: int, cores: int) -> list[str]:
    """One ``warning: ...`` line per known reason this valid configuration runs slowly on ``device``.

    ``cfg`` is a :class:`~trickles.config.Config`; ``local_ranks`` the ranks on this machine
    (``--nproc``, or torchrun's ``--nproc-per-node``); ``cores`` the CPU cores this process may use.
    """
    hints = []
    precision = cfg.memory.precision
    if device.kind == "cpu" and precision == "fp16" and not device.fp16_matmul:
        instead = "bf16 or fp32" if device.bf16_matmul else "fp32"
        hints.append(
            f"warning: memory.precision=fp16 on this CPU runs ~{FP16_CPU_SLOWDOWN}x slower than fp32 "
            f"(no fp16 matmul instructions, so they are emulated); use memory.precision={instead} on CPU"
        )
    if device.kind == "cuda" and precision == "bf16" and not device.bf16_matmul:
        name = f" ({device.name})" if device.name else ""
        hints.append(
            f"warning: memory.precision=bf16 on a GPU without native bf16{name} is emulated and slow; "
            "use memory.precision=fp16 (with loss scaling) on this GPU, or a GPU of compute capability 8.0 or later"
        )
    if local_ranks > cores:
        hints.append(
            f"warning: {local_ranks} ranks on this machine share {cores} CPU core{'s' if cores != 1 else ''}, "
            f"so they take turns and every collective waits for the one not running; "
            f"start at most {cores} rank{'s' if cores != 1 else ''} per machine (--nproc / --nproc-per-node)"
        )
    return hints


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def device_facts(device) -> DeviceFacts:
    """The :class:`DeviceFacts` of a ``torch.device`` on this machine."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return DeviceFacts(
            "cuda", torch.cuda.get_device_name(device), fp16_matmul=True, bf16_matmul=(major, minor) >= (8, 0)
        )
    flags = _cpu_flags()
    if not flags:  # not Linux, or no flags to read: claim nothing we cannot see
        return DeviceFacts(device.type)
    return DeviceFacts(
        device.type,
        fp16_matmul=bool(flags & {"avx512_fp16", "amx_fp16"}),
        bf16_matmul=bool(flags & {"avx512_bf16", "amx_bf16"}),
    )


def warn_slow_config(cfg, topo, file=None) -> list[str]:
    """Prints :func:`slow_config_hints` for this rank's device on rank 0 (first attempt only); returns the lines."""
    from .process import cpu_cores, restart_count

    if not topo.is_main or restart_count() > 0:
        return []
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    lines = slow_config_hints(cfg, device_facts(topo.device), local_ranks, cpu_cores())
    for line in lines:
        print(line, file=file or sys.stderr, flush=True)
    return lines
