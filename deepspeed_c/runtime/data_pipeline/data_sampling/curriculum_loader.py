"""The training data loader of the data-efficiency curriculum (data_efficiency.data_sampling.curriculum_learning
on): DeepSpeed's DeepSpeedDataLoader in that mode, a torch DataLoader whose batch_sampler is the
DeepSpeedDataSampler (each rank's micro-batch of sample indices, the global order drawn by rank 0).

Its state (state_dict / load_state_dict) is the sampler's, under the model-states file's `data_sampler` key as
DeepSpeed saves it. The sampler runs in this process and DataLoader workers prefetch batches from it, so a
checkpoint taken with `data_sampling.num_workers` > 0 records a position a few batches ahead of training
(DeepSpeed's loader has the same limit); with 0 (the default) a resume continues with the identical order."""
from __future__ import annotations

from typing import Any, Callable, Optional

from torch.utils.data import DataLoader, Dataset

from deepspeed_c.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler


class CurriculumDataLoader:

    def __init__(self, dataset: Dataset, sampler: DeepSpeedDataSampler, pin_memory: bool, tput_timer: Any,
                 collate_fn: Optional[Callable] = None, num_workers: int = 0) -> None:
        self.dataset = dataset
        self.data_sampler = sampler
        self.batch_size = sampler.micro_batch_size
        self.pin_memory = pin_memory
        self.tput_timer = tput_timer
        self.collate_fn = collate_fn
        self.num_local_io_workers = num_workers
        self.curriculum_learning_enabled = True
        self.post_process_func: Optional[Callable[[Any, dict], Any]] = None
        self.dataloader: Optional[DataLoader] = None
        self.data_iterator: Optional[Any] = None
        self.len = len(sampler) // self.batch_size

    def __len__(self) -> int:
        return self.len

    def set_post_process_func(self, post_process_func: Optional[Callable[[Any, dict], Any]]) -> None:
        """fn(batch, sampler_state) -> batch, applied to every batch this loader yields (None: none)."""
        self.post_process_func = post_process_func

    def __iter__(self) -> "CurriculumDataLoader":
        self._create_dataloader()
        return self

    def __next__(self) -> Any:
        if self.data_iterator is None:
            self._create_dataloader()
        if self.tput_timer:
            self.tput_timer.start()
        data = next(self.data_iterator)
        if self.post_process_func is not None:
            data = self.post_process_func(data, self.data_sampler.state_dict())
        return data

    def _create_dataloader(self) -> DataLoader:
        kwargs: dict[str, Any] = dict(pin_memory=self.pin_memory, batch_sampler=self.data_sampler,
                                      num_workers=self.num_local_io_workers)
        if self.collate_fn is not None:
            kwargs["collate_fn"] = self.collate_fn
        self.dataloader = DataLoader(self.dataset, **kwargs)
        self.data_iterator = iter(self.dataloader)
        return self.dataloader

    def state_dict(self) -> dict:
        return self.data_sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.data_sampler.load_state_dict(state)
        self.data_iterator = None  # the next batch comes from the restored position
