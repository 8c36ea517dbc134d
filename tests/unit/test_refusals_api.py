"""Every refusal of a bad argument to a public function is pinned: the error type and the part of the message that
says what to pass instead (docs/testing.md, "Refusals"). Tiny shapes; nothing here trains or spawns."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trickles.errors import ConfigError, UserError
from trickles.topology import TPGrid


def _raises(exc, message):
    return pytest.raises(exc, match=re.escape(message))


@pytest.fixture(scope="module")
def model():
    from trickles.models import ModelConfig, build_model

    cfg = ModelConfig(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, ffn_hidden=32, vocab_size=32, max_seq_len=8)
    return build_model(cfg, seed=0).eval()


# ---- inference: trickles.infer ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("max_new_tokens", -1, "max_new_tokens must be at least 0, got -1"),
        ("temperature", float("nan"), "temperature must be a number >= 0 (0: greedy), got nan"),
        ("top_k", -1, "top_k must be at least 0 (0: off), got -1"),
        ("top_p", 0.0, "top_p must be in (0, 1] (1: off), got 0"),
        ("repetition_penalty", 0.0, "repetition_penalty must be a number > 0 (1: off), got 0"),
        ("stop", ("",), "stop strings must not be empty"),
    ],
)
def test_decode_refuses_bad_sampling_settings(model, field, value, message):
    from trickles.infer import Sampling, decode

    with _raises(ValueError, message):
        decode(model, [[1, 2]], Sampling(**{field: value}))


def test_decode_refuses_mismatched_settings_empty_prompts_and_stop_strings_without_a_tokenizer(model):
    from trickles.infer import PaddedBatch, Sampling, decode

    with _raises(ValueError, "2 prompts but 1 sampling settings"):
        decode(model, [[1], [2]], [Sampling()])
    with _raises(ValueError, "stop strings need a tokenizer"):
        decode(model, [[1]], Sampling(stop=("x",)))
    with _raises(ValueError, "every prompt needs at least one token"):
        PaddedBatch(model, [[1], []], 2)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_beams=0, max_new_tokens=2), "num_beams must be at least 1, got 0"),
        (dict(num_beams=2, max_new_tokens=-1), "max_new_tokens must be at least 0, got -1"),
        (
            dict(num_beams=2, max_new_tokens=2, early_stopping="sometimes"),
            "early_stopping must be True, False or 'never', got 'sometimes'",
        ),
    ],
)
def test_beam_search_refuses_bad_arguments(model, kwargs, message):
    from trickles.infer import beam_search

    with _raises(ValueError, message):
        beam_search(model, [[1, 2]], **kwargs)


# ---- the model ---------------------------------------------------------------------------------------------------


def test_the_model_refuses_sequences_past_its_context_and_an_unresolved_config(model):
    from trickles.models import KVCache, ModelConfig, Transformer

    with _raises(ValueError, "sequence of 9 tokens is longer than model.max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    cache = KVCache(1, 1, 1, 4, 8, torch.float32, "cpu")
    with _raises(ValueError, "KV cache holds 4 positions; generation reached 5"):
        cache.update(0, 3, torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8))
    with _raises(ValueError, "resolve model.vocab_size and model.max_seq_len before building"):
        Transformer(ModelConfig(n_layers=1, d_model=16, n_heads=2))


def test_resolve_model_refuses_a_vocabulary_smaller_than_the_tokenizers():
    from trickles.models.config import ModelConfig, resolve_model

    with _raises(ConfigError, "model.vocab_size (100) is smaller than the tokenizer's vocabulary (257)"):
        resolve_model(ModelConfig(vocab_size=100), 257, 32)


def test_fused_cross_entropy_refuses_rows_and_targets_that_differ():
    from trickles.kernels.cross_entropy import linear_cross_entropy

    with _raises(ValueError, "fused cross-entropy: 6 hidden rows but 5 targets"):
        linear_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(7, 4), torch.zeros(5, dtype=torch.long))


# ---- data, communication counts, optimizer, planner --------------------------------------------------------------


def test_sharded_batches_refuse_bad_arguments():
    from trickles.data import ShardedBatches

    tokens = np.arange(100, dtype=np.int64)
    with _raises(ValueError, "seq_len must be at least 1, got 0"):
        ShardedBatches(tokens, 0, seed=0)
    with _raises(ValueError, "dp_rank must be in [0, dp_size=2), got 2"):
        ShardedBatches(tokens, 4, seed=0, dp_rank=2, dp_size=2)
    data = ShardedBatches(tokens, 4, seed=0)
    with _raises(ValueError, "consumed must be non-negative, got -1"):
        data.micro_batches(-1, 2, 2)
    with _raises(ValueError, "index must be non-negative, got -1"):
        data.val_micro_batches(-1, 2, 2)
    with _raises(ValueError, "global_batch (0) and micro_batch (2) must be positive"):
        data.micro_batches(0, 0, 2)


def test_collective_formulas_refuse_an_unknown_collective():
    from trickles.comm import messages, wire_bytes

    with _raises(ValueError, "unknown collective 'allreduce'; one of all_reduce"):
        wire_bytes("allreduce", 8, 2)
    with _raises(ValueError, "unknown collective 'allreduce'; one of all_reduce"):
        messages("allreduce", 2)


def test_optimizer_settings_refuse_an_unknown_optimizer():
    from trickles.optim import OptimizerSettings

    with _raises(ValueError, "unknown optimizer 'adam'; choose one of adamw"):
        OptimizerSettings(1e-3, (0.9, 0.95), 1e-8, 0.0, name="adam").build(
            [{"params": [torch.zeros(1)]}], torch.device("cpu")
        )


def test_fit_link_refuses_no_samples():
    from trickles.planner import fit_link

    with _raises(ValueError, "fit_link needs at least one (messages, wire_bytes, seconds) sample"):
        fit_link([])


def test_launch_refuses_no_ranks_and_negative_restarts():
    from trickles import launch

    with _raises(UserError, "--nproc must be at least 1, got 0"):
        launch(print, (), 0)
    with _raises(UserError, "--max-restarts must be at least 0, got -1"):
        launch(print, (), 1, max_restarts=-1)


# ---- quantization and memory formulas: an unknown mode -----------------------------------------------------------


def test_quantization_refuses_an_unknown_granularity_or_mode():
    from trickles.compress import set_mode
    from trickles.compress.quantize import Int8Linear, scales

    with _raises(ValueError, "granularity must be one of ('row', 'tensor'), got 'column'"):
        scales(torch.ones(2, 2), "column")
    with _raises(ValueError, "mode must be one of ('weight', 'full'), got 'half'"):
        Int8Linear(2, 2, False, mode="half")
    with _raises(ValueError, "mode must be one of ('weight', 'full'), got 'half'"):
        set_mode(torch.nn.Linear(2, 2), "half")


def test_memory_formulas_refuse_an_unknown_zero_stage_or_recompute_mode(model):
    from trickles.memory.accounting import zero_model_state_bytes
    from trickles.memory.activations import activation_bytes
    from trickles.memory.recompute import apply_recompute
    from trickles.parallel.tensor.activation_costs import activation_bytes_nd

    with _raises(ValueError, "ZeRO stage must be 0-3, got 4"):
        zero_model_state_bytes(1000, 2, stage=4)
    with _raises(ValueError, "recompute must be none, elementwise, selective or full, got 'some'"):
        activation_bytes(model.cfg, 1, 8, recompute="some")
    with _raises(ValueError, "recompute must be none, selective or full on a tensor-parallel grid, got 'some'"):
        activation_bytes_nd(model.cfg, SimpleNamespace(grid=True), 1, 8, recompute="some")  # a 2-D/3-D layout
    with _raises(ValueError, "recompute mode must be one of"):
        apply_recompute(model, "some")


def test_group_collectives_refuse_shapes_and_operations_they_cannot_split():
    """A group described as two ranks (no process group: every check comes before any communication)."""
    from trickles import comm as C

    group = C.GroupComm("tp", None, C.CommLedger())
    group.size = 2
    x = torch.zeros(3, 4)
    with _raises(ValueError, "an asynchronous or in-place all_gather gathers along dim 0"):
        group.all_gather(x, dim=1, async_op=True)
    with _raises(ValueError, "reduce_scatter on group 'tp': size 3 of dim 0 is not divisible by 2"):
        group.reduce_scatter(x)
    with _raises(ValueError, "an in-place reduce_scatter scatters along dim 0"):
        group.reduce_scatter(x, dim=1, out=torch.zeros(3, 2))
    with _raises(ValueError, "all_to_all on group 'tp': size 3 of dim 0 is not divisible by 2"):
        group.all_to_all(x)
    with _raises(ValueError, "batch_p2p: unknown operation 'put' (send or recv)"):
        group.batch_p2p([("put", x, 1)])
    with _raises(ValueError, "dim 0 of size 3 is not divisible by group 'tp' of 2 ranks"):
        C.scatter_to_region(x, group, 0)


def test_tensorboard_metrics_without_tensorboard_are_refused(tmp_path, monkeypatch):
    import sys

    from trickles.train.metrics import MetricsLog

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import -> ImportError
    with _raises(
        ImportError, "train.tensorboard=true needs the tensorboard package: pip install 'trickles[tensorboard]'"
    ):
        MetricsLog(str(tmp_path), tensorboard=True)


def test_a_tensor_parallel_grid_refuses_decoding_with_a_kv_cache():
    """A 2-D grid (its groups described, no process group): decoding with a cache needs 1-D tensor parallelism."""
    from trickles import comm as C
    from trickles.parallel.tensor.grid_model import GridContext

    groups = [C.GroupComm(name, None, C.CommLedger()) for name in ("tp", "tp_row", "tp_col")]
    ctx = GridContext(TPGrid.of("2d", 4), *groups, None)
    with _raises(ValueError, "decoding with a KV cache needs 1-D tensor parallelism (parallel.tp_mode=1d)"):
        ctx.begin_forward(8, decoding=True)


def test_sampling_with_an_unknown_label_is_refused():
    """Hard-routed experts: a label the experts are not mapped for (the trainer's own labels stand in for a run's)."""
    from trickles.train.trainer import Trainer

    trainer = SimpleNamespace(label_names=["json", "email"], device="cpu")
    with _raises(ConfigError, "unknown label 'yaml'; the experts are mapped for json, email (model.moe_label_experts)"):
        Trainer.label_ids(trainer, "yaml")
