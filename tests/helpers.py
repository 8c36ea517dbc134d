"""Small shared pieces of the test suite: a tiny, fast configuration."""

from trickles.config import Config


def tiny_config(tmp, *overrides, steps=6, corpus_bytes=120_000):
    """A 2-layer llama on a slice of the standard library, writing under ``tmp``."""
    return Config.load(None, [
        "model.preset=tiny", "data.seq_len=32", f"data.max_bytes={corpus_bytes}", f"data.cache_dir={tmp}/cache",
        f"train.steps={steps}", "train.global_batch=8", "train.warmup_steps=2", "train.eval_every=0",
        "train.sample_tokens=0", "train.plot=false", f"train.out_dir={tmp}/run", "train.lr=3e-3", *overrides,
    ])
