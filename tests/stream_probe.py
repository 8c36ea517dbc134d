"""Run in a fresh process by tests/unit/test_streaming.py: peak anonymous memory of loading and generating.

``python tests/stream_probe.py CHECKPOINT BUDGET_BYTES|resident NEW_TOKENS`` prints one JSON line:
``baseline`` (RssAnon after importing torch and trickles and building a tiny model on the meta device,
before loading), ``peak`` (the largest
RssAnon seen while loading and generating: a thread samples ``/proc/self/status`` every
millisecond, and the streamer's hooks sample it at every block), ``kv`` (the KV cache's bytes),
``model`` (the checkpoint's tensor bytes), and the generated ids. Memory-mapped checkpoint pages
are file-backed, so they are not in RssAnon.
"""

from __future__ import annotations

import json
import re
import sys
import threading

import torch

from trickles.infer.streaming import kv_cache_bytes, load_streaming
from trickles.models.generate import generate
from trickles.train.load import load_for_inference

_ANON = re.compile(rb"RssAnon:\s+(\d+) kB")


def rss_anon() -> int:
    with open("/proc/self/status", "rb") as f:
        return int(_ANON.search(f.read()).group(1)) * 1024


class PeakSampler:
    def __init__(self):
        self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self, *_):
        self.peak = max(self.peak, rss_anon())

    def _run(self):
        while not self._stop.wait(0.001):
            self.sample()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()


def _warm_up() -> None:
    """Builds a tiny model on the meta device once: the first build imports the kernels' modules (Triton among them,
    about 70 MB of anonymous memory), which belongs to the baseline, not to the model; so do the modules torch
    imports on first use of some meta-device functions that loading reaches (TorchDynamo, SymPy: about 20 MB)."""
    import dataclasses

    import torch._dynamo  # noqa: F401

    from trickles.models.config import ModelConfig
    from trickles.models.presets import apply_preset
    from trickles.models.transformer import Transformer

    with torch.device("meta"):
        Transformer(dataclasses.replace(apply_preset(ModelConfig(), "tiny"), vocab_size=256, max_seq_len=8))


def main() -> None:
    path, budget, new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    prompt_ids = list(b"streaming a model larger than its budget")
    max_len = len(prompt_ids) + new_tokens
    _warm_up()
    baseline = rss_anon()
    with PeakSampler() as sampler:
        if budget == "resident":
            model, _, _ = load_for_inference(path, "cpu")
        else:
            model, _, _ = load_streaming(path, "cpu", int(budget), batch=1, max_len=max_len)
        for block in model.layers.values():
            block.register_forward_pre_hook(sampler.sample)
            block.register_forward_hook(sampler.sample)
        out = generate(model, torch.tensor([prompt_ids]), new_tokens, temperature=0)
    model_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    print(
        json.dumps(
            {
                "baseline": baseline,
                "peak": sampler.peak,
                "kv": kv_cache_bytes(model.cfg, 1, max_len),
                "model": model_bytes,
                "ids": out[0].tolist(),
                "streamed": list(getattr(model, "placement", None).streamed) if budget != "resident" else [],
            }
        )
    )


if __name__ == "__main__":
    main()
