"""The activation formulas of Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer
Models", section 4, for one GPT layer in 16-bit with dropout -- the reference the library's own formulas
(:func:`~trickles.memory.activations.activation_bytes`) are checked against, piece by piece.

With ``s`` the sequence, ``b`` the micro-batch, ``h`` the hidden size, ``a`` the heads, ``t`` the tensor-parallel
degree, every stored element 2 bytes and each dropout mask 1 byte:

==============  ===================================================================  ==================
piece           stored for backward                                                  bytes
==============  ===================================================================  ==================
attention       the QKV input (the norm's output) 2sbh, Q and K 4sbh, softmax         ``10sbh + 4as^2b``
                output 2as^2b, the dropped probabilities 2as^2b, V 2sbh, the output
                projection's input 2sbh
MLP             its input 2sbh, the GeLU's input 8sbh and output 8sbh                 ``18sbh``
norms           the two LayerNorms' inputs                                            ``4sbh``
dropout masks   after attention and after the MLP (1 byte each), the attention        ``2sbh + as^2b``
                probabilities' mask
==============  ===================================================================  ==================

in all ``sbh (34 + 5as/h)``. Tensor parallelism splits all but the norms' inputs, the two linears' inputs and
the two residual masks: ``sbh (10 + 24/t + 5as/(ht))``; with sequence parallelism those too:
``sbh (34/t + 5as/(ht))``. Selective recomputation of the attention core drops the ``5as^2b`` (the softmax
output, its mask and the dropped probabilities); so does attention that stores no score matrix (FlashAttention).

Where this library keeps different tensors (the test states each difference exactly):

* norms: LayerNorm also keeps its mean and 1/std, two per token; under CUDA autocast an fp32 copy of its input
  in place of the 16-bit one (``4sbh + 8sb`` a norm; on a CPU ``2sbh + 4sb``);
* attention: the fused kernel (CUDA: Flash/memory-efficient attention, which runs dropout from a saved seed)
  keeps the fp32 log-sum-exp of each query and head, ``4asb``; with dropout on a CPU, SDPA's math path keeps
  fp32 copies of Q, K and V (``12sbh`` for their ``6sbh``) and the probabilities, their mask and the dropped
  probabilities in fp32 (``12as^2b`` for their ``5as^2b``);
* dropout masks: on a CPU each dropout keeps its scaled keep-mask in the input's type, 2 bytes for their 1.
"""

from __future__ import annotations


def korthikanti_terms(
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    selective: bool = False,
    flash: bool = False,
) -> dict[str, float]:
    """The table's pieces in bytes for one layer (module docstring), split by ``tp`` as the paper splits them."""
    sbh, as2b = seq * batch * hidden, heads * seq * seq * batch
    t = tp
    whole = t if sequence_parallel else 1  # what tensor parallelism alone leaves whole
    scores = 0 if selective or flash else 1
    return {
        "norms": 4 * sbh / whole,
        "attention": 2 * sbh / whole + 8 * sbh / t + 4 * as2b * scores / t,
        "mlp": 2 * sbh / whole + 16 * sbh / t,
        "dropout masks": 2 * sbh / whole + as2b * scores / t,
    }


def korthikanti_layer_bytes(
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    selective: bool = False,
    flash: bool = False,
) -> float:
    """The paper's closed forms: ``sbh (34 + 5as/h)``; ``sbh (10 + 24/t + 5as/(ht))`` with tensor parallelism;
    ``sbh (34/t + 5as/(ht))`` with sequence parallelism; the ``5as/h`` term gone under selective recomputation
    or attention that stores no score matrix."""
    s, b, h, a, t = seq, batch, hidden, heads, tp
    scores = 0 if selective or flash else 5 * a * s / (h * t)
    if sequence_parallel:
        return s * b * h * (34 / t + scores)
    return s * b * h * (10 + 24 / t + scores) if t > 1 else s * b * h * (34 + scores)
