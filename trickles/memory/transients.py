"""A backward's short-lived tensors: what one block's, the output projection's and a norm's backward hold at their
height beyond the saved activations (bytes on one rank; the memory report's transients,
:mod:`trickles.memory.report` and :mod:`trickles.memory.stages`).

For ``s`` tokens of a micro-batch on the rank, hidden ``d``, MLP width ``f``, vocabulary ``V``, tensor parallelism
``tp``, ``p`` bytes an activation element and ``g`` a gradient's:

* a block (:func:`block_backward_bytes`): the MLP's backward holds two fp32 gradients of its hidden activations at
  once, ``2 x 4 s f / tp``; in a whole backward (not a zero-bubble ``B``, which leaves the weights to ``W``) the
  output projection's backward makes one of them beside that projection's weight gradient, ``4 s f / tp + g f d / tp``
  (before it joins ``.grad``): the larger of the two. On a CPU these are what the measured peak has beyond the rest
  to the byte at the tests' shapes;
* the output projection under an unfused loss, in a whole backward (:func:`head_backward_bytes`): its weight
  gradient beside its input's, ``g V d / tp + p s d`` (the logits' gradient is counted by the loss's transient,
  :func:`~trickles.memory.activations.loss_transient_bytes`; the log-softmax it replaces is freed by then);
* RMSNorm (:func:`norm_backward_bytes`): the normalized input, the weighted gradient and their product, fp32 (the
  first becomes the returned gradient), and two fp32 row vectors (the product's row sums and means):
  ``12 s' d + 8 s' - p s' d`` beyond the input gradient, ``s'`` the norm's tokens (``s / tp`` under sequence
  parallelism). gpt2's LayerNorm (PyTorch's kernel) is counted the same: an estimate there (a zb-v middle stage
  measures 1.2% above the prediction on CPU ranks);
* the end of a zero-bubble ``B`` (:func:`split_end_bytes`): the chunk's first norm's backward; with no norm before
  the branches (``model.norm_placement=post``), on the last stage, the attention branch's input gradient before it
  joins the residual stream's, ``p s d`` (measured to within 0.03% of the stage's peak on CPU ranks); on the other
  stages the norm's is kept, an estimate there (ZB-V's middle rank measures 0.7% above it with post norms, as with
  sandwich ones).
"""

from __future__ import annotations

from ..models.config import ModelConfig


def block_backward_bytes(mc: ModelConfig, tokens: int, g: int, tp: int, whole: bool = True) -> int:
    """One block's backward transient (module docstring); ``whole=False``: a split backward's ``B``."""
    hidden_grads = 2 * 4 * tokens * mc.ffn_dim // tp
    if not whole:
        return hidden_grads
    return max(hidden_grads, hidden_grads // 2 + g * mc.ffn_dim * mc.d_model // tp)


def head_backward_bytes(mc: ModelConfig, tokens: int, p: int, g: int, tp: int, fused_loss: bool) -> int:
    """The output projection's backward under an unfused loss (module docstring); 0 when the loss is fused (its own
    function computes both gradients in forward)."""
    return 0 if fused_loss else g * (mc.vocab_size // tp) * mc.d_model + p * tokens * mc.d_model


def norm_backward_bytes(tokens: int, d: int, p: int) -> int:
    """RMSNorm's backward beyond the input gradient it returns, for ``tokens`` rows of ``d`` (module docstring)."""
    return 12 * tokens * d + 8 * tokens - p * tokens * d


def split_end_bytes(
    mc: ModelConfig, tokens: int, p: int, tp: int = 1, sequence_parallel: bool = False
) -> tuple[int, int]:
    """A zero-bubble ``B``'s transient as it ends, beyond the input gradient it returns (module docstring), for
    ``tokens`` tokens of a micro-batch on the rank: ``(elsewhere, on the last stage)``."""
    norm = norm_backward_bytes(tokens // tp if sequence_parallel else tokens, mc.d_model, p)
    return norm, (p * tokens * mc.d_model if mc.norm_placement == "post" else norm)
