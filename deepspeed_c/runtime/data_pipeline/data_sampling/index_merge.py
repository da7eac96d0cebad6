"""The analyzer's reduce of one single-value metric through the C merge (csrc/core/index_merge.c): the map
files of every worker/thread are memory-mapped and sorted by value in one stable radix sort, and the four index
file pairs are written by C. Python only reads the small map indexes, picks the output dtypes
(find_fit_int_dtype, as DeepSpeed does) and the document boundaries (DeepSpeed's per-reduce-thread parts), so the
files are byte for byte the ones the Python reduce (DataAnalyzer._reduce_single_python) writes."""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from deepspeed_c import _C
from deepspeed_c.runtime.data_pipeline.data_sampling.indexed_dataset import (MMapIndexedDataset, data_file_path,
                                                                              dtype_code)
from deepspeed_c.runtime.data_pipeline.data_sampling.utils import find_fit_int_dtype, split_index


def _docs(counts: Sequence[int]) -> list[int]:
    """doc_idx of a file written in parts: 0, each part's end, then the end again (the closing document)."""
    ends = np.cumsum(np.asarray(counts, dtype=np.int64)).tolist() if len(counts) else []
    return [0, *ends, ends[-1] if ends else 0]


def one_value_per_sample(parts: Sequence[MMapIndexedDataset]) -> bool:
    """True when every item of every part is one element stored back to back (what the C merge reads)."""
    for p in parts:
        n = len(p)
        if n and (not bool(np.all(p.sizes == 1)) or int(p.pointers[-1]) != (n - 1) * p.dtype.itemsize
                  or int(p.pointers[0]) != 0):
            return False
    return True


def merge_single_metric(name: str, value_parts: Sequence[MMapIndexedDataset], id_parts: Sequence[MMapIndexedDataset],
                        out_dir: str, total: int, num_threads_reduce: int) -> None:
    """Write `<out_dir>/<name>_{sample_to_metric,index_to_sample,index_to_metric,index_to_sample_percentile_merged}`.
    value_parts[i] holds one value per sample of map file i, id_parts[i] one item with those samples' ids."""
    values, ids = [], []
    for v, i in zip(value_parts, id_parts):
        count = len(v)
        if len(i) != 1 or int(i.sizes[0]) != count:
            raise RuntimeError(f"DataAnalyzer reduce: {i.path} should hold one item of {count} sample ids (as many "
                               f"as {v.path} has values), found {len(i)} items of sizes {i.sizes[:4].tolist()}")
        values.append((data_file_path(v.path), dtype_code(v.dtype), count))
        ids.append((data_file_path(i.path), dtype_code(i.dtype), count))
    merge = _C.index_merge_sort(values, ids)
    samples, unique, lo, hi = _C.index_merge_info(merge)
    if samples != total:
        raise RuntimeError(f"DataAnalyzer reduce: metric {name!r} has {samples} values for {total} samples")
    value_code = dtype_code(find_fit_int_dtype(lo, hi))
    id_code = dtype_code(find_fit_int_dtype(0, total - 1))
    # the reduce threads' shares: of the map files for sample_to_metric, of the distinct values after
    per_file = [len(v) for v in value_parts]
    file_chunks = [sum(per_file[a:b]) for a, b in split_index(0, len(per_file), num_threads_reduce)]
    value_chunks = [b - a for a, b in split_index(0, unique, num_threads_reduce)]
    prefix = os.path.join(out_dir, name)
    _C.index_merge_write(merge, f"{prefix}_sample_to_metric", f"{prefix}_index_to_sample", f"{prefix}_index_to_metric",
                         f"{prefix}_index_to_sample_percentile_merged", value_code, id_code, _docs(file_chunks),
                         _docs(value_chunks), max(1, unique // 100))
