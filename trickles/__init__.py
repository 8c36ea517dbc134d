"""trickles: train and serve large transformer models on the hardware you have.

The public API (everything the CLI uses is reachable from here):

    from trickles import (Config, Trainer, ParallelDims, distributed_session, export_checkpoint, measure_scaling,
                          run_training)
    cfg = Config.load("examples/demo.toml", ["train.steps=50"])
    run_training(cfg)                                  # or, step by step:
    with distributed_session(cfg.validate(1)) as topo:
        trainer = Trainer(cfg, topo)
        loss = trainer.train_step()["loss"]
    rows = measure_scaling(cfg, ranks=[1, 2])          # weak scaling: the same work per rank on 1 and 2 ranks
    export_checkpoint("runs/demo", "runs/demo-single")  # any layout's checkpoint, every tensor whole
    quantize_checkpoint("runs/demo", "runs/demo-int8")  # int8 weights, one scale per row
    model, tokenizer, meta = load_checkpoint("runs/demo-int8", int8="full")  # any checkpoint, float or int8
"""

from .comm import CommLedger, GroupComm
from .compress import load_checkpoint, quantize_checkpoint
from .config import Config
from .errors import CheckpointError, ConfigError, DataError, UserError
from .launch import launch
from .models import ModelConfig, Transformer, build_model, load_hf, save_hf
from .topology import ParallelDims, Topology, distributed_session
from .train.export import export_checkpoint
from .train.load import load_for_inference
from .train.run import run_training
from .train.scaling import measure_scaling
from .train.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "CommLedger",
    "GroupComm",
    "Config",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "UserError",
    "launch",
    "ModelConfig",
    "Transformer",
    "build_model",
    "load_hf",
    "save_hf",
    "ParallelDims",
    "Topology",
    "distributed_session",
    "export_checkpoint",
    "run_training",
    "measure_scaling",
    "Trainer",
    "load_for_inference",
    "load_checkpoint",
    "quantize_checkpoint",
]
