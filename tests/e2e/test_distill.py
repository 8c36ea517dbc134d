"""Distillation: the KL term equals a reference, alpha = 0 is plain training, a distilled half-depth student beats
the same student trained from scratch, unsupported layouts and vocabularies are refused."""

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_config

from trickles.compress.distill import Distiller, default_map, forward_states, kd_loss
from trickles.errors import ConfigError
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

STUDENT = ("model.n_layers=1",)


def _trainer(cfg):
    cfg.validate(1)
    return Trainer(cfg, ParallelDims().build(torch.device("cpu")), quiet=True)


def _train(cfg):
    trainer = _trainer(cfg)
    losses = [trainer.train_step()["loss"] for _ in range(cfg.train.steps)]
    return trainer, losses


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A 2-block tiny llama trained for 60 steps: its checkpoint directory."""
    tmp = tmp_path_factory.mktemp("teacher")
    trainer, _ = _train(tiny_config(tmp, steps=60))
    return trainer.save_checkpoint()


def test_kl_term_equals_reference():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g) * 3
    y = torch.randint(0, 11, (2, 5), generator=g)
    y[0, 1] = y[1, 4] = -100
    for temp in (1.0, 2.5):
        keep = (y != -100).flatten()
        ref = F.kl_div(
            F.log_softmax(s / temp, -1).flatten(0, 1)[keep],
            F.log_softmax(t / temp, -1).flatten(0, 1)[keep],
            log_target=True,
            reduction="batchmean",
        )
        assert torch.allclose(kd_loss(s, t, y, temp), ref, rtol=1e-6, atol=1e-7)
    assert kd_loss(t, t, y, 2.0).abs() < 1e-6  # the same distribution: no divergence
    assert default_map(2, 4) == [(0, 1), (1, 3)] and default_map(1, 2) == [(0, 1)]


def test_distillation_loss_is_the_weighted_sum(teacher, tmp_path):
    cfg = tiny_config(tmp_path, *STUDENT, f"distill.teacher={teacher}", "distill.alpha=0.3", "distill.temperature=2")
    trainer = _trainer(cfg)
    d = trainer.distill
    x, y = trainer.train_data.micro_batches(0, 8, 8)[0]
    with torch.no_grad():
        got = d.loss(trainer.model, x, y)
        s_logits, t_logits = trainer.model(x), d.teacher(x)
        ce = F.cross_entropy(s_logits.flatten(0, 1), y.flatten())
        kl = F.kl_div(
            F.log_softmax(s_logits / 2, -1).flatten(0, 1),
            F.log_softmax(t_logits / 2, -1).flatten(0, 1),
            log_target=True,
            reduction="batchmean",
        )
    assert torch.allclose(got, 0.7 * ce + 0.3 * 4 * kl, rtol=1e-5), (got, ce, kl)
    assert kl > 0.01  # a wrong teacher or temperature would show


def test_alpha_zero_is_plain_training(teacher, tmp_path):
    plain, plain_losses = _train(tiny_config(tmp_path / "plain", *STUDENT, steps=5))
    dist, dist_losses = _train(
        tiny_config(tmp_path / "kd", *STUDENT, f"distill.teacher={teacher}", "distill.alpha=0", steps=5)
    )
    assert dist.distill is not None
    assert dist_losses == plain_losses  # bitwise
    for (n, a), b in zip(dist.model.named_parameters(), plain.model.parameters()):
        assert torch.equal(a, b), n
    # and the soft term does change the run
    _, soft = _train(
        tiny_config(tmp_path / "soft", *STUDENT, f"distill.teacher={teacher}", "distill.alpha=0.5", steps=5)
    )
    assert soft != plain_losses


def test_distilled_half_depth_student_beats_scratch(teacher, tmp_path):
    # measured (seed 1234, teacher: 2 blocks, 60 steps, val 3.519): 1-block student after 20 steps, val loss 3.776 from
    # scratch, 3.750 distilled (alpha 0.5, T = 1); at T = 2 the soft term needs longer to pay off on this short run
    common = (*STUDENT, "train.eval_batches=4")
    scratch, _ = _train(tiny_config(tmp_path / "scratch", *common, steps=20))
    kd, _ = _train(
        tiny_config(
            tmp_path / "kd",
            *common,
            f"distill.teacher={teacher}",
            "distill.alpha=0.5",
            "distill.temperature=1",
            steps=20,
        )
    )
    v_scratch, v_kd = scratch.evaluate(), kd.evaluate()
    print(f"val loss after 20 steps: scratch {v_scratch:.4f}, distilled {v_kd:.4f}")
    assert v_kd < v_scratch


def test_hidden_states_with_a_learned_projection(teacher, tmp_path):
    cfg = tiny_config(
        tmp_path,
        *STUDENT,
        "model.d_model=32",
        "model.n_heads=2",
        "model.n_kv_heads=1",
        f"distill.teacher={teacher}",
        "distill.hidden_weight=1.0",
        steps=3,
    )
    trainer = _trainer(cfg)
    d = trainer.distill
    assert d.pairs == [(0, 1)] and d.proj is not None and d.proj[0].weight.shape == (64, 32)
    before = d.proj[0].weight.detach().clone()
    x, y = trainer.train_data.micro_batches(0, 8, 8)[0]
    with torch.no_grad():
        _, hs = forward_states(trainer.model, x, {0})
        _, ht = forward_states(d.teacher, x, {1})
        mse = F.mse_loss(d.proj[0](hs[0]), ht[1])
        no_hidden = d.loss(trainer.model, x, y) - mse
    d.cfg.hidden_weight = 0.0
    with torch.no_grad():
        assert torch.allclose(d.loss(trainer.model, x, y), no_hidden, rtol=1e-5)
    d.cfg.hidden_weight = 1.0
    for _ in range(3):
        trainer.train_step()
    assert not torch.equal(d.proj[0].weight, before)  # the projection learns


def test_refused_layouts_and_vocabularies(teacher, tmp_path):
    for layout in ("parallel.tp=2", "parallel.pp=2", "parallel.zero=3"):
        cfg = tiny_config(tmp_path, *STUDENT, f"distill.teacher={teacher}", layout)
        with pytest.raises(ConfigError, match="parallel"):
            cfg.validate(2)
    with pytest.raises(ConfigError, match="does not exist"):
        tiny_config(tmp_path, f"distill.teacher={tmp_path}/nothing").validate(1)
    with pytest.raises(ConfigError, match="vocabulary"):
        _trainer(tiny_config(tmp_path, *STUDENT, "model.vocab_size=384", f"distill.teacher={teacher}"))
    assert Distiller  # the class the trainer builds


def test_distillation_at_dp2_tracks_one_process(teacher, tmp_path):
    """The teacher runs on each data-parallel rank's rows: dp2 gives one process's losses (the layout tests' 1e-4)."""
    import json

    from trickles.cli import main

    sets = [
        "model.preset=tiny",
        "model.n_layers=1",
        "data.seq_len=32",
        "data.max_bytes=120000",
        "train.global_batch=8",
        "train.warmup_steps=2",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.plot=false",
        "train.lr=3e-3",
        f"data.cache_dir={tmp_path}/cache",
        "train.steps=4",
        f"train.out_dir={tmp_path}/dp2",
        "distill.alpha=0.5",
    ]
    assert (
        main(["train", "--quiet", "--nproc", "2", "--teacher", teacher, *[a for s in sets for a in ("--set", s)]]) == 0
    )
    with open(tmp_path / "dp2" / "metrics.jsonl") as f:
        dp2 = [json.loads(line)["loss"] for line in f]
    _, one = _train(tiny_config(tmp_path / "one", *STUDENT, f"distill.teacher={teacher}", "distill.alpha=0.5", steps=4))
    _, plain = _train(tiny_config(tmp_path / "plain", *STUDENT, steps=4))
    gap = max(abs(a - b) / b for a, b in zip(dp2, one))
    assert gap < 1e-4, (dp2, one)
    assert (
        max(abs(a - b) / b for a, b in zip(plain, one)) > 1e-4
    )  # the tolerance would notice a run without the teacher
