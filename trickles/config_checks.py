"""What each parallel dimension asks of the model, the data and the batch: the checks across sections that
:meth:`trickles.config.Config.validate` runs on a layout's degrees (tensor parallel in one dimension or on a grid,
context parallel, pipeline), each failing with a one-line :class:`~trickles.errors.ConfigError` that says what to
change.
"""

from __future__ import annotations

from .errors import ConfigError
from .models.model_checks import check_mtp_layout
from .topology import ParallelDims


class LayoutChecks:
    """The layout checks of :class:`~trickles.config.Config` (its base): they read its sections (``model``,
    ``data``, ``train``, ``parallel``, ``memory``) and its ``batch_plan``."""

    def _check_tensor_parallel(self, tp: int) -> None:
        """1-D tensor parallelism over ``tp`` ranks: whole heads, MLP columns and vocabulary rows per rank."""
        m = self.model
        if self.parallel.sequence_parallel and tp == 1:
            raise ConfigError(
                "parallel.sequence_parallel needs parallel.tp > 1 (it splits the sequence over the tensor-parallel "
                "ranks)"
            )
        if tp == 1:
            return
        if m.n_heads % tp:
            raise ConfigError(
                f"model.n_heads ({m.n_heads}) must be divisible by parallel.tp ({tp}): each rank takes whole heads"
            )
        if m.ffn_dim % tp:
            raise ConfigError(
                f"the MLP width ({m.ffn_dim}) must be divisible by parallel.tp ({tp}); set model.ffn_hidden"
            )
        if m.fuses_projections and m.kv_heads % tp:
            raise ConfigError(
                f"fused q/k/v projections split whole key/value heads over parallel.tp ({tp}), but model.n_kv_heads "
                f"is {m.kv_heads}; set model.fused_proj=false or make n_kv_heads a multiple of parallel.tp"
            )
        if m.qk_norm == "full" and m.kv_heads % tp:
            raise ConfigError(
                f"model.qk_norm=full splits the key norm's weight with whole key/value heads over parallel.tp ({tp}), "
                f"but model.n_kv_heads is {m.kv_heads}; make n_kv_heads a multiple of parallel.tp"
            )
        vocab_unit = m.vocab_size if m.vocab_size is not None else m.vocab_multiple
        if vocab_unit % tp:
            raise ConfigError(
                f"the vocabulary ({'model.vocab_size' if m.vocab_size else 'model.vocab_multiple'} = {vocab_unit}) "
                f"must be divisible by parallel.tp ({tp}) to split the embedding and output layer"
            )
        if self.parallel.sequence_parallel and self.data.seq_len % tp:
            raise ConfigError(
                f"data.seq_len ({self.data.seq_len}) must be divisible by parallel.tp ({tp}) for sequence parallelism"
            )

    def _check_tensor_grid(self, dims: ParallelDims) -> None:
        """2-D, 2.5-D and 3-D tensor parallelism: what the grid splits must divide, and what it does not combine
        with."""
        m, p, grid = self.model, self.parallel, dims.grid
        mode, q = grid.mode, grid.q
        why = f"parallel.tp_mode={mode}"
        for bad, what, fix in (
            (
                p.sequence_parallel,
                "parallel.sequence_parallel",
                "a grid splits the activations already; set it to false",
            ),
            (dims.cp > 1, "context parallelism", "set parallel.cp=1 or parallel.tp_mode=1d"),
            (m.attention == "mla", "model.attention=mla", "set parallel.tp_mode=1d (heads split) or parallel.tp=1"),
            (bool(m.moe_experts), "mixture-of-experts blocks", "set model.moe_experts=0 or parallel.tp_mode=1d"),
            (
                m.qk_norm != "none" or m.norm_placement != "pre",
                "q/k norms or norms after attention and MLP (model.qk_norm, model.norm_placement)",
                "set model.qk_norm=none and norm_placement=pre, or parallel.tp_mode=1d",
            ),
            (
                m.norm_unit_offset or m.final_softcap is not None,
                "(1 + w) norms or final-logit soft-capping (model.norm_unit_offset, model.final_softcap)",
                "unset them or use parallel.tp_mode=1d",
            ),
            (m.fused_loss is True, "model.fused_loss=true", "the grid's loss is unfused; leave model.fused_loss unset"),
            (
                m.sliding_window is not None and m.sliding_window < self.data.seq_len,
                f"model.sliding_window ({m.sliding_window}) shorter than data.seq_len",
                "set model.sliding_window=none or parallel.tp_mode=1d",
            ),
            (
                self.train.qat,
                "train.qat",
                "quantization-aware training scales whole rows; set train.qat=false or parallel.tp_mode=1d",
            ),
        ):
            if bad:
                raise ConfigError(f"{what} does not combine with {why}; {fix}")
        feature_unit = q * q if mode == "3d" else q  # 3-D splits a linear's input features into q^2 blocks
        vocab_unit = m.vocab_size if m.vocab_size is not None else m.vocab_multiple
        for n, what, unit in (
            (m.n_heads, "model.n_heads", q),
            (m.kv_heads, "model.n_kv_heads", q),
            (m.d_model, "model.d_model", feature_unit),
            (m.ffn_dim, "the MLP width (model.ffn_hidden)", feature_unit),
            (m.n_heads * m.head_dim, "model.n_heads x head size", feature_unit),
            (vocab_unit, "the vocabulary (model.vocab_size or model.vocab_multiple)", q),
        ):
            if n % unit:
                raise ConfigError(
                    f"{what} ({n}) must be divisible by {unit} with {why} at parallel.tp={dims.tp} (q = {q}); "
                    f"change it or parallel.tp"
                )
        micro, _ = self.batch_plan(dims.dp)
        parts = q * q if mode == "3d" else q * grid.depth
        if micro % parts:
            raise ConfigError(
                f"with {why} each micro-batch's {micro} samples are split into {parts} blocks; make "
                f"train.micro_batch (or train.global_batch / parallel.dp) a multiple of {parts}"
            )

    def _check_context_parallel(self, dims: ParallelDims) -> None:
        """Context parallelism: each rank's share of the sequence (ring: two chunks each) and of the heads."""
        cp, m, p, seq = dims.cp, self.model, self.parallel, self.data.seq_len
        if cp == 1:
            return
        unit = 2 * cp if p.cp_mode == "ring" else cp
        if seq % unit:
            what = (
                f"2 x parallel.cp = {unit} (ring attention cuts it into 2 chunks per rank)"
                if p.cp_mode == "ring"
                else f"parallel.cp ({cp})"
            )
            raise ConfigError(
                f"data.seq_len ({seq}) must be divisible by {what}; set data.seq_len to a multiple of {unit}"
            )
        if p.sequence_parallel and (seq // cp) % dims.tp:
            raise ConfigError(
                f"each context-parallel rank's {seq // cp} tokens must divide by parallel.tp ({dims.tp}) for "
                f"sequence parallelism; set data.seq_len to a multiple of {unit * dims.tp}"
            )
        if m.dropout > 0:
            raise ConfigError(
                f"model.dropout ({m.dropout}) must be 0 with parallel.cp > 1 (attention split over ranks has no "
                "attention dropout); set model.dropout=0"
            )
        if p.cp_mode == "ulysses":
            heads = m.n_heads // dims.tp
            if heads % cp:
                raise ConfigError(
                    f"parallel.cp_mode=ulysses splits each tensor-parallel rank's {heads} query heads over "
                    f"parallel.cp ({cp}) ranks; use a cp that divides {heads} or parallel.cp_mode=ring"
                )

    def _check_pipeline(self, dims: ParallelDims) -> None:
        """Pipeline stages: the schedule against the micro-batches, the chunks and the features it cannot run with."""
        from .parallel.pipeline.schedules import SPLIT, Shape, check_shape
        from .parallel.pipeline.stages import partition_layers

        p = self.parallel
        check_mtp_layout(self.model, p, dims, self.data.seq_len)  # the last stage's prediction modules (any pp)
        if dims.pp == 1:
            if self.train.pipeline_trace:
                raise ConfigError(
                    "train.pipeline_trace (--pipeline-trace) draws pipeline stages; it needs parallel.pp > 1"
                )
            if p.virtual_stages != p.schedule_chunks() or p.pipeline_layers or p.schedule == "interleaved":
                raise ConfigError(
                    "parallel.schedule=interleaved, parallel.virtual_stages and parallel.pipeline_layers "
                    "need parallel.pp > 1"
                )
            return
        if p.zero == 3 and p.schedule in SPLIT:
            raise ConfigError(
                f"parallel.zero=3 gathers a block's weights around its backward, but parallel.schedule="
                f"{p.schedule} computes the weights' gradients later, apart from it; use parallel.zero=2 (or "
                f"0, 1) with {p.schedule}, or parallel.schedule=1f1b / interleaved / gpipe with parallel.zero=3"
            )
        if p.zero == 3 and self.model.tied:
            raise ConfigError(
                "parallel.zero=3 with parallel.pp > 1 cannot shard an embedding tied across pipeline stages "
                "(the first and last stage each hold a copy); set model.tie_embeddings=false, or use parallel.zero=2 "
                "(or 0, 1) with this pipeline"
            )
        if p.schedule in SPLIT and self.train.compile:
            raise ConfigError(
                f"parallel.schedule={p.schedule} splits each backward into the input's and the weights' "
                f"gradients, but train.compile makes each block's backward one compiled piece that computes "
                f"both; use train.compile=false or parallel.schedule=1f1b / interleaved"
            )
        if p.schedule in SPLIT and self.memory.recompute == "full":
            raise ConfigError(
                f"parallel.schedule={p.schedule} computes the weights' gradients in W, apart from B; under "
                f"memory.recompute=full every W would recompute its blocks again; use memory.recompute="
                f"selective (or none) with {p.schedule}, or parallel.schedule=1f1b / interleaved"
            )
        if p.schedule in SPLIT and dims.tp > 1 and p.tp_mode != "1d":
            raise ConfigError(
                f"parallel.schedule={p.schedule} splits each backward into the input's and the weights' "
                f"gradients, which the {p.tp_mode} tensor-parallel layers compute in one step; use "
                f"parallel.tp_mode=1d or parallel.schedule=1f1b / interleaved"
            )
        _, micro_batches = self.batch_plan(dims.dp)
        try:
            check_shape(p.schedule, Shape.of(p.schedule, dims.pp, p.virtual_stages, micro_batches))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        partition_layers(self.model.n_layers, dims.pp * p.virtual_stages, p.pipeline_layers)
