"""DataAnalyzer: the offline pass that turns per-sample metrics into the index files DeepSpeedDataSampler
reads. Same constructor and files as DeepSpeed's:

- map (`run_map`): worker `worker_id` of `num_workers` takes its contiguous share of the dataset and splits it
  over `num_threads` processes; each computes every metric over its samples in order (batches of `batch_size`
  through a DataLoader with `collate_fn`) and writes `<save_path>/<metric>/worker<w>_thread<t>/`:
  `single_value_per_sample` metrics: the values in processing order (`<metric>_sample_to_metric`) and the sample
  ids (`<metric>_sample_ids`, ours: DeepSpeed writes per-value csv files instead); `accumulate_value_over_samples`
  metrics: the running sum (`<metric>_metric_value`);
- reduce (`run_reduce`, worker 0 after every worker's map): per single-value metric, the values of every
  worker/thread in order (`<metric>_sample_to_metric`), the sample ids grouped by value ascending, each group in
  worker/thread/processing order (`<metric>_index_to_sample`, a stable sort by value), the values
  (`<metric>_index_to_metric`), and the groups merged about a hundredth of the values at a time
  (`<metric>_index_to_sample_percentile_merged`); per accumulated metric the sum (`<metric>_metric_value`).
  Value and sample-id dtypes are the narrowest integers that hold them (find_fit_int_dtype), as DeepSpeed picks.

The files are DeepSpeed's byte for byte for the same dataset and metrics (checked against the real DeepSpeed's
analyzer), so either side's sampler reads either side's files. The reduce of a single-value metric runs in C
(index_merge.py: the map files memory-mapped, one stable radix sort, the index files written by C); metrics of
several values per sample, or reduce_backend = "python", take the one-process numpy sort, which writes the same
bytes."""
from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, Subset

from deepspeed_c.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset
from deepspeed_c.runtime.data_pipeline.data_sampling.index_merge import merge_single_metric, one_value_per_sample
from deepspeed_c.runtime.data_pipeline.data_sampling.utils import (close_mmap_dataset_builder,
                                                                   create_mmap_dataset_builder, find_fit_int_dtype,
                                                                   split_index)

SINGLE, ACCUMULATE = "single_value_per_sample", "accumulate_value_over_samples"


def _write(prefix: str, dtype: Any, items: Sequence[np.ndarray], chunks: Optional[Sequence[int]] = None) -> None:
    """One index file pair. `chunks`: the item counts of the reduce threads' parts, each closed as a document
    (DeepSpeed's reduce merges per-thread files, so its doc_idx lists every part's end, then the end again)."""
    builder = create_mmap_dataset_builder(prefix, dtype)
    if chunks is None:
        for item in items:
            builder.add_item_numpy(np.asarray(item))
    else:
        at = 0
        for count in chunks:
            for item in items[at:at + count]:
                builder.add_item_numpy(np.asarray(item))
            at += count
            builder.end_document()
    close_mmap_dataset_builder(builder, prefix)


def _write_rows(prefix: str, dtype: Any, batches: Sequence[np.ndarray]) -> None:
    """One item per row of each [rows, values] batch; rows of one value go in one write per batch."""
    builder = create_mmap_dataset_builder(prefix, dtype)
    for batch in batches:
        if batch.shape[1] == 1:
            builder.add_scalar_items_numpy(batch)
        else:
            for row in batch:
                builder.add_item_numpy(row)
    close_mmap_dataset_builder(builder, prefix)


class DataAnalyzer:
    # "c": single-value metrics reduce through the C merge over the memory-mapped map files (index_merge.py);
    # "python": the one-process numpy sort. Both write the same bytes.
    reduce_backend = "c"

    def __init__(self, dataset: Any, num_workers: int = 1, worker_id: int = 0, num_threads: int = 1,
                 num_threads_reduce: int = 1, specific_threads: Sequence[int] = (), batch_size: int = 1,
                 metric_names: Sequence[str] = (), metric_functions: Sequence[Callable] = (),
                 metric_types: Sequence[str] = (), metric_dtypes: Sequence[Any] = (), save_path: str = "./",
                 collate_fn: Optional[Callable] = None, custom_map_init: Any = None, custom_map_update: Any = None,
                 custom_map_finalize: Any = None, custom_reduce: Any = None,
                 sample_indices: Optional[Sequence[int]] = None) -> None:
        if not len(metric_names) == len(metric_functions) == len(metric_types) == len(metric_dtypes):
            raise ValueError("DataAnalyzer: metric_names, metric_functions, metric_types and metric_dtypes must have "
                             f"one entry per metric (got {len(metric_names)}, {len(metric_functions)}, "
                             f"{len(metric_types)}, {len(metric_dtypes)})")
        for name, kind in zip(metric_names, metric_types):
            if kind not in (SINGLE, ACCUMULATE):
                raise ValueError(f"DataAnalyzer: metric {name!r} has metric_type {kind!r}; expected {SINGLE!r} or "
                                 f"{ACCUMULATE!r}")
        if not 0 <= worker_id < num_workers or num_threads < 1 or num_threads_reduce < 1:
            raise ValueError(f"DataAnalyzer: worker_id {worker_id} of num_workers {num_workers}, num_threads "
                             f"{num_threads}, num_threads_reduce {num_threads_reduce}")
        if any(c is not None for c in (custom_map_init, custom_map_update, custom_map_finalize, custom_reduce)):
            raise NotImplementedError("DataAnalyzer: custom_map_init/update/finalize and custom_reduce are not "
                                      "supported by deepspeed_c's analyzer")
        self.dataset = dataset
        self.num_workers, self.worker_id = num_workers, worker_id
        self.num_threads, self.num_threads_reduce = num_threads, num_threads_reduce
        self.specific_threads = list(specific_threads)
        self.batch_size = batch_size
        self.metric_names, self.metric_functions = list(metric_names), list(metric_functions)
        self.metric_types, self.metric_dtypes = list(metric_types), list(metric_dtypes)
        self.save_path = save_path
        self.collate_fn = collate_fn
        self.sample_indices = sample_indices

    # -- map -------------------------------------------------------------------------------------------
    def _thread_dir(self, metric: str, worker: int, thread: int) -> str:
        return os.path.join(self.save_path, metric, f"worker{worker}_thread{thread}")

    def _thread_range(self, thread: int) -> tuple[int, int]:
        lo, hi = split_index(0, len(self.dataset), self.num_workers)[self.worker_id]
        return split_index(lo, hi, self.num_threads)[thread]

    def run_map_helper(self, thread_id: int) -> None:
        start, end = self._thread_range(thread_id)
        subset = Subset(self.dataset, list(range(start, end)))
        loader = DataLoader(subset, batch_sampler=BatchSampler(SequentialSampler(subset), self.batch_size, False),
                            num_workers=0, collate_fn=self.collate_fn)
        values: list[list[np.ndarray]] = [[] for _ in self.metric_names]  # per batch: [rows, values per row]
        ids: list[np.ndarray] = []
        sums: list[Optional[torch.Tensor]] = [None for _ in self.metric_names]
        done = 0
        for data in loader:
            n = 0
            for m, (fn, kind, dtype) in enumerate(zip(self.metric_functions, self.metric_types, self.metric_dtypes)):
                out = fn(data)
                if not (torch.is_tensor(out) or isinstance(out, np.ndarray)) or out.dtype != dtype:
                    raise TypeError(f"DataAnalyzer: metric {self.metric_names[m]!r} returned "
                                    f"{getattr(out, 'dtype', type(out).__name__)}; expected a tensor or array of "
                                    f"metric_dtype {dtype}")
                out = torch.from_numpy(out) if isinstance(out, np.ndarray) else out
                if kind == SINGLE:
                    values[m].append(out.reshape(out.shape[0], -1).numpy())
                    n = out.shape[0]
                else:
                    sums[m] = out.clone() if sums[m] is None else sums[m].add_(out)
            ids.append(self._sample_ids(data, n, start + done))
            done += n if n else len(data)
        for m, (name, kind, dtype) in enumerate(zip(self.metric_names, self.metric_types, self.metric_dtypes)):
            out_dir = self._thread_dir(name, self.worker_id, thread_id)
            os.makedirs(out_dir, exist_ok=True)
            if kind == SINGLE:
                _write_rows(os.path.join(out_dir, f"{name}_sample_to_metric"), _np_dtype(dtype), values[m])
                all_ids = np.concatenate(ids).astype(np.int64) if ids else np.zeros(0, np.int64)
                _write(os.path.join(out_dir, f"{name}_sample_ids"), np.int64, [all_ids])
            elif sums[m] is not None:
                _write(os.path.join(out_dir, f"{name}_metric_value"), _np_dtype(dtype), [sums[m].reshape(-1).numpy()])

    def _sample_ids(self, data: Any, rows: int, position: int) -> np.ndarray:
        """The ids of a batch's `rows` samples, the first at `position` in the dataset."""
        if isinstance(data, dict) and "index" in data:  # Megatron's datasets carry the id
            return np.asarray(data["index"]).reshape(rows, -1)[:, 0].astype(np.int64)
        if self.sample_indices is not None:
            return np.asarray(self.sample_indices[position:position + rows], dtype=np.int64)
        return np.arange(position, position + rows, dtype=np.int64)

    def run_map(self) -> None:
        threads = self.specific_threads or list(range(self.num_threads))
        if self.num_threads == 1:
            self.run_map_helper(0)
            return
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=self.run_map_helper, args=(t, )) for t in threads]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        failed = [t for t, p in zip(threads, procs) if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"DataAnalyzer: map threads {failed} of worker {self.worker_id} failed")

    # -- reduce ----------------------------------------------------------------------------------------
    def _parts(self, name: str, stem: str) -> list[MMapIndexedDataset]:
        parts = []
        for w in range(self.num_workers):
            for t in range(self.num_threads):
                prefix = os.path.join(self._thread_dir(name, w, t), f"{name}_{stem}")
                if not os.path.isfile(prefix + ".idx"):
                    raise FileNotFoundError(f"DataAnalyzer reduce: {prefix}.idx is missing (did worker {w} thread {t} "
                                            "finish its map?)")
                parts.append(MMapIndexedDataset(prefix))
        return parts

    def _reduce_single(self, name: str) -> None:
        value_parts, id_parts = self._parts(name, "sample_to_metric"), self._parts(name, "sample_ids")
        if self.reduce_backend == "c" and one_value_per_sample(value_parts):
            merge_single_metric(name, value_parts, id_parts, os.path.join(self.save_path, name), len(self.dataset),
                                self.num_threads_reduce)
        else:
            self._reduce_single_python(name, value_parts, id_parts)

    def _reduce_single_python(self, name: str, value_parts: list[MMapIndexedDataset],
                              id_parts: list[MMapIndexedDataset]) -> None:
        """The one-process reduce in numpy (the reference of the C merge, and the path for metrics of several
        values per sample)."""
        total = len(self.dataset)
        out = os.path.join(self.save_path, name)
        rows = [np.asarray(part[i]) for part in value_parts for i in range(len(part))]
        # the reduce threads' shares: of the worker/thread files for sample_to_metric, of the values after
        per_file = [len(part) for part in value_parts]
        file_chunks = [sum(per_file[a:b]) for a, b in split_index(0, len(per_file), self.num_threads_reduce)]
        if len(rows) != total:
            raise RuntimeError(f"DataAnalyzer reduce: metric {name!r} has {len(rows)} values for {total} samples")
        flat = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
        value_dtype = find_fit_int_dtype(int(flat.min()), int(flat.max()))
        id_dtype = find_fit_int_dtype(0, total - 1)
        _write(os.path.join(out, f"{name}_sample_to_metric"), value_dtype, [r.astype(np.int64) for r in rows],
               file_chunks)
        # one value per sample from here on (DeepSpeed groups by metric_values[row].item())
        keys = np.array([int(r.reshape(-1)[0]) for r in rows], dtype=np.int64)
        ids = np.concatenate([np.asarray(p[0], dtype=np.int64) for p in id_parts])
        order = np.argsort(keys, kind="stable")
        sorted_keys, sorted_ids = keys[order], ids[order]
        uniq, starts = np.unique(sorted_keys, return_index=True)
        groups = np.split(sorted_ids, starts[1:])
        value_chunks = [b - a for a, b in split_index(0, len(uniq), self.num_threads_reduce)]
        _write(os.path.join(out, f"{name}_index_to_sample"), id_dtype, groups, value_chunks)
        _write(os.path.join(out, f"{name}_index_to_metric"), value_dtype, [np.array([v]) for v in uniq], value_chunks)
        step = max(1, len(groups) // 100)
        merged = [np.concatenate(groups[i:i + step]) for i in range(0, len(groups), step)]
        _write(os.path.join(out, f"{name}_index_to_sample_percentile_merged"), id_dtype, merged)

    def _reduce_accumulate(self, name: str) -> None:
        total = None
        for part in self._parts(name, "metric_value"):
            v = np.copy(part[0]).astype(np.int64)
            total = v if total is None else total + v
        dtype = find_fit_int_dtype(int(total.min()), int(total.max()))
        _write(os.path.join(self.save_path, name, f"{name}_metric_value"), dtype, [total])

    def run_reduce(self) -> None:
        for name, kind in zip(self.metric_names, self.metric_types):
            (self._reduce_single if kind == SINGLE else self._reduce_accumulate)(name)

    def run_map_reduce(self, comm_group: Any = None) -> None:
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        self.run_map()
        if distributed:
            dist.barrier(group=comm_group)
        if self.worker_id == 0:
            self.run_reduce()
        if distributed:
            dist.barrier(group=comm_group)


def _np_dtype(dtype: Any) -> Any:
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).numpy().dtype
    return np.dtype(dtype)
