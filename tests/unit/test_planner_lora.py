"""The planner's step-time model of a LoRA run (``train.lora_rank > 0``, trickles/planner/compute_lora.py): the frozen
base computes its input gradients only, the adapters add their own products, the data-parallel reductions move the
adapters' gradients alone (ZeRO-3 still gathers the frozen base), the optimizer steps the adapters; MFU counts the
FLOPs the step needs."""

import contextlib
import json

import pytest
import torch
from helpers import cli_here
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from trickles.adapters.lora import apply_lora
from trickles.comm import wire_bytes
from trickles.config import Config
from trickles.models.config import resolve_model
from trickles.models.transformer import Transformer
from trickles.planner import load_cluster, step_time
from trickles.planner.compute import chunk_work
from trickles.planner.compute_lora import CORE, lora_chunk_work
from trickles.planner.rank_plan import rank_plans
from trickles.topology import ParallelDims
from trickles.train.flops import flops_per_token

SEQ, BATCH, VOCAB = 16, 2, 320
TINY = ["model.preset=tiny", f"data.seq_len={SEQ}", f"train.global_batch={BATCH}", f"model.vocab_size={VOCAB}"]


def _counted_step(cfg: Config, math: bool) -> tuple[object, int]:
    """The model config and ``FlopCounterMode``'s count of one forward and backward of a real (LoRA) model; ``math``:
    SDPA's math path (its products counted) rather than the CPU's fused kernel (which the counter does not see)."""
    mc = resolve_model(cfg.model, VOCAB, SEQ)
    torch.manual_seed(0)
    model = Transformer(mc)
    if cfg.train.lora() is not None:
        apply_lora(model, cfg.train.lora())
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    kernel = sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext()
    with kernel, FlopCounterMode(display=False) as counter:
        model(x, target=x).backward()
    return mc, counter.get_total_flops()


@pytest.mark.parametrize(
    "sets, math",
    [
        ([], True),  # every projection adapted; the attention core counted through the math path
        (["model.fused_proj=true", "train.lora_targets=q_proj,v_proj,up_proj"], False),  # fused parts, k frozen
        (["train.lora_targets=down_proj"], False),  # no input gradient in the first block before its down projection
        (["train.lora_targets=o_proj,output", "train.lora_rank=2"], False),  # the output layer's adapter
        (["train.lora_base=int8"], False),
    ],
)
def test_planned_lora_flops_are_the_flop_counters(sets, math):
    """The planner's forward + backward products of one micro-batch at one process equal ``FlopCounterMode``'s count
    of a real LoRA step (the attention core, counted only on the math path, planned as every score), and MFU's
    per-token count is the same number."""
    cfg = Config.load(None, [*TINY, "train.lora_rank=4", *sets])
    mc, counted = _counted_step(cfg, math)
    layers = list(range(mc.n_layers))
    work = lora_chunk_work(mc, ParallelDims(), BATCH, SEQ, layers, True, False, 4, cfg.train.lora(), "materialized")
    planned = work.flops + work.backward_flops
    if not math:  # the CPU's fused kernel is invisible to the counter: compare the other products
        planned -= sum(g.flops + g.backward_flops for g in work.gemms if g.name in CORE)
    assert planned == counted
    total = work.flops + work.backward_flops
    assert flops_per_token(mc, SEQ, cfg.train.lora()) * BATCH * SEQ == pytest.approx(total, rel=1e-12)
    # full training of the same model: three times the forward, as the counter sees it
    full_mc, full = _counted_step(Config.load(None, TINY), True)
    plain = chunk_work(full_mc, ParallelDims(), BATCH, SEQ, layers, True, False, 4, "materialized")
    assert full == 3 * plain.flops and total < 0.8 * full


def test_the_data_parallel_bytes_are_the_adapters():
    """DDP all-reduces, and ZeRO-3 reduce-scatters, the adapters' gradients alone (the real model's trainable
    elements); ZeRO-3 also gathers the frozen base, twice a micro-step; the optimizer steps the adapters."""
    model_sets = [*TINY, "train.lora_rank=4", "model.fused_proj=false"]
    cfg = Config.load(None, [*model_sets, "parallel.dp=2", "parallel.bucket_mb=0"])
    dims = cfg.validate(2)
    mc = resolve_model(cfg.model, VOCAB, SEQ)
    with torch.device("meta"):
        model = Transformer(mc)
    apply_lora(model, cfg.train.lora())
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    per_block = (64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64)  # q, k and v, o, gate and up, down
    assert adapters == mc.n_layers * 4 * per_block  # r (in + out) each
    (plan,) = rank_plans(cfg, dims, mc)
    assert plan.buckets == [adapters] and plan.trained_params == adapters
    st = step_time(cfg, dims, mc, load_cluster("local"))
    dp = [tt.traffic for tt in st.traffic if tt.traffic.group == "dp" and tt.traffic.wire_bytes > 4]
    assert [(t.op, t.wire_bytes) for t in dp] == [("all_reduce", round(wire_bytes("all_reduce", 4 * adapters, 2)))]

    z3 = Config.load(None, [*model_sets, "parallel.dp=2", "parallel.zero=3"])
    (plan,) = rank_plans(z3, z3.validate(2), mc)
    assert sum(plan.buckets) == adapters and sum(plan.frozen_buckets) == frozen
    st = step_time(z3, z3.validate(2), mc, load_cluster("local"))
    by_op: dict[str, float] = {}
    for tt in st.traffic:
        if tt.traffic.group == "dp" and tt.traffic.op != "all_reduce":
            by_op[tt.traffic.op] = by_op.get(tt.traffic.op, 0) + tt.traffic.wire_bytes
    assert by_op["reduce_scatter"] == pytest.approx(4 * adapters / 2, abs=len(plan.buckets))
    assert by_op["all_gather"] == pytest.approx(2 * 4 * (adapters + frozen) / 2, abs=4 * len(plan.buckets) + 8)
    full = Config.load(None, [*TINY, "model.fused_proj=false"])
    dims1 = full.validate(1)
    opt = [step_time(c, dims1, mc, load_cluster("local")).optimizer_s for c in (full, Config.load(None, model_sets))]
    assert opt[1] == pytest.approx(opt[0] * adapters / frozen, rel=1e-9)  # the base: every parameter of full training


def test_trickles_plan_times_a_lora_step_shorter_than_full_training(tmp_path):
    """``trickles plan`` of the same model and batch: the LoRA run's fastest layout takes less time than full
    training's, its FLOPs about two thirds."""
    steps = {}
    for rank in (0, 16):
        out = tmp_path / f"plan{rank}.json"
        sets = ["model.preset=demo", "data.seq_len=256", "train.global_batch=8", f"train.lora_rank={rank}"]
        args = [a for s in sets for a in ("--set", s)]
        done = cli_here("plan", *args, "--cluster", "dgx-a100", "--devices", "1", "--top", "1", "--json", out)
        assert done.returncode == 0, done.stderr
        best = json.loads(out.read_text())["layouts"][0]
        steps[rank] = (best["step_time_s"], best["model_tflops_per_device"] * best["step_time_s"])
    assert steps[16][0] < 0.85 * steps[0][0]
    assert 0.6 < steps[16][1] / steps[0][1] < 0.85  # about 4 N + adapters against 6 N (attention: full training's)
