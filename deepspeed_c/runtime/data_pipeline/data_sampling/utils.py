"""Helpers of the data sampler and analyzer: the smallest integer dtype that holds a range, and the
create/close pair of an index-file builder (one document)."""
from __future__ import annotations

from typing import Any

import numpy as np

from deepspeed_c.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDatasetBuilder


def find_fit_int_dtype(min_value: int, max_value: int) -> Any:
    """The narrowest numpy integer type holding [min_value, max_value] (unsigned when min_value >= 0)."""
    candidates = (np.uint8, np.uint16, np.uint32, np.uint64) if min_value >= 0 else (np.int8, np.int16, np.int32,
                                                                                      np.int64)
    for dtype in candidates:
        info = np.iinfo(dtype)
        if info.min <= min_value and max_value <= info.max:
            return dtype
    return candidates[-1]


def split_index(start: int, end: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) cut into `parts` ranges at DeepSpeed's boundaries (an integer linspace)."""
    bounds = np.linspace(start, end, dtype=int, num=parts + 1)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(parts)]


def create_mmap_dataset_builder(fname: str, dtype: Any) -> MMapIndexedDatasetBuilder:
    return MMapIndexedDatasetBuilder(f"{fname}.bin", dtype=dtype)


def close_mmap_dataset_builder(builder: MMapIndexedDatasetBuilder, fname: str) -> None:
    builder.end_document()
    builder.finalize(f"{fname}.idx")
