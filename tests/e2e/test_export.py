"""``trickles checkpoint export``: checkpoints written by several ranks (dp x tp with ZeRO-1 and sequence parallel,
pipeline stages sharing a tied embedding, ZeRO-3, bf16 with fp32 master weights under ZeRO-2) consolidated in one
process. One process resumes from the export exactly as from the original; the export's tensors are the live state
of the ranks that saved (their weights and optimizer state at the moment of saving, put together here by the test's own
code, not by the reader the export is built on); the Hugging Face export gives ``transformers`` our logits; bad input
leaves nothing behind."""

import json
import os
import shutil
import sys

import pytest
import torch
from helpers import cli_here, tiny_config
from safetensors import safe_open

from trickles import Config, export_checkpoint
from trickles.errors import CheckpointError
from trickles.testing import run_command, run_ranks
from trickles.train import checkpoint as ckpt
from trickles.train.load import load_for_inference
from trickles.train.pieces import PieceReader
from trickles.train.trainer import Trainer

CPU = torch.device("cpu")
BEFORE, AFTER = 3, 3  # steps before the checkpoint, steps resumed after it
COMMON = ("train.micro_batch=2", "train.eps=1e-6")

# name -> (dp, tp, pp, overrides of the layout, overrides of the model and numerics)
LAYOUTS = {
    "dp2-tp2-zero1-sp": (2, 2, 1, ["parallel.zero=1", "parallel.sequence_parallel=true"], []),
    "pp2-gpt2-tied": (1, 1, 2, ["parallel.schedule=1f1b"], ["model.preset=gpt2-tiny", "model.n_layers=4"]),
    "dp2-zero3": (2, 1, 1, ["parallel.zero=3"], []),
    "dp2-zero2-bf16": (2, 1, 1, ["parallel.zero=2"], ["memory.precision=bf16"]),
}


def _config(tmp, cache, out, *overrides):
    return tiny_config(
        tmp, *COMMON, f"data.cache_dir={cache}", f"train.out_dir={out}", *overrides, steps=BEFORE + AFTER
    )


def _pieces(engine):
    """``{name: (tensor, global shape, offset)}`` of every parameter and buffer this rank holds."""
    out, specs = {}, engine.placements()
    for name, p in engine.full_state().items():
        spec = specs.get(name)
        shape, offset = (spec.global_shape, spec.offset) if spec else (tuple(p.shape), (0,) * p.dim())
        out[name] = (p.detach().clone(), tuple(shape), tuple(offset))
    return out


def _assemble(per_rank):
    """Whole tensors from every rank's pieces; a region held by several ranks must be the same on each."""
    whole, covered = {}, {}
    for pieces in per_rank:
        for name, (t, shape, offset) in pieces.items():
            full = whole.setdefault(name, torch.zeros(shape, dtype=t.dtype))
            mask = covered.setdefault(name, torch.zeros(shape, dtype=torch.bool))
            block = tuple(slice(o, o + n) for o, n in zip(offset, t.shape))
            seen = mask[block]
            assert torch.equal(full[block][seen], t[seen]), f"the copies of {name} differ between ranks"
            full[block] = t
            mask[block] = True
    for name, mask in covered.items():
        assert mask.all(), f"the ranks' pieces of {name} do not cover it"
    return whole


def _assemble_described(per_rank):
    """Whole tensors from every rank's ``{key: (tensor, piece description)}`` (a block of the global tensor by
    ``offset``/``block_shape``, and of that block the flattened elements ``flat_range``); a region held by several
    ranks must be the same on each, and every element must be held by one."""
    whole, covered = {}, {}
    for pieces in per_rank:
        for key, (t, meta) in pieces.items():
            shape = tuple(meta["global_shape"])
            full = whole.setdefault(key, torch.zeros(shape, dtype=t.dtype))
            mask = covered.setdefault(key, torch.zeros(shape, dtype=torch.bool))
            offset = meta.get("offset", [0] * len(shape))
            block = tuple(slice(o, o + n) for o, n in zip(offset, meta.get("block_shape", shape)))
            where = torch.arange(full.numel()).view(shape)[block].reshape(-1)  # the block's elements, flat, in order
            if "flat_range" in meta:
                where = where[meta["flat_range"][0] : meta["flat_range"][1]]
            values, seen = t.reshape(-1), mask.view(-1)[where]
            assert values.numel() == where.numel(), (key, meta, t.shape)
            assert torch.equal(full.view(-1)[where][seen], values[seen]), f"the copies of {key} differ between ranks"
            full.view(-1)[where] = values
            mask.view(-1)[where] = True
    for key, mask in covered.items():
        assert mask.all(), f"the ranks' pieces of {key} do not cover it"
    return whole


def _save_at_layout(tmp, cache, dp, tp, pp, layout, model):
    """Trains BEFORE steps at the layout and checkpoints; returns the path, this rank's pieces, AFTER more losses, and
    this rank's optimizer state as it was when the checkpoint was written (``{key: (tensor, description)}``)."""
    cfg = _config(tmp, cache, f"{tmp}/run", f"parallel.tp={tp}", f"parallel.pp={pp}", *layout, *model)
    tr = Trainer(cfg, cfg.validate(dp * tp * pp).build(CPU), quiet=True)
    for _ in range(BEFORE):
        tr.train_step()
    path = tr.save_checkpoint()
    pieces = _pieces(tr.engine)
    optimizer = {k: (t.detach().clone(), meta) for k, (t, meta) in tr.engine.optimizer.state_tensors().items()}
    return path, pieces, [tr.train_step()["loss"] for _ in range(AFTER)], optimizer


_SAVED = {}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("export")


def saved(work, name):
    """``(checkpoint path, whole parameters at the checkpoint, the layout's losses after it)`` of ``LAYOUTS[name]``."""
    if name not in _SAVED:
        dp, tp, pp, layout, model = LAYOUTS[name]
        results = run_ranks(
            dp * tp * pp, _save_at_layout, str(work / name), str(work / "cache"), dp, tp, pp, layout, model
        )
        path = results[0][0]
        assert all(r[2] == results[0][2] for r in results)
        _SAVED[name] = (
            path,
            _assemble([r[1] for r in results]),
            results[0][2],
            _assemble_described([r[3] for r in results]),
        )
    return _SAVED[name][:3]


def saved_optimizer(work, name):
    """The whole optimizer state of ``LAYOUTS[name]`` as the ranks held it when they saved."""
    saved(work, name)
    return _SAVED[name][3]


def _resume_in_one_process(work, name, checkpoint, out):
    """One process at dp = tp = pp = 1 loads ``checkpoint`` and trains to the end: its losses and final weights."""
    cfg = _config(str(work / name), str(work / "cache"), out, *LAYOUTS[name][4])
    tr = Trainer(cfg, cfg.validate(1).build(CPU), quiet=True)
    tr.load_checkpoint(checkpoint)
    assert tr.step == BEFORE
    losses = [tr.train_step()["loss"] for _ in range(AFTER)]
    return losses, {k: v.detach().clone() for k, v in tr.engine.full_state().items()}


def _descriptions(path):
    with safe_open(path, framework="pt") as f:
        return json.loads(f.metadata()["slices"]), {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_process_resumes_from_the_export_as_from_the_original(work, tmp_path, name):
    path, weights, layout_losses = saved(work, name)
    out = str(tmp_path / "single")
    assert export_checkpoint(path, out) == out
    assert sorted(os.listdir(out)) == [
        "manifest.json",
        "model-rank00000.safetensors",
        "optimizer-rank00000.safetensors",
        "tokenizer",
        "trainer.json",
    ]
    assert not os.path.exists(out + ".tmp")
    ckpt.verify(out)

    # every model tensor whole, described as whole, equal to the ranks' pieces put together
    slices, model = _descriptions(os.path.join(out, "model-rank00000.safetensors"))
    assert model.keys() == weights.keys()
    for k, w in weights.items():
        assert slices[k] == {"global_shape": list(w.shape)}, (k, slices[k])
        assert model[k].dtype == w.dtype and torch.equal(model[k], w), k

    # every optimizer-state tensor whole: moments (and fp32 masters) as the ranks held them when saving, step counters
    # scalars
    slices, optimizer = _descriptions(os.path.join(out, "optimizer-rank00000.safetensors"))
    live = saved_optimizer(work, name)
    assert sorted(optimizer) == sorted(live)
    masters = {k for k in optimizer if k.endswith("/master")}
    assert bool(masters) == ("memory.precision=bf16" in LAYOUTS[name][4])
    for k, t in optimizer.items():
        param, _, key = k.rpartition("/")
        assert param in weights and key in ("exp_avg", "exp_avg_sq", "master", "step"), k
        if key == "step":
            assert slices[k] == {"global_shape": [1], "scalar": True} and float(t) == BEFORE == float(live[k]), (k, t)
            continue
        assert slices[k] == {"global_shape": list(weights[param].shape)} and t.dtype == torch.float32, (k, slices[k])
        assert live[k].shape == weights[param].shape and torch.equal(t, live[k]), k

    # trainer.json for one process; the rest kept
    before, after = (ckpt.read_json(os.path.join(p, "trainer.json")) for p in (path, out))
    dp, tp, pp, *_ = LAYOUTS[name]
    assert before["world_size"] == dp * tp * pp and len(before["rng"]) == dp * tp * pp
    assert after["world_size"] == 1 and after["rng"] == before["rng"][:1]
    assert after["layout"] == {
        "dp": 1,
        "tp": 1,
        "pp": 1,
        "zero": 0,
        "sequence_parallel": False,
        "schedule": "1f1b",
        "virtual_stages": 1,
    }
    for key in ("step", "consumed_samples", "skipped_steps", "loss_scaler", "model"):
        assert after[key] == before[key], key
    assert after["exported_from"]["layout"] == before["layout"]
    assert Config.from_dict(after["config"]).validate(1).world_size == 1
    assert (
        after["config"]["model"] == before["config"]["model"] and after["config"]["train"] == before["config"]["train"]
    )

    # one process continues from the export exactly as from the original, and as the layout itself did
    from_original = _resume_in_one_process(work, name, path, str(tmp_path / "a"))
    from_export = _resume_in_one_process(work, name, out, str(tmp_path / "b"))
    assert from_export[0] == from_original[0]
    assert from_export[1].keys() == from_original[1].keys()
    for k, w in from_export[1].items():
        assert torch.equal(w, from_original[1][k]), k
    tolerance = 5e-3 if "memory.precision=bf16" in LAYOUTS[name][4] else 1e-5  # bf16: about one ulp
    assert from_export[0] == pytest.approx(layout_losses, rel=tolerance)


def _reload_at(tmp, cache, dp, tp, pp, layout, model, checkpoint):
    cfg = _config(tmp, cache, f"{tmp}/again", f"parallel.tp={tp}", f"parallel.pp={pp}", *layout, *model)
    tr = Trainer(cfg, cfg.validate(dp * tp * pp).build(CPU), quiet=True)
    tr.load_checkpoint(checkpoint)
    return [tr.train_step()["loss"] for _ in range(AFTER)]


def test_the_export_loads_back_at_a_sharded_layout(work, tmp_path):
    """The whole tensors are ordinary pieces: dp=2 x tp=2 with ZeRO-1 resumes from the export as the layout did."""
    name = "dp2-tp2-zero1-sp"
    path, _, layout_losses = saved(work, name)
    out = export_checkpoint(path, str(tmp_path / "single"))
    dp, tp, pp, layout, model = LAYOUTS[name]
    for losses in run_ranks(4, _reload_at, str(tmp_path), str(work / "cache"), dp, tp, pp, layout, model, out):
        assert losses == pytest.approx(layout_losses, rel=1e-5)


@pytest.mark.parametrize("name", ["dp2-tp2-zero1-sp", "pp2-gpt2-tied"])
def test_hf_export_gives_transformers_our_logits(work, tmp_path, name):
    transformers = pytest.importorskip("transformers")
    path, _, _ = saved(work, name)
    out = export_checkpoint(path, str(tmp_path / "hf"), fmt="hf")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer_meta.json"]
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="sdpa"
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours, tokenizer, _ = load_for_inference(path)
    assert hf.config.eos_token_id == tokenizer.eos_id
    assert hf.config.tie_word_embeddings == (name == "pp2-gpt2-tied")
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(tokens)
        got = hf.eval()(tokens).logits
    assert got.shape == expected.shape and (got - expected).abs().max().item() <= 1e-5


def test_an_existing_out_is_refused(work, tmp_path):
    path, _, _ = saved(work, "dp2-zero3")
    out = tmp_path / "taken"
    out.mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        export_checkpoint(path, str(out))
    assert os.listdir(out) == [] and not os.path.exists(f"{out}.tmp")


# ---- the command line ------------------------------------------------------------------------


def trickles(*args):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return run_command([sys.executable, "-m", "trickles", *args], text=True, timeout=300, env=env)


def _one_line_error(r, needle):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr


def test_command_exports_a_runs_newest_checkpoint_in_both_formats(work, tmp_path):
    path, _, _ = saved(work, "pp2-gpt2-tied")
    run = os.path.dirname(os.path.dirname(path))  # the run's out_dir
    r = trickles("checkpoint", "export", run, str(tmp_path / "single"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "single" / "trainer.json").read_text())["exported_from"][
        "checkpoint"
    ] == os.path.abspath(path)
    ckpt.verify(str(tmp_path / "single"))
    r = trickles("checkpoint", "export", path, str(tmp_path / "hf"), "--format", "hf")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "gpt2"
    assert sorted(os.listdir(tmp_path)) == ["hf", "single"]


def _truncate(step):
    with open(step / "optimizer-rank00001.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(step / "optimizer-rank00001.safetensors") // 2)


def _drop_a_rank(step):
    """A rank's pieces missing under a manifest that agrees: the manifest passes, consolidating fails midway."""
    os.remove(step / "optimizer-rank00001.safetensors")
    ckpt.write_manifest(str(step))


@pytest.mark.parametrize(
    "damage,needle",
    [(_truncate, "optimizer-rank00001.safetensors has"), (_drop_a_rank, "it is incomplete")],
    ids=["truncated", "a-rank-missing"],
)
def test_command_refuses_a_damaged_source_and_leaves_nothing(work, tmp_path, damage, needle):
    path, _, _ = saved(work, "dp2-zero3")
    step = tmp_path / "src" / os.path.basename(path)
    shutil.copytree(path, step)
    damage(step)
    out = tmp_path / "out"
    run = trickles if damage is _truncate else cli_here  # one case through a real process
    r = run("checkpoint", "export", str(step), str(out))
    _one_line_error(r, needle)
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_command_refuses_an_existing_out(work, tmp_path):
    path, _, _ = saved(work, "dp2-zero3")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = cli_here("checkpoint", "export", path, str(out), "--format", "hf")  # refused before anything starts
    _one_line_error(r, "already exists; choose another path or delete it")
    assert os.listdir(out) == ["keep.txt"] and sorted(os.listdir(tmp_path)) == ["out"]


def test_consolidated_files_are_cut_at_the_size_limit_and_read_back_whole(tmp_path):
    from trickles.train.pieces import save_pieces, save_whole

    src = tmp_path / "src"
    src.mkdir()
    full = {"a": torch.arange(12.0).view(3, 4), "b": torch.arange(8, dtype=torch.bfloat16), "c": torch.ones(5, 2)}
    # "a" in two row blocks from two ranks, "b" as two flat ranges, "c" whole; a scalar step counter
    save_pieces(
        {
            "a": (full["a"][:2], {"global_shape": [3, 4], "offset": [0, 0], "block_shape": [2, 4]}),
            "b": (full["b"][:3], {"global_shape": [8], "flat_range": [0, 3]}),
            "step": (torch.tensor(7.0), {"global_shape": [], "scalar": True}),
        },
        str(src / "x-rank00000.safetensors"),
    )
    save_pieces(
        {
            "a": (full["a"][2:], {"global_shape": [3, 4], "offset": [2, 0], "block_shape": [1, 4]}),
            "b": (full["b"][3:], {"global_shape": [8], "flat_range": [3, 8]}),
            "c": full["c"],
        },
        str(src / "x-rank00001.safetensors"),
    )
    out = tmp_path / "out"
    out.mkdir()
    files = save_whole(PieceReader(str(src), "x"), str(out), "x", shard_bytes=64)
    assert [os.path.basename(f) for f in files] == [
        "x-rank00000.safetensors",
        "x-rank00000-2.safetensors",
    ]  # a, b: 48 + 16 bytes; c, step: 40 + 4
    back = PieceReader(str(out), "x")
    assert back.keys() == ["a", "b", "c", "step"] and back.is_scalar("step") and back.read("step").item() == 7.0
    for k, t in full.items():
        assert torch.equal(back.read(k), t) and back.read(k).dtype == t.dtype
        assert back.pieces[k][0][1] == {"global_shape": list(t.shape)}  # described whole
