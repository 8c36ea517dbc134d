"""Compression: structured pruning (:mod:`.prune`), distillation (:mod:`.distill`) and the side-by-side report (:mod:`.report`).

(The quantization work owns this file upstream; this tree only needs the package to exist.)
"""
