"""DataAnalyzer: map over the corpus in worker processes (2 workers x 2 map processes each), reduce on worker 0,
and the final index files are (a) byte for byte the files the real DeepSpeed analyzer wrote for the same corpus
and layout (tests/fixtures/data_efficiency/analyzer_ref, make_analyzer_fixtures.py) and (b) equal to a
one-process sort of the metric computed here directly; DeepSpeedDataSampler reads them."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from deepspeed_c.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer
from deepspeed_c.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset
from tests.fixtures.data_efficiency import analyzer_cases as A


def _analyze(tmp: str, workers: int, threads: int, reduce_threads: int) -> None:
    data = A.TokenCorpus()
    for w in range(workers):  # each worker is its own analyzer (a node in a real run); threads are processes
        DataAnalyzer(data, num_workers=workers, worker_id=w, num_threads=threads, num_threads_reduce=reduce_threads,
                     **A.analyzer_kwargs(tmp)).run_map()
    DataAnalyzer(data, num_workers=workers, worker_id=0, num_threads=threads, num_threads_reduce=reduce_threads,
                 **A.analyzer_kwargs(tmp)).run_reduce()


@pytest.mark.parametrize("layout", sorted(A.LAYOUTS))
def test_files_equal_deepspeeds_and_a_one_process_sort(tmp_path, layout):
    _analyze(str(tmp_path), *A.LAYOUTS[layout])
    for f in A.FILES:
        for ext in (".idx", ".bin"):
            with open(os.path.join(tmp_path, f + ext), "rb") as a, open(os.path.join(A.REF_DIR, layout, f + ext),
                                                                        "rb") as b:
                assert a.read() == b.read(), (layout, f, ext)
    # the independent reference: the metric over the whole corpus, sorted in one process
    tokens = A.TokenCorpus().tokens
    lengths = (tokens != 0).sum(dim=1).numpy()
    idx_to_sample = MMapIndexedDataset(str(tmp_path / "seqlen" / "seqlen_index_to_sample"))
    idx_to_metric = MMapIndexedDataset(str(tmp_path / "seqlen" / "seqlen_index_to_metric"))
    values = np.unique(lengths)
    assert [int(idx_to_metric[r][0]) for r in range(len(idx_to_metric))] == values.tolist()
    for r, v in enumerate(values):
        assert idx_to_sample[r].tolist() == np.flatnonzero(lengths == v).tolist()
    s2m = MMapIndexedDataset(str(tmp_path / "seqlen" / "seqlen_sample_to_metric"))
    assert [int(s2m[i][0]) for i in range(len(s2m))] == lengths.tolist()
    counts = MMapIndexedDataset(str(tmp_path / "vocab_count" / "vocab_count_metric_value"))[0]
    assert counts.tolist() == torch.bincount(tokens.flatten(), minlength=A.VOCAB).tolist()


def test_sampler_reads_the_analyzer_output(tmp_path):
    from deepspeed_c.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler

    _analyze(str(tmp_path), 1, 1, 1)
    prefix = str(tmp_path / "seqlen" / "seqlen")
    cfg = {"enabled": True, "seed": 1, "data_sampling": {"enabled": True, "num_epochs": 1, "curriculum_learning": {
        "enabled": True, "data_cluster_path": str(tmp_path / "clusters"), "curriculum_metrics": {"seqlen": {
            "index_to_sample_path": prefix + "_index_to_sample", "index_to_metric_path": prefix + "_index_to_metric",
            "difficulty_type": "value", "clustering_type": "schedule_based", "min_difficulty": 8,
            "max_difficulty": A.SEQ, "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}}}}}
    sampler = DeepSpeedDataSampler(cfg, A.SAMPLES, 8, 0, 1, None, 1, 0)
    lengths = (A.TokenCorpus().tokens != 0).sum(dim=1).numpy()
    first = next(iter(sampler))
    assert len(first) == 8 and all(lengths[i] <= 8 for i in first)  # step 1 admits seqlen <= 8 only


def test_bad_metric_type_and_dtype_are_named(tmp_path):
    kw = A.analyzer_kwargs(str(tmp_path))
    with pytest.raises(ValueError, match="metric_type 'per_token'"):
        DataAnalyzer(A.TokenCorpus(), **{**kw, "metric_types": ["per_token", "accumulate_value_over_samples"]})
    kw["metric_dtypes"] = [torch.int32, torch.int64]
    with pytest.raises(TypeError, match="metric 'seqlen' returned torch.int64"):
        DataAnalyzer(A.TokenCorpus(), **kw).run_map()
