"""The ``[train]`` section: steps, batch, optimizer, schedule, logging and checkpoints."""

from __future__ import annotations

from dataclasses import dataclass

from ..adapters.lora import DEFAULT_TARGETS, LoRASettings
from ..errors import ConfigError
from ..options import opt


@dataclass
class TrainConfig:
    """Optimization and bookkeeping (the ``[train]`` section)."""

    steps: int = opt(250, "optimizer steps to run")
    seed: int = opt(1234, "seed for initialization, data order and dropout")
    global_batch: int = opt(
        16, "sequences per optimizer step, summed over data-parallel ranks and accumulation micro-steps"
    )
    micro_batch: int | None = opt(
        None, "sequences per forward/backward on one rank (none: global_batch / dp, no accumulation)"
    )
    optimizer: str = opt(
        "adamw",
        "adamw, lamb (Adam with a per-weight trust ratio), lars (momentum SGD with a per-weight learning rate) or "
        "sgd (momentum SGD); see trickles.optim",
    )
    lr: float = opt(2e-3, "peak learning rate")
    schedule: str = opt(
        "auto",
        "learning-rate decay after the warm-up: cosine, poly ((1 - progress)^poly_power) or auto (poly for lars, as "
        "its users train it; cosine otherwise)",
    )
    poly_power: float = opt(2.0, "exponent of the poly schedule")
    min_lr_ratio: float = opt(0.1, "learning rate at the end of the decay, as a fraction of lr")
    warmup_steps: int = opt(20, "linear warm-up steps from 0 to lr")
    weight_decay: float = opt(
        0.1,
        "weight decay of linear matrices (not of norms, biases and embeddings): decoupled for adamw and lamb, an L2 "
        "term for sgd and lars",
    )
    beta1: float = opt(0.9, "adamw/lamb first-moment decay")
    beta2: float = opt(0.95, "adamw/lamb second-moment decay")
    eps: float = opt(1e-8, "adamw/lamb epsilon")
    momentum: float = opt(0.9, "sgd/lars momentum")
    trust_coefficient: float = opt(
        0.001, "lars: eta, the local learning rate's coefficient (eta ||w|| / (||g|| + wd ||w||))"
    )
    trust_clip: float = opt(0.0, "lamb/lars: upper bound on the trust ratio (0: none)")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this value (0: no clipping)")
    max_nonfinite_steps: int = opt(
        10,
        "stop (exit status 3) after this many consecutive steps with a non-finite loss or gradient; such steps are "
        "skipped",
    )
    eval_every: int = opt(
        50, "evaluate on held-out data every N steps (0: never; the last step always evaluates when >0)"
    )
    eval_batches: int = opt(4, "held-out batches of global_batch sequences per evaluation")
    init_from: str = opt(
        "",
        "start from the weights of this checkpoint (a step_* directory or a run's out_dir, e.g. a pruned one) or "
        "Hugging Face model directory (config.json + safetensors; data.tokenizer then defaults to its tokenizer), "
        "with its model shape, a fresh optimizer and step 0 (empty: initialize from seed)",
    )
    lora_rank: int = opt(
        0,
        "LoRA: train rank-r adapters on the projections of train.lora_targets, every other weight frozen (no "
        "gradient, no optimizer state; docs/lora.md); 0: off, the whole model trains",
    )
    lora_alpha: float = opt(16.0, "LoRA: the update is scaled by lora_alpha / lora_rank")
    lora_dropout: float = opt(0.0, "LoRA: dropout on the adapters' input")
    lora_targets: list[str] = opt(
        list(DEFAULT_TARGETS),
        "LoRA: the projections to adapt, by their Hugging Face module names (every linear whose name ends so)",
    )
    lora_base: str = opt(
        "same",
        "LoRA: the frozen base weight of every adapted linear: same (the run's parameter type) or int8 (per-row int8 "
        "codes and fp32 scales, dequantized in each product; QLoRA's idea; docs/lora.md)",
    )
    checkpoint_every: int = opt(0, "save a checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = opt(2, "keep the newest K complete checkpoints, delete older ones")
    async_checkpoint: bool = opt(
        True,
        "write checkpoints in the background: each rank copies its part to host memory and training goes on while a "
        "thread writes it (one save in flight; the final save is waited for); false: every rank waits for the write",
    )
    max_failed_saves: int = opt(
        3,
        "stop (exit status 5) after this many checkpoint saves failed in a row; a failed save is logged, leaves no"
        " directory and is retried at the next checkpoint step; a failed final save ends the run at once (status 5)",
    )
    out_dir: str = opt("runs/demo", "directory for metrics, plots, samples and checkpoints")
    qat: bool = opt(
        False,
        "quantization-aware training: projections compute with int8 fake-quantized weights (per row) and inputs (per "
        "token), gradients straight through; the final checkpoint is also exported to int8 (<out_dir>/int8_step_N); "
        "see docs/compression.md",
    )
    compile: bool = opt(
        False,
        "compile each transformer block, and the output projection with its loss, with torch.compile (the time it "
        "takes is printed after the second step)",
    )
    device: str = opt("auto", "auto (cuda:LOCAL_RANK when CUDA is available, else cpu), cpu, or cuda")
    tensorboard: bool = opt(False, "also write TensorBoard event files to <out_dir>/tb")
    plot: bool = opt(True, "draw <out_dir>/loss.png at the end (needs matplotlib)")
    pipeline_trace: str = opt(
        "",
        "with parallel.pp > 1: time every stage's forwards and backwards and draw the last step's Gantt chart to "
        "this PNG",
    )
    sample_tokens: int = opt(200, "tokens to generate from the final model at the end (0: none)")
    sample_prompt: str = opt("def ", "prompt of the final sample")
    sample_temperature: float = opt(0.8, "temperature of the final sample")
    sample_top_k: int = opt(40, "top-k of the final sample (0: off)")

    def lora(self) -> LoRASettings | None:
        """The LoRA adapters this run trains (None: train.lora_rank=0, the whole model trains)."""
        if not self.lora_rank:
            return None
        return LoRASettings(
            self.lora_rank, self.lora_alpha, self.lora_dropout, tuple(self.lora_targets), base=self.lora_base
        )

    def validate(self) -> None:
        if self.lora_rank < 0:
            raise ConfigError(f"train.lora_rank must be 0 (off) or a rank, got {self.lora_rank}")
        if self.lora_rank:
            self.lora().check()
        elif self.lora_base != "same":
            raise ConfigError(
                f"train.lora_base={self.lora_base} sets the type of LoRA's frozen base, but train.lora_rank=0 trains "
                "the whole model; set train.lora_rank or train.lora_base=same"
            )
        for key in ("steps", "global_batch"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key} must be at least 1, got {getattr(self, key)}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ConfigError(f"train.micro_batch must be at least 1 or none, got {self.micro_batch}")
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be positive, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for key in ("warmup_steps", "eval_every", "eval_batches", "checkpoint_every", "sample_tokens", "sample_top_k"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key} must not be negative, got {getattr(self, key)}")
        if self.max_nonfinite_steps < 1:
            raise ConfigError(f"train.max_nonfinite_steps must be at least 1, got {self.max_nonfinite_steps}")
        if self.max_failed_saves < 1:
            raise ConfigError(f"train.max_failed_saves must be at least 1, got {self.max_failed_saves}")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"train.keep_checkpoints must be at least 1, got {self.keep_checkpoints}")
        if self.grad_clip < 0 or self.weight_decay < 0 or self.eps <= 0:
            raise ConfigError(
                "train.grad_clip and train.weight_decay must not be negative and train.eps must be positive"
            )
        from ..optim.settings import OPTIMIZERS

        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.schedule not in ("auto", "cosine", "poly"):
            raise ConfigError(f"train.schedule must be auto, cosine or poly, got {self.schedule!r}")
        if self.poly_power <= 0:
            raise ConfigError(f"train.poly_power must be positive, got {self.poly_power}")
        if self.trust_coefficient <= 0 or self.trust_clip < 0:
            raise ConfigError(
                "train.trust_coefficient must be positive and train.trust_clip must not be negative (0: no clip)"
            )
        for key in ("beta1", "beta2", "momentum"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"train.{key} must be in [0, 1), got {getattr(self, key)}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"train.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.sample_temperature < 0:
            raise ConfigError(f"train.sample_temperature must not be negative, got {self.sample_temperature}")
