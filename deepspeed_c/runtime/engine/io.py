"""The engine's data and checkpoint faces (DeepSpeed's signatures). Checkpointing is a
collaborator (`engine.checkpointer`): each save/load hands it the engine's stateful objects as
CheckpointStates (_checkpoint_states), never the engine itself."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

ROUTE_TRAIN, ROUTE_EVAL, ROUTE_PREDICT, ROUTE_ENCODE = "train", "eval", "predict", "encode"


class EngineIO:
    module: torch.nn.Module
    checkpointer: Any
    stepper: Any

    def deepspeed_io(self, dataset: Any, batch_size: Optional[int] = None, route: str = ROUTE_TRAIN,
                     pin_memory: bool = True, data_sampler: Any = None, collate_fn: Any = None,
                     num_local_io_workers: Optional[int] = None) -> Any:
        from deepspeed_c.runtime.dataloader import DeepSpeedDataLoader

        if not isinstance(dataset, (torch.utils.data.Dataset, torch.utils.data.IterableDataset)):
            raise ValueError("Training data must be a torch Dataset")
        dp_world, dp_rank = self.dp_world_size, self.global_rank
        if self.mpu is not None:
            dp_world, dp_rank = self.mpu.get_data_parallel_world_size(), self.mpu.get_data_parallel_rank()
        if route == ROUTE_TRAIN and data_sampler is None and self.curriculum_learning_enabled():
            return self._curriculum_loader(dataset, dp_world, dp_rank, pin_memory, collate_fn)
        if data_sampler is None and route in (ROUTE_PREDICT, ROUTE_EVAL):
            data_sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=dp_world, rank=dp_rank,
                                                               shuffle=False)
        return DeepSpeedDataLoader(dataset=dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
                                   pin_memory=pin_memory and self.device.type == "cuda",
                                   collate_fn=collate_fn or self.collate_fn, local_rank=self.local_rank,
                                   tput_timer=self.tput_timer if route == ROUTE_TRAIN else None,
                                   num_local_io_workers=num_local_io_workers, data_sampler=data_sampler,
                                   data_parallel_world_size=dp_world, data_parallel_rank=dp_rank,
                                   dataloader_drop_last=self.dataloader_drop_last())

    # -- moving states between devices (DeepSpeed 0.19's offload_states / reload_states) -----------
    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Moves the ZeRO optimizer's states (OffloadStateTypeEnum: optim_states, hp_params, lp_params,
        lp_grads, contiguous_grad_buffer; default all) to host memory until reload_states()."""
        dev = str(getattr(device, "value", device))
        if dev == "none":
            return
        if dev == "nvme":
            raise ValueError("NVMe offload is not supported for offloading states.")
        if dev != "cpu":
            raise ValueError(f"offload_states: device must be 'cpu' (OffloadDeviceEnum.cpu), got {device!r}")
        assert self.stepper is not None, "offload_states needs an optimizer"
        self.stepper.offload_states(include=include, device=dev, pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Moves the states offload_states() moved back to where they were."""
        assert self.stepper is not None, "reload_states needs an optimizer"
        self.stepper.reload_states(non_blocking=non_blocking)

    # -- checkpoints -----------------------------------------------------------------------------
    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict:
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad and (prefix + name) in sd:
                    del sd[prefix + name]
        return sd

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict = {},  # noqa: B006 (DeepSpeed's)
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        if self.checkpointer is None:
            raise NotImplementedError("deepspeed_c: engine.save_checkpoint is not built yet (checkpoint issue)")
        with _tp_full_view(self, "save_checkpoint") as stepper:  # AutoTP: written as the unsharded model's
            return self.checkpointer.save(self._checkpoint_states(stepper), save_dir, tag, client_state, save_latest,
                                          exclude_frozen_parameters)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The model's weights in the model's dtype (16-bit under fp16/bf16), copied to CPU tensors,
        rank 0 writing save_dir/save_filename with torch.save. Below ZeRO-3 every rank holds the whole model, but
        every rank must still call it (a barrier keeps the ranks together, as in DeepSpeed)."""
        import os

        import torch.distributed as dist

        from deepspeed_c.checkpoint.store import torch_save_atomic
        from deepspeed_c.checkpoint.utils import clone_tensors_for_torch_save
        from deepspeed_c.runtime.checkpointing.collective_guard import check_dir_arg, rank_local_step

        # checked on every rank before anything collective: a bad argument raises everywhere
        save_dir = check_dir_arg("save_16bit_model", "save_dir", save_dir)
        if not isinstance(save_filename, str) or not save_filename or os.sep in save_filename:
            raise ValueError(f"save_16bit_model: save_filename must be a plain file name, got {save_filename!r}")
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.zero_optimization_partition_weights():
            if not self.zero_gather_16bit_weights_on_model_save():
                from deepspeed_c.utils.logging import logger

                logger.info("Did not save the model %s because stage3_gather_16bit_weights_on_model_save is "
                            "False", os.path.join(save_dir, save_filename))
                return False
        whole = self._whole_16bit_state(exclude_frozen_parameters)  # collective where weights are split
        # rank 0 writes; a failure there (unwritable directory, full disk) raises on every rank
        with rank_local_step("save_16bit_model (rank 0 writing the file)"):
            if rank == 0:
                state = whole if whole is not None else clone_tensors_for_torch_save(self.module_state_dict(
                    exclude_frozen_parameters=exclude_frozen_parameters))
                os.makedirs(save_dir, exist_ok=True)
                torch_save_atomic(state, os.path.join(save_dir, save_filename))
        return True

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> Optional[dict]:
        """DeepSpeed's: the whole model's weights where they are split over ranks (ZeRO-3, AutoTP, AutoEP experts)
        on rank 0, None on the others; every rank must call it. accelerate's get_state_dict (the Hugging Face
        Trainer's save_model) calls it under AutoTP."""
        import torch.distributed as dist

        whole = self._whole_16bit_state(exclude_frozen_parameters)
        if whole is None:
            raise ValueError("consolidated_16bit_state_dict is only applicable to cases where weights are partitioned, "
                             "including Zero Stage 3 and tensor parallelism.")
        return whole if not dist.is_initialized() or dist.get_rank() == 0 else None

    def _whole_16bit_state(self, exclude_frozen_parameters: bool) -> Optional[dict]:
        """The whole weights (on rank 0 at least) where some are split over ranks, else None (every rank holds
        them). Collective over the ranks that split them."""
        from deepspeed_c.checkpoint.utils import clone_tensors_for_torch_save
        from deepspeed_c.module_inject.tp_state import gathered_state_dict, has_tp_layers
        from deepspeed_c.moe.autoep.whole import split_layers, with_whole_experts

        zero3 = self.zero_optimization_partition_weights()
        if has_tp_layers(self.module):  # AutoTP: gathered over each TP group
            import contextlib

            from deepspeed_c.runtime.zero.partition_parameters import GatheredParameters

            # ZeRO-3 under AutoTP: each rank's TP shards gathered from their data-parallel partitions first
            gathered = GatheredParameters(list(self.module.parameters())) if zero3 else contextlib.nullcontext()
            with gathered:
                return clone_tensors_for_torch_save(gathered_state_dict(self.module, self.module_state_dict(
                    exclude_frozen_parameters=exclude_frozen_parameters)))
        if zero3:
            return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if split_layers(self.module):  # AutoEP: every expert, gathered over each expert-parallel group
            return clone_tensors_for_torch_save(with_whole_experts(self.module, self.module_state_dict(
                exclude_frozen_parameters=exclude_frozen_parameters)))
        return None

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """ZeRO-3: the whole model's 16-bit weights (and persistent buffers) on rank 0's host, one module
        gathered at a time; every rank must call it (empty on the others)."""
        import torch.distributed as dist

        from deepspeed_c.runtime.zero.consolidate import consolidated_16bit_state_dict

        if not self.zero_optimization_partition_weights():
            raise ValueError("this method supports only ZeRO-3 with "
                             "zero_optimization.stage3_gather_16bit_weights_on_model_save")
        rank = dist.get_rank() if dist.is_initialized() else 0
        return consolidated_16bit_state_dict(self.module, rank, exclude_frozen_parameters)

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """The former name of save_16bit_model."""
        return self.save_16bit_model(save_dir, save_filename)

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Optional[Callable] = None) -> Any:
        if self.checkpointer is None:
            raise NotImplementedError("deepspeed_c: engine.load_checkpoint is not built yet (checkpoint issue)")
        with _tp_full_view(self, "load_checkpoint") as stepper:  # AutoTP: read as the unsharded model's, then resliced
            return self.checkpointer.load(self._checkpoint_states(stepper), load_dir, tag, load_module_strict,
                                          load_optimizer_states, load_lr_scheduler_states, load_module_only,
                                          custom_load_fn)

    @property
    def checkpoint_engine(self) -> Any:
        """DeepSpeed's engine.checkpoint_engine: the CheckpointEngine every checkpoint file goes through (built from
        checkpoint.writer; assign a CheckpointEngine subclass to have its create/save/commit/load hooks called)."""
        engine = getattr(self.checkpointer, "checkpoint_engine", None)
        if engine is None:  # the pipeline's checkpointer writes with its own writer only
            from deepspeed_c.runtime.checkpointing.engine_hooks import builtin_engine

            engine = self.__dict__.get("_dsc_pipe_checkpoint_engine")
            if engine is None:
                engine = builtin_engine(getattr(getattr(self.checkpointer, "options", None), "writer", None))
                self.__dict__["_dsc_pipe_checkpoint_engine"] = engine
        return engine

    @checkpoint_engine.setter
    def checkpoint_engine(self, engine: Any) -> None:
        setter = getattr(self.checkpointer, "set_checkpoint_engine", None)
        if setter is None:
            raise NotImplementedError(f"{type(self).__name__}.checkpoint_engine: the pipeline engine's checkpoints are "
                                      "written by its own writer; a user CheckpointEngine is not supported there")
        setter(engine)

    def checkpoint_commit(self) -> bool:
        """checkpoint.writer: waits for the background write of the last save_checkpoint and commits it (its
        manifest, the tag directory moved into place, `latest`); a failed write raises here. Collective: call it
        on every rank. False when no save is pending (or files are written synchronously)."""
        if self.checkpointer is None or not hasattr(self.checkpointer, "commit_pending"):
            return False
        return self.checkpointer.commit_pending()

    def _checkpoint_states(self, stepper: Any = None) -> Any:
        """What the checkpointer saves and restores (runtime/checkpointing/states.py), read now: the batch size
        and, under AutoTP's whole view, the optimizer's tensors may differ from the last save's. `stepper`: the
        optimizer protocol to use instead of the engine's (AutoTP's whole view hands one over)."""
        from deepspeed_c.runtime.checkpointing.states import CheckpointStates

        return CheckpointStates(**self._checkpoint_state_fields(stepper))

    def _checkpoint_model_parallel(self) -> dict:
        """DeepSpeed's checkpoint_mp_rank and mp_world_size: a client mpu's model-parallel rank and size (the
        mp_rank_XX of the file names; 0 and 1 without one). The PipelineEngine's are its grid's."""
        if self.parallel_dims.autotp_sharded and self.zero_optimization_partition_weights():
            # AutoTP at ZeRO-3: each tensor-parallel rank's partitions in files of its own, as DeepSpeed writes them
            return {"mp_rank": self.mpu.get_model_parallel_rank(), "mp_world_size": self.mpu.get_model_parallel_world_size()}
        return {"mp_rank": self.parallel_dims.model_rank, "mp_world_size": self.parallel_dims.model}

    def _checkpoint_state_fields(self, stepper: Any = None) -> dict:
        dp_rank = self.get_data_parallel_rank() if self.dp_world_size > 1 else 0
        stepper = stepper if stepper is not None else self.stepper
        return dict(module=self.module, module_state_dict=self.module_state_dict, stepper=stepper,
                    has_optimizer=self.optimizer is not None, lr_scheduler=self.lr_scheduler, reducer=self.reducer,
                    sparse_names=self.__dict__.get("sparse_names"),
                    train_state=self.train_state, samples_per_step=self.train_batch_size(),
                    dp_world_size=self.dp_world_size, dp_rank=dp_rank, local_rank=int(self.local_rank),
                    **self._checkpoint_model_parallel(),
                    num_experts=self.num_experts if self.has_moe_layers else None,
                    data_loader=self.training_dataloader, data_schedules=self.data_schedules)


def _tp_full_view(engine: Any, what: str) -> Any:
    """AutoTP: the tensor-parallel weights (their masters, Adam's moments, ZeRO 1/2's partitions) whole for the
    duration of a save or load: the checkpoint is the unsharded model's, loadable at any TP degree."""
    import contextlib

    if not engine.parallel_dims.autotp_sharded:
        return contextlib.nullcontext()
    from deepspeed_c.runtime.checkpointing.tensor_parallel import check_supported, full_view

    stage, mpu = engine.zero_optimization_stage(), engine.mpu
    if stage == 3:  # ZeRO-3: each rank's partitions of its tensor-parallel shards, per TP rank (DeepSpeed's layout)
        return contextlib.nullcontext()
    check_supported(mpu.get_model_parallel_world_size(), stage, what)
    return full_view(engine.module, engine.stepper, engine.basic_optimizer, stage, mpu.get_model_parallel_rank())
