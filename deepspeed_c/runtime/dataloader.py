"""RepeatingLoader and DeepSpeedDataLoader, as DeepSpeed's engine builds them for `training_data`.

DeepSpeedDataLoader shards a map-style dataset over data-parallel ranks with a DistributedSampler
(each rank sees len(dataset)/dp_world samples per epoch) and batches them with torch's DataLoader.
Curriculum learning / data-efficiency sampling is not built here. The loader's position in its pass
(state_dict / load_state_dict, runtime/data_position.py) goes into each checkpoint.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator, Optional

from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from deepspeed_c.runtime.data_position import ResumableLoader, SeededRandomSampler

CURRICULUM_LEARNING = "curriculum_learning"


class RepeatingLoader:
    """Wraps an iterable so iteration never ends: when it is exhausted, it is restarted."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            # an empty loader raises StopIteration here too, rather than spinning forever
            return next(self.data_iter)


def _device_count() -> int:
    try:
        from deepspeed_c.accelerator import get_accelerator

        return max(1, int(get_accelerator().device_count()))
    except (ImportError, AttributeError):
        import torch

        return max(1, torch.cuda.device_count())


class DeepSpeedDataLoader(ResumableLoader):
    """DeepSpeed's training data loader.

    local_rank >= 0 (distributed): a DistributedSampler over `data_parallel_world_size` replicas
    at `data_parallel_rank`, `batch_size` samples per rank per batch. local_rank < 0 (one process
    driving every local device): a RandomSampler and batch_size * device_count per batch.
    num_local_io_workers defaults to 2 * device_count DataLoader workers.
    """

    def __init__(self, dataset: Dataset, batch_size: int, pin_memory: bool, local_rank: int, tput_timer: Any,
                 collate_fn: Optional[Callable[[list[Any]], Any]] = None, num_local_io_workers: Optional[int] = None,
                 data_sampler: Any = None, data_parallel_world_size: Optional[int] = None,
                 data_parallel_rank: Optional[int] = None, dataloader_drop_last: bool = False,
                 deepspeed_dataloader_config: Optional[dict[str, Any]] = None) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"DeepSpeedDataLoader: batch_size must be a positive integer, got {batch_size!r}")
        self.deepspeed_dataloader_config = dict(deepspeed_dataloader_config or {})
        if self.deepspeed_dataloader_config.get(CURRICULUM_LEARNING):
            raise NotImplementedError("data_efficiency / curriculum_learning data sampling is not built in "
                                      "deepspeed_c yet; remove the curriculum_learning section")
        self.curriculum_learning_enabled = False
        self.tput_timer = tput_timer
        is_iterable = isinstance(dataset, IterableDataset)
        owns_random_sampler = local_rank < 0 and data_sampler is None and not is_iterable

        if local_rank >= 0:
            if data_sampler is None and not is_iterable:
                data_sampler = DistributedSampler(dataset=dataset, num_replicas=data_parallel_world_size,
                                                  rank=data_parallel_rank)
            device_count = 1
        else:
            if data_sampler is None and not is_iterable:
                data_sampler = SeededRandomSampler(dataset)
            device_count = _device_count()
            batch_size *= device_count

        if num_local_io_workers is None:
            num_local_io_workers = 2 * device_count

        self.num_local_io_workers = num_local_io_workers
        self.data_sampler = data_sampler
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.device_count = device_count
        self.batch_size = batch_size
        self.pin_memory = pin_memory
        self.data: Optional[Iterator[Any]] = None
        self.dataloader: Optional[DataLoader] = None
        self.dataloader_drop_last = dataloader_drop_last
        self.post_process_func: Optional[Callable[..., Any]] = None
        self._init_position(owns_random_sampler, data_parallel_world_size if local_rank >= 0 else 1)

        if data_sampler is not None:
            n = len(data_sampler)
            self.len = n // batch_size if dataloader_drop_last else math.ceil(n / batch_size)
        else:
            self.len = None  # an iterable dataset has no length to shard

    def __iter__(self) -> "DeepSpeedDataLoader":
        self._create_dataloader()
        return self

    def set_post_process_func(self, post_process_func: Optional[Callable[..., Any]]) -> None:
        """DeepSpeed's attribute, kept for its readers: this loader applies no post-processing (DeepSpeed's
        curriculum loader does, see CurriculumDataLoader)."""
        self.post_process_func = post_process_func

    def __len__(self) -> int:
        if self.len is None:
            raise TypeError("DeepSpeedDataLoader over an IterableDataset has no len()")
        return self.len

    def __next__(self) -> Any:
        if self.data is None:
            self._create_dataloader()
        if self.tput_timer:
            self.tput_timer.start()
        batch = next(self.data)  # type: ignore[arg-type]
        self._advance()
        return batch

    def _create_dataloader(self) -> DataLoader:
        kwargs: dict[str, Any] = dict(batch_size=self.batch_size, pin_memory=self.pin_memory,
                                      num_workers=self.num_local_io_workers, drop_last=self.dataloader_drop_last)
        sampler, discard, rng = self._pass_sampler()
        if sampler is not None:
            kwargs["sampler"] = sampler
        if self.collate_fn is not None:
            kwargs["collate_fn"] = self.collate_fn
        self.dataloader = DataLoader(self.dataset, **kwargs)
        self.data = iter(self.dataloader)
        for _ in range(discard):  # a resumed pass over an iterable dataset: its first batches were consumed
            next(self.data)
        if rng is not None:  # a resumed pass: the RNG stays as the checkpoint left it
            import torch

            torch.set_rng_state(rng)
        return self.dataloader
