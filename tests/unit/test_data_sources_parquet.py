"""Columnar sources: parquet files (a glob of them too) and directories written by ``datasets``' ``save_to_disk`` read
the same documents as JSONL does -- the same tokens, so the same training batches -- and every way they can be wrong
is refused in one line that says what to change, before any process starts (:func:`trickles.data.check_source`)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from trickles.data import ByteTokenizer, DataConfig, ShardedBatches, check_source, iter_documents, load_corpus
from trickles.data.sources import source_fingerprint
from trickles.errors import DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")
datasets.disable_progress_bars()  # (its "Saving the dataset" bars)

TEXTS = [f"def f{i}(x):\n    return x * {i}  # Grüße {'ü' * (i % 5)}\n" for i in range(120)]


def _cfg(tmp_path, source, **kw) -> DataConfig:
    kw.setdefault("val_fraction", 0.1)
    return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), seq_len=16, **kw)


def _jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def _parquet(path, texts, field="text", row_group_size=None):
    pq.write_table(pa.table({"id": list(range(len(texts))), field: texts}), path, row_group_size=row_group_size)
    return path


def _batches(corpus, dp_rank=0, dp_size=1):
    data = ShardedBatches(corpus.train, 16, seed=3, dp_rank=dp_rank, dp_size=dp_size)
    return [t for step in range(3) for batch in data.micro_batches(step * 8, 8, 4) for t in batch]


@pytest.mark.parametrize("max_bytes", [None, 2000])
def test_parquet_glob_and_saved_dataset_give_the_jsonl_tokens_and_batches(tmp_path, max_bytes):
    tok = ByteTokenizer()
    reference = load_corpus(_cfg(tmp_path, _jsonl(tmp_path / "a.jsonl", TEXTS), max_bytes=max_bytes), tok)
    (tmp_path / "parts").mkdir()
    _parquet(tmp_path / "parts" / "0.parquet", TEXTS[:50], row_group_size=7)  # several row groups
    _parquet(tmp_path / "parts" / "1.parquet", TEXTS[50:])
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": TEXTS}), "test": datasets.Dataset.from_dict({"text": ["x"]})}
    ).save_to_disk(str(tmp_path / "splits"))
    for source, kw in (
        (_parquet(tmp_path / "one.parquet", TEXTS, field="body"), {"text_field": "body"}),
        (tmp_path / "parts" / "*.parquet", {}),
        (tmp_path / "saved", {}),
        (tmp_path / "splits", {}),  # a DatasetDict: data.dataset_split (train) is read
    ):
        cfg = _cfg(tmp_path, source, max_bytes=max_bytes, **kw)
        check_source(cfg)
        assert list(iter_documents(cfg)) == list(
            iter_documents(_cfg(tmp_path, tmp_path / "a.jsonl", max_bytes=max_bytes))
        )
        corpus = load_corpus(cfg, tok)
        assert np.array_equal(corpus.train, reference.train) and np.array_equal(corpus.val, reference.val), source
        assert (corpus.documents, corpus.bytes) == (reference.documents, reference.bytes)
        for a, b in zip(_batches(corpus), _batches(reference)):
            assert a.equal(b)
    test = _cfg(tmp_path, tmp_path / "splits", dataset_split="test")
    assert list(iter_documents(test)) == ["x"]


def test_a_saved_dataset_is_fingerprinted_by_its_files_and_split(tmp_path):
    """A dataset saved again with other rows (same directory) is tokenized again, not read from the old cache."""
    path = str(tmp_path / "saved")
    datasets.Dataset.from_dict({"text": TEXTS[:10]}).save_to_disk(path)
    first = source_fingerprint(_cfg(tmp_path, path))
    assert source_fingerprint(_cfg(tmp_path, path, dataset_split="other")) != first
    datasets.Dataset.from_dict({"text": TEXTS[:20]}).save_to_disk(path + ".new")
    import shutil

    shutil.rmtree(path)
    shutil.move(path + ".new", path)
    assert source_fingerprint(_cfg(tmp_path, path)) != first
    assert len(load_corpus(_cfg(tmp_path, path, val_fraction=0.0), ByteTokenizer()).train) == sum(
        len(t.encode()) + 1 for t in TEXTS[:20]
    )


def _one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)


def test_bad_columnar_sources_are_refused_in_one_line(tmp_path):
    with pytest.raises(DataError) as e:  # the column is absent: the line names the columns there are
        check_source(_cfg(tmp_path, _parquet(tmp_path / "a.parquet", TEXTS, field="body")))
    _one_line(e, "no column 'text'", "id, body", "data.text_field")
    datasets.Dataset.from_dict({"content": TEXTS}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError) as e:
        check_source(_cfg(tmp_path, tmp_path / "saved"))
    _one_line(e, "no column 'text'", "content")
    pq.write_table(pa.table({"text": ["fine", None]}), tmp_path / "null.parquet")  # a row without text
    with pytest.raises(DataError) as e:
        list(iter_documents(_cfg(tmp_path, tmp_path / "null.parquet")))
    _one_line(e, "null.parquet: row 2", "not text")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError) as e:
        check_source(_cfg(tmp_path, tmp_path / "bad.parquet"))
    _one_line(e, "bad.parquet", "not a readable parquet file")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError) as e:  # a directory that datasets did not write
        check_source(_cfg(tmp_path, tmp_path / "plain"))
    _one_line(e, "not one written by datasets' save_to_disk")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError) as e:
        check_source(_cfg(tmp_path, tmp_path / "dd", dataset_split="validation"))
    _one_line(e, "holds the splits train, not 'validation'", "data.dataset_split")


@pytest.mark.parametrize("module", ["pyarrow.parquet", "datasets"])
def test_without_the_data_extra_the_line_says_what_to_install(tmp_path, monkeypatch, module):
    source = _parquet(tmp_path / "a.parquet", TEXTS) if module != "datasets" else tmp_path / "saved"
    if module == "datasets":
        datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(source))
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if the package were not installed
    with pytest.raises(DataError) as e:
        check_source(_cfg(tmp_path, source))
    _one_line(e, f"needs the {module.split('.')[0]} package", "pip install 'trickles[data]'")
