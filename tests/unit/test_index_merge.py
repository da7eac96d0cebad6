"""The DataAnalyzer reduce through the C merge over memory-mapped map files (csrc/core/index_merge.c): on a
synthetic corpus mapped by 2 workers, the index files (sample_to_metric, index_to_sample, index_to_metric,
index_to_sample_percentile_merged) are byte for byte the one-process Python reduce's, and their contents equal a
stable one-process sort of the metric computed directly; signed values with many ties (one radix pass) and 40-bit
values (four passes) both. (tests/unit/test_data_analyzer.py checks the same path against DeepSpeed's own files.)
Bad map files are named."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from deepspeed_c import _C
from deepspeed_c.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer
from deepspeed_c.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

N = 5000
_rng = np.random.default_rng(7)
TABLE = {"difficulty": _rng.integers(-50, 51, N), "rarity": _rng.integers(0, 1 << 40, N)}
TABLE["rarity"][::7] = TABLE["rarity"][3]  # some ties among the large values too
NAMES = sorted(TABLE)
OUTPUTS = ("sample_to_metric", "index_to_sample", "index_to_metric", "index_to_sample_percentile_merged")


class Corpus(torch.utils.data.Dataset):

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def _metric(name: str):
    return lambda batch: torch.from_numpy(TABLE[name][np.asarray(batch)])


def _analyzer(tmp: str, worker: int) -> DataAnalyzer:
    return DataAnalyzer(Corpus(), num_workers=2, worker_id=worker, num_threads=1, num_threads_reduce=3, batch_size=64,
                        metric_names=NAMES, metric_functions=[_metric(n) for n in NAMES],
                        metric_types=["single_value_per_sample"] * len(NAMES), metric_dtypes=[torch.int64] * 2,
                        save_path=tmp)


def _read_all(tmp: str) -> dict[str, bytes]:
    out = {}
    for name in NAMES:
        for f in OUTPUTS:
            for ext in (".idx", ".bin"):
                with open(os.path.join(tmp, name, f"{name}_{f}{ext}"), "rb") as fh:
                    out[f"{name}_{f}{ext}"] = fh.read()
    return out


def test_c_merge_equals_the_python_reduce_and_a_one_process_sort(tmp_path, monkeypatch):
    tmp = str(tmp_path)
    for w in range(2):  # two workers, each its own analyzer (a node in a real run)
        _analyzer(tmp, w).run_map()
    reducer = _analyzer(tmp, 0)
    with monkeypatch.context() as m:  # the C path must be the one taken
        m.setattr(DataAnalyzer, "_reduce_single_python", lambda *a: pytest.fail("took the Python reduce"))
        reducer.run_reduce()
    c_files = _read_all(tmp)
    reducer.reduce_backend = "python"
    reducer.run_reduce()
    assert _read_all(tmp) == c_files
    for name in NAMES:
        values = TABLE[name]
        order = np.argsort(values, kind="stable")
        uniq = np.unique(values)
        prefix = os.path.join(tmp, name, name)
        s2m = MMapIndexedDataset(f"{prefix}_sample_to_metric")
        i2s = MMapIndexedDataset(f"{prefix}_index_to_sample")
        i2m = MMapIndexedDataset(f"{prefix}_index_to_metric")
        merged = MMapIndexedDataset(f"{prefix}_index_to_sample_percentile_merged")
        assert np.array_equal(np.concatenate(s2m[0:len(s2m)]).astype(np.int64), values)
        assert np.array_equal(np.concatenate(i2m[0:len(i2m)]).astype(np.int64), uniq)
        assert len(i2s) == len(uniq)
        assert np.array_equal(np.concatenate(i2s[0:len(i2s)]).astype(np.int64), order)
        for k in (0, len(uniq) // 2, len(uniq) - 1):
            assert np.array_equal(i2s[k].astype(np.int64), np.flatnonzero(values == uniq[k]))
        assert np.array_equal(np.concatenate(merged[0:len(merged)]).astype(np.int64), order)
        assert len(merged) == -(-len(uniq) // max(1, len(uniq) // 100))
        assert s2m.dtype == (np.int8 if name == "difficulty" else np.uint64)


def test_bad_map_files_are_named(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    np.arange(10, dtype=np.int64).tofile(a)
    np.arange(10, dtype=np.int64).tofile(b)
    with pytest.raises(ValueError, match="a.bin holds 10 values but .*b.bin holds 9"):
        _C.index_merge_sort([(str(a), 5, 10)], [(str(b), 5, 9)])
    with pytest.raises(ValueError, match="a.bin: 80 bytes, shorter than the 88"):
        _C.index_merge_sort([(str(a), 5, 11)], [(str(b), 5, 11)])
    with pytest.raises(OSError, match="missing.bin: cannot open"):
        _C.index_merge_sort([(str(tmp_path / "missing.bin"), 5, 10)], [(str(b), 5, 10)])
    with pytest.raises(ValueError, match="unknown dtype code 9"):
        _C.index_merge_sort([(str(a), 9, 10)], [(str(b), 5, 10)])
    merge = _C.index_merge_sort([(str(a), 5, 10)], [(str(b), 5, 10)])
    assert _C.index_merge_info(merge) == (10, 10, 0, 9)
    with pytest.raises(ValueError, match="sample_docs must start at 0"):
        _C.index_merge_write(merge, str(tmp_path / "o"), None, None, None, 1, 1, [1, 10], [0, 10], 1)
