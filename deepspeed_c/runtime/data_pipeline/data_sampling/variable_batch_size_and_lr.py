"""Dynamic batching (`data_efficiency.data_sampling.dynamic_batching`, DeepSpeed 0.19.8): batches packed by
token count instead of a fixed number of samples, and the learning rate scaled to each batch's size.

- `batch_by_seqlens` walks the samples (in dataloader order, shuffled by `random.Random(seed)`, or by length),
  leaves out those longer than `max_tokens`, and packs them greedily: each batch is the longest run of the next
  samples that deals, sample by sample round robin, into `effective_batch_size` micro-batches (or one, unless
  `required_microbatches_of_same_size`) that each hold at most `max_tokens` tokens and between `min_batch_size`
  and `max_batch_size` samples. A run with no valid split ends the packing (the rest is dropped), and the
  micro-batches are trimmed to a multiple of `effective_batch_size`. Same batches as DeepSpeed's for the same
  input (tests pin its output).
- `dataloader_for_variable_batch_size`: a DataLoader over the micro-batches (a non-shuffling DistributedSampler
  deals them to the data-parallel ranks), each collated from its samples (padded to the batch's longest sample
  when `required_microbatches_of_same_seqlen`).
- `VariableBatchSizeLR`: wraps a scheduler (or an optimizer: constant LR) and multiplies each step's LR by the
  batch size over `base_batch_size` (`linear`), its square root (`sqrt`) or 1 (`none`).
- `get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(dataset, engine, ...)` reads the section
  from the engine's config and the sequence lengths from the user, from `<metrics_path>/seqlen/` (the
  DataAnalyzer's seqlen_sample_to_metric) or, when those files are missing, from a DataAnalyzer run over the
  dataset with `batch_seqlens_fn`."""
from __future__ import annotations

import logging
import math
import os
import random
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from deepspeed_c.runtime.config.utils import DeepSpeedConfigError

logger = logging.getLogger(__name__)

_PATH = "data_efficiency.data_sampling.dynamic_batching"
ORDERS = ("dataloader", "random", "seqlen")
LR_SCALING = ("linear", "sqrt", "none")


def parse_dynamic_batching(raw: Any) -> dict:
    """DeepSpeed's `dynamic_batching` attributes with its defaults; checked when enabled, naming the key."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise DeepSpeedConfigError(f"Config key '{_PATH}' must be a JSON object (dict), got {raw!r}")
    out = dict(raw)
    out["enabled"] = bool(out.get("enabled", False))
    out["lr_scaling_method"] = str(out.get("lr_scaling_method", "linear"))
    out["min_batch_size"] = out.get("min_batch_size", 1)
    out["max_batch_size"] = out.get("max_batch_size")
    out["sequence_picking_order"] = str(out.get("sequence_picking_order", "dataloader"))
    out["verbose"] = bool(out.get("verbose", False))
    if not out["enabled"]:
        return out
    if "max_tokens" not in out:
        raise DeepSpeedConfigError(f"Config key '{_PATH}.max_tokens' is required when dynamic batching is enabled")
    for key, minimum in (("max_tokens", 1), ("min_batch_size", 0), ("max_batch_size", 1)):
        value = out[key]
        if key == "max_batch_size" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise DeepSpeedConfigError(f"Invalid value {value!r} for config key '{_PATH}.{key}': expected an int >= "
                                       f"{minimum}")
    if out["max_batch_size"] is not None and out["min_batch_size"] > out["max_batch_size"]:
        raise DeepSpeedConfigError(f"Config key '{_PATH}.min_batch_size' ({out['min_batch_size']}) is larger than "
                                   f"'{_PATH}.max_batch_size' ({out['max_batch_size']})")
    if out["lr_scaling_method"].lower() not in LR_SCALING:
        raise DeepSpeedConfigError(f"Invalid value {out['lr_scaling_method']!r} for config key "
                                   f"'{_PATH}.lr_scaling_method': expected one of {', '.join(LR_SCALING)}")
    if out["sequence_picking_order"] not in ORDERS:
        raise DeepSpeedConfigError(f"Invalid value {out['sequence_picking_order']!r} for config key "
                                   f"'{_PATH}.sequence_picking_order': expected one of {', '.join(ORDERS)}")
    return out


# ---- packing -------------------------------------------------------------------------------------------
def _ordered(seqlens: Sequence[int], ids: Optional[Sequence[int]], order: str, seed: Any) -> list[tuple[int, int]]:
    if order not in ORDERS:
        raise ValueError(f"sequence_picking_order must be one of {ORDERS}, got {order!r}")
    ids = list(range(len(seqlens))) if ids is None else [int(i) for i in ids]
    pairs = [(int(seqlens[i]), i) for i in ids]
    if order == "random":
        random.Random(seed).shuffle(pairs)
    elif order == "seqlen":
        pairs.sort()
    return pairs


def _deal(run: list[tuple[int, int]], parts: int) -> list[list[tuple[int, int]]]:
    """Round robin: micro-batch b gets the run's samples b, b + parts, ..."""
    return [run[b::parts] for b in range(parts)]


def _longest_valid_run(pairs: list[tuple[int, int]], start: int, parts: int, max_tokens: int, min_bs: int,
                       max_bs: Optional[int]) -> int:
    """The end of the longest run pairs[start:end] (end - start a multiple of `parts`, end < len(pairs)) whose
    round-robin deal into `parts` micro-batches is valid; `start` when none is. Every step adds one sample to
    each micro-batch, so once a micro-batch is over `max_tokens` or `max_batch_size` every longer run is too."""
    tokens, counts = [0] * parts, 0
    best = start
    end = start
    while end + parts < len(pairs):
        for b in range(parts):
            tokens[b] += pairs[end + b][0]
        end += parts
        counts += 1  # samples in each micro-batch
        if max(tokens) > max_tokens or (max_bs and counts > max_bs):
            break
        if not min_bs or counts >= min_bs:
            best = end
    return best


def batch_by_seqlens(seqlens: Sequence[int], max_tokens: int, sequence_ids_per_mb: Optional[Sequence[int]] = None,
                     min_batch_size: int = 1, max_batch_size: Optional[int] = None,
                     sequence_picking_order: str = "dataloader", effective_batch_size: int = 1,
                     required_microbatches_of_same_size: bool = False, verbose: bool = False, seed: Any = None):
    """-> (microbatch_ids: [(batch_id, [sample ids])], batch_sizes: samples per batch, batch_max_seqlens)."""
    pairs = _ordered(seqlens, sequence_ids_per_mb, sequence_picking_order, seed)
    too_long = [i for n, i in pairs if n > max_tokens]
    if too_long:
        logger.warning("dynamic batching: samples %s left out: longer than max_tokens=%d", too_long, max_tokens)
        pairs = [p for p in pairs if p[0] <= max_tokens]
    parts = effective_batch_size if required_microbatches_of_same_size else 1
    micro: list[list[tuple[int, int]]] = []
    start = 0
    while start < len(pairs):
        end = _longest_valid_run(pairs, start, parts, max_tokens, min_batch_size, max_batch_size)
        if end == start:
            break
        micro += _deal(pairs[start:end], parts)
        start = end
    if len(micro) < effective_batch_size:
        raise ValueError(f"dynamic batching: {len(micro)} micro-batches from {len(pairs)} samples, fewer than "
                         f"effective_batch_size={effective_batch_size} (one per data loader); lower max_tokens or "
                         "min_batch_size")
    micro = micro[:len(micro) - len(micro) % effective_batch_size]
    microbatch_ids, batch_sizes, batch_max_seqlens = [], [], []
    for batch_id, at in enumerate(range(0, len(micro), effective_batch_size)):
        group = micro[at:at + effective_batch_size]
        batch_sizes.append(sum(len(mb) for mb in group))
        batch_max_seqlens.append(max(n for mb in group for n, _ in mb))
        microbatch_ids += [(batch_id, [i for _, i in mb]) for mb in group]
        if verbose:
            logger.info("dynamic batching: batch %d: %d micro-batches, samples %s, tokens %s", batch_id, len(group),
                        [len(mb) for mb in group], [sum(n for n, _ in mb) for mb in group])
    return microbatch_ids, batch_sizes, batch_max_seqlens


def scale_lr(base_batch_size: int, batch_size: int, base_lr: float = 1, method: Optional[str] = "linear") -> float:
    if method == "linear":
        return base_lr * batch_size / base_batch_size
    if method == "sqrt":
        return base_lr * math.sqrt(batch_size / base_batch_size)
    if method is None or method.lower() == "none":
        return base_lr
    raise ValueError(f"Unknown scaling method: {method!r}; expected one of {LR_SCALING}")


# ---- data loader ---------------------------------------------------------------------------------------
def dataloader_for_variable_batch_size(dataset: Any, microbatch_ids: list, batch_max_seqlens: list,
                                       dataloader_rank: int = 0, dataloader_batch_size: int = 1,
                                       dataloader_num_replicas: int = 1, dataloader_collate_fn: Optional[Callable] = None,
                                       dataloader_num_workers: int = 2, dataloader_pin_memory: bool = False,
                                       required_microbatches_of_same_seqlen: bool = False,
                                       sample_padding_fn: Optional[Callable] = None):
    """-> (DataLoader over this rank's micro-batches, the kwargs for engine.deepspeed_io)."""
    if required_microbatches_of_same_seqlen and sample_padding_fn is None:
        raise ValueError("dynamic batching: sample_padding_fn is required with required_microbatches_of_same_seqlen")
    sampler = DistributedSampler(microbatch_ids, num_replicas=dataloader_num_replicas, rank=dataloader_rank,
                                 shuffle=False, drop_last=False)

    def collate(entries: list) -> Any:
        samples = []
        for batch_id, ids in entries:
            data = [dataset[i] for i in ids]
            if required_microbatches_of_same_seqlen:
                data = [sample_padding_fn(s, batch_max_seqlens[batch_id]) for s in data]
            samples += data
        return dataloader_collate_fn(samples) if dataloader_collate_fn else samples

    loader = DataLoader(microbatch_ids, batch_size=dataloader_batch_size, sampler=sampler,
                        num_workers=dataloader_num_workers, collate_fn=collate, pin_memory=dataloader_pin_memory)
    io_kwargs = dict(dataset=microbatch_ids, batch_size=dataloader_batch_size, pin_memory=dataloader_pin_memory,
                     data_sampler=sampler, collate_fn=collate, num_local_io_workers=dataloader_num_workers)
    return loader, io_kwargs


# ---- learning rate -------------------------------------------------------------------------------------
class _ConstantLR:
    """A scheduler that keeps the optimizer's LRs (what VariableBatchSizeLR scales when there is none)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self._last_lr = list(self.base_lrs)
        self.last_epoch = 0

    def get_lr(self) -> list:
        return list(self.base_lrs)

    def get_last_lr(self) -> list:
        return list(self._last_lr)

    def step(self, epoch: Optional[int] = None) -> None:
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        for g, lr in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = lr
        self._last_lr = list(self.base_lrs)

    def state_dict(self) -> dict:
        return {"base_lrs": self.base_lrs, "last_epoch": self.last_epoch, "_last_lr": self._last_lr}

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


class VariableBatchSizeLR(torch.optim.lr_scheduler.LRScheduler):
    """Scales the LR of `lr_scheduler` at every step by the size of the batch that step trains on."""

    def __init__(self, lr_scheduler: Any, base_batch_size: int, batch_sizes: Sequence[int], dataloader: Any,
                 lr_scaling_method: str = "linear", last_epoch: int = -1, verbose: bool = False) -> None:
        # why no super().__init__: torch's would step the optimizer's LRs itself; this one only scales another's
        self.base_lr_scheduler = lr_scheduler
        self.base_batch_size, self.batch_sizes = base_batch_size, list(batch_sizes)
        self.lr_scaling_method, self.dataloader, self.verbose = lr_scaling_method, dataloader, verbose
        self.base_lrs = list(lr_scheduler.get_lr())
        self.last_epoch = last_epoch
        self.step(0)

    @property
    def optimizer(self) -> Any:
        return self.base_lr_scheduler.optimizer

    def get_last_lr(self) -> list:
        return list(self.base_lr_scheduler.get_last_lr())

    def get_lr(self) -> list:
        return [g["lr"] for g in self.optimizer.param_groups]

    def step(self, epoch: Optional[int] = None) -> None:
        # the base scheduler steps from its own (unscaled) LRs; this step's batch size scales them after
        unscaled = self.base_lrs if epoch == 0 else self.get_last_lr()
        for g, lr in zip(self.optimizer.param_groups, unscaled):
            g["lr"] = lr
        self.base_lr_scheduler.step(epoch)
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        batch_size = self.batch_sizes[self.last_epoch % len(self.batch_sizes)]
        for g in self.optimizer.param_groups:
            g["lr"] = scale_lr(self.base_batch_size, batch_size, g["lr"], self.lr_scaling_method)
        if self.verbose:
            logger.info("dynamic batching: batch %d of %d samples (reference %d), lr %s", self.last_epoch, batch_size,
                        self.base_batch_size, self.get_lr())

    def state_dict(self) -> dict:
        return {"base_lr_scheduler": self.base_lr_scheduler.state_dict(), "base_batch_size": self.base_batch_size,
                "lr_scaling_method": self.lr_scaling_method, "batch_sizes": self.batch_sizes,
                "base_lrs": self.base_lrs, "last_epoch": self.last_epoch, "verbose": self.verbose}

    def load_state_dict(self, state: dict) -> None:
        self.base_lr_scheduler.load_state_dict(state["base_lr_scheduler"])
        for key in ("base_batch_size", "lr_scaling_method", "batch_sizes", "base_lrs", "last_epoch", "verbose"):
            setattr(self, key, state[key])


def lr_scheduler_for_variable_batch_size(base_batch_size: int, batch_sizes: Sequence[int], dataloader: Any,
                                         lr_scheduler_or_optimizer: Any, lr_scaling_method: str = "linear",
                                         verbose: bool = False) -> VariableBatchSizeLR:
    """An LR scheduler (anything with .optimizer, .step and .get_last_lr) or an optimizer (anything with
    param_groups)."""
    target = lr_scheduler_or_optimizer
    if all(hasattr(target, a) for a in ("optimizer", "step", "get_lr", "get_last_lr")):
        scheduler = target
    elif hasattr(target, "param_groups"):
        scheduler = _ConstantLR(target)
    else:
        raise ValueError(f"Unknown type for lr_scheduler_or_optimizer: {type(target).__name__} (expected an LR "
                         "scheduler or an optimizer)")
    return VariableBatchSizeLR(scheduler, base_batch_size, batch_sizes, dataloader, lr_scaling_method,
                               verbose=verbose)


def get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset: Any, dataset_seqlens: Sequence[int], max_tokens: int, effective_batch_size: int,
        dataset_filter_ids: Optional[Sequence[int]] = None, lr_scaling_method: str = "linear", min_batch_size: int = 1,
        max_batch_size: Optional[int] = None, sequence_picking_order: str = "dataloader",
        dataloader_batch_size: int = 1, dataloader_rank: int = 0, dataloader_num_replicas: int = 1,
        dataloader_num_workers: int = 0, dataloader_collate_fn: Optional[Callable] = None,
        dataloader_pin_memory: bool = False, lr_scheduler_or_optimizer: Any = None,
        required_microbatches_of_same_size: bool = False, required_microbatches_of_same_seqlen: bool = False,
        sample_padding_fn: Optional[Callable] = None, verbose: bool = False, seed: Any = None):
    """-> (dataloader, lr_scheduler, deepspeed_io kwargs); see batch_by_seqlens."""
    microbatch_ids, batch_sizes, batch_max_seqlens = batch_by_seqlens(
        dataset_seqlens, max_tokens, dataset_filter_ids, min_batch_size, max_batch_size, sequence_picking_order,
        effective_batch_size, required_microbatches_of_same_size, verbose, seed)
    loader, io_kwargs = dataloader_for_variable_batch_size(
        dataset, microbatch_ids, batch_max_seqlens, dataloader_rank, dataloader_batch_size, dataloader_num_replicas,
        dataloader_collate_fn, dataloader_num_workers, dataloader_pin_memory, required_microbatches_of_same_seqlen,
        sample_padding_fn)
    scheduler = lr_scheduler_for_variable_batch_size(effective_batch_size, batch_sizes, loader,
                                                     lr_scheduler_or_optimizer, lr_scaling_method, verbose)
    return loader, scheduler, io_kwargs


def seqlens_from_metrics(dataset: Any, world_size: int, rank: int, metrics_path: str, collate_fn: Optional[Callable],
                         batch_seqlens_fn: Optional[Callable]) -> np.ndarray:
    """The dataset's sequence lengths from the DataAnalyzer's seqlen metric files (written first, by
    `world_size` workers of which this is `rank`, when absent)."""
    from deepspeed_c.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer
    from deepspeed_c.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

    prefix = os.path.join(metrics_path, "seqlen", "seqlen_sample_to_metric")
    if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
        if batch_seqlens_fn is None:
            raise ValueError(f"dynamic batching: {prefix}.idx/.bin not found and no batch_seqlens_fn to compute them "
                             "(give dataset_seqlens, run the DataAnalyzer's seqlen metric into "
                             f"'{_PATH}.metrics_path', or pass batch_seqlens_fn)")
        logger.warning("dynamic batching: %s not found; running the DataAnalyzer's seqlen metric", prefix)
        DataAnalyzer(dataset, num_workers=world_size, worker_id=rank, batch_size=1024,
                     metric_names=["seqlen"], metric_functions=[batch_seqlens_fn],
                     metric_types=["single_value_per_sample"], metric_dtypes=[torch.int64], save_path=metrics_path,
                     collate_fn=collate_fn).run_map_reduce()
    lens = MMapIndexedDataset(prefix)
    if len(lens) != len(dataset):
        raise ValueError(f"dynamic batching: {prefix} has {len(lens)} sequence lengths for a dataset of "
                         f"{len(dataset)} samples (delete '{_PATH}.metrics_path' if the dataset changed)")
    return np.concatenate(lens[0:len(lens)]).astype(np.int64)


def __getattr__(name: str) -> Any:
    # DeepSpeed's engine-taking entry point lives with the engine (runtime/engine/dynamic_batching.py: no
    # function outside the engine takes it); it is importable from here under DeepSpeed's path
    if name == "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed":
        from deepspeed_c.runtime.engine.dynamic_batching import \
            get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed
        return get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
