"""DeepSpeed's `get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(dataset, engine, ...)`: the
engine's `data_efficiency.data_sampling.dynamic_batching` section applied to a dataset (importable under
DeepSpeed's path, runtime/data_pipeline/data_sampling/variable_batch_size_and_lr.py; it lives here because it
reads the engine's config, batch sizes, groups and schedulers)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from deepspeed_c.runtime.config.utils import DeepSpeedConfigError
from deepspeed_c.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import (
    _PATH, get_dataloader_and_lr_scheduler_for_variable_batch_size, seqlens_from_metrics)


def get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset: Any, engine: Any, dataset_seqlens: Optional[Sequence[int]] = None,
        dataset_filter_ids: Optional[Sequence[int]] = None, dataloader_collate_fn: Optional[Callable] = None,
        sample_padding_fn: Optional[Callable] = None, batch_seqlens_fn: Optional[Callable] = None):
    """The engine's `dynamic_batching` section applied: -> (dataloader, lr_scheduler, deepspeed_io kwargs)."""
    import torch.distributed as dist

    from deepspeed_c.runtime.pipe.engine import PipelineEngine

    de_config = engine.data_efficiency_config()
    sampling = de_config["data_sampling"]
    batching = sampling["dynamic_batching"]
    if not batching["enabled"]:
        raise ValueError(f"dynamic batching is not enabled in the config ('{_PATH}.enabled')")
    if dataset_seqlens is None:
        if "metrics_path" not in batching:
            raise DeepSpeedConfigError(f"Config key '{_PATH}.metrics_path' is required when dataset_seqlens is not "
                                       "given")
        dataset_seqlens = seqlens_from_metrics(dataset, engine.world_size, engine.global_rank, batching["metrics_path"],
                                               dataloader_collate_fn, batch_seqlens_fn)
    group = engine.data_parallel_group
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    replicas = dist.get_world_size(group) if distributed else 1
    pipeline = isinstance(engine, PipelineEngine)
    return get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset=dataset, dataset_seqlens=dataset_seqlens, max_tokens=batching["max_tokens"],
        effective_batch_size=engine.train_batch_size(), dataset_filter_ids=dataset_filter_ids,
        lr_scaling_method=batching["lr_scaling_method"], min_batch_size=batching["min_batch_size"],
        max_batch_size=batching["max_batch_size"], sequence_picking_order=batching["sequence_picking_order"],
        dataloader_batch_size=engine.train_micro_batch_size_per_gpu(), dataloader_rank=rank,
        dataloader_num_replicas=replicas, dataloader_num_workers=sampling["num_workers"],
        dataloader_collate_fn=dataloader_collate_fn, dataloader_pin_memory=sampling["pin_memory"],
        lr_scheduler_or_optimizer=engine.lr_scheduler or engine.optimizer,
        required_microbatches_of_same_size=pipeline, required_microbatches_of_same_seqlen=pipeline,
        sample_padding_fn=sample_padding_fn, verbose=batching["verbose"], seed=de_config["seed"])
