"""The memory-mapped index files: ours are byte for byte the files DeepSpeed's own builder wrote for the same
data (tests/fixtures/data_efficiency/sampler_index, written by make_sampler_fixtures.py), so DeepSpeed's
MMapIndexedDataset reads ours; our reader reads theirs; the sampler's bad inputs name the key and the path."""
from __future__ import annotations

import os

import numpy as np
import pytest

from deepspeed_c.runtime.config.utils import DeepSpeedConfigError
from deepspeed_c.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler
from deepspeed_c.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset
from deepspeed_c.runtime.data_pipeline.data_sampling.utils import (close_mmap_dataset_builder,
                                                                   create_mmap_dataset_builder, find_fit_int_dtype)
from tests.fixtures.data_efficiency import sampler_cases as C


@pytest.mark.parametrize("metric", ["seqlen", "vocabularyrarity"])
def test_our_index_files_equal_deepspeeds_bytes_and_read_back(tmp_path, metric):
    values = C.metric_values()[metric]
    for kind in ("index_to_sample", "index_to_metric"):
        prefix = str(tmp_path / f"{metric}_{kind}")
        builder = create_mmap_dataset_builder(prefix, np.uint16)
        for v in np.unique(values):
            builder.add_item_numpy(np.flatnonzero(values == v) if kind == "index_to_sample" else np.array([v]))
        close_mmap_dataset_builder(builder, prefix)
        theirs = os.path.join(C.INDEX_DIR, f"{metric}_{kind}")
        for ext in (".idx", ".bin"):
            with open(prefix + ext, "rb") as a, open(theirs + ext, "rb") as b:
                assert a.read() == b.read(), (metric, kind, ext)
    ds = MMapIndexedDataset(os.path.join(C.INDEX_DIR, f"{metric}_index_to_sample"))
    uniq = np.unique(values)
    assert len(ds) == len(uniq) and ds.dtype == np.uint16
    for r in (0, len(uniq) // 2, len(uniq) - 1):
        assert ds[r].tolist() == np.flatnonzero(values == uniq[r]).tolist()
    assert [a.tolist() for a in ds[0:2]] == [ds[0].tolist(), ds[1].tolist()]


def test_find_fit_int_dtype():
    assert find_fit_int_dtype(0, 255) == np.uint8 and find_fit_int_dtype(0, 256) == np.uint16
    assert find_fit_int_dtype(0, 2**32) == np.uint64 and find_fit_int_dtype(-1, 127) == np.int8
    assert find_fit_int_dtype(-129, 0) == np.int16


def _cfg(tmp_path, **metric_over):
    cfg = C.data_efficiency_config("value_linear", str(tmp_path / "clusters"))
    cfg["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["seqlen"].update(metric_over)
    return cfg


@pytest.mark.parametrize("over, key", [
    ({"difficulty_type": "ratio"}, "curriculum_metrics.seqlen.difficulty_type"),
    ({"clustering_type": "kmeans"}, "curriculum_metrics.seqlen.clustering_type"),
    ({"schedule_type": "fixed_cubic"}, "curriculum_metrics.seqlen.schedule_type"),
    ({"min_difficulty": 99}, "curriculum_metrics.seqlen.min_difficulty"),
    ({"index_to_metric_path": "/nonexistent/seqlen_index_to_metric"}, "seqlen_index_to_metric.idx does not exist"),
])
def test_bad_sampler_config_names_the_key(tmp_path, over, key):
    with pytest.raises(DeepSpeedConfigError, match=key.replace(".", r"\.")):
        DeepSpeedDataSampler(_cfg(tmp_path, **over), C.SAMPLES, 4, 0, 1, None, 1, 0)


def test_mismatched_index_pair_is_named(tmp_path):
    prefix = str(tmp_path / "x")
    b = create_mmap_dataset_builder(prefix, np.uint16)
    b.add_item_numpy(np.arange(10))
    close_mmap_dataset_builder(b, prefix)
    with open(prefix + ".bin", "wb") as f:
        f.write(b"\0" * 4)
    with pytest.raises(ValueError, match=r"x\.bin is 4 bytes"):
        MMapIndexedDataset(prefix)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"TNTIDX\0\0" + b"\0" * 40)
    with pytest.raises(ValueError, match="bad magic"):
        MMapIndexedDataset(prefix)
