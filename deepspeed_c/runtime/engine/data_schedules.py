"""The engine's face of the forward schedules (legacy curriculum, progressive layer drop): DeepSpeed's
attributes and methods over `self.data_schedules` (runtime/data_pipeline/forward_schedules.py)."""
from __future__ import annotations

from collections import deque
from typing import Any, Optional

from deepspeed_c.runtime.config.utils import DeepSpeedConfigError
from deepspeed_c.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from deepspeed_c.runtime.data_pipeline.forward_schedules import ForwardSchedules


class EngineDataSchedules:
    data_schedules: ForwardSchedules

    def _configure_data_schedules(self, config: Any) -> None:
        self.data_schedules = ForwardSchedules.from_config(config)

    def curriculum_params_legacy(self) -> Any:
        """DeepSpeed 0.19.6's accessor (gone from 0.19.8's table): the legacy section without `enabled`, or
        False when the config has none."""
        return self._config.curriculum_params_legacy

    @property
    def curriculum_scheduler_legacy(self) -> Any:
        """DeepSpeed 0.19.6's engine attribute: the legacy curriculum's CurriculumScheduler (None when off)."""
        return self.data_schedules.curriculum_scheduler

    @property
    def curriculum_scheduler(self) -> Any:
        return self.data_schedules.curriculum_scheduler

    @property
    def progressive_layer_drop(self) -> Any:
        """DeepSpeed's engine attribute: the ProgressiveLayerDrop (None when off)."""
        return self.data_schedules.progressive_layer_drop

    @property
    def random_ltd_scheduler(self) -> Any:
        """DeepSpeed's engine attribute: the RandomLTDScheduler (None when random-LTD is off)."""
        return self.data_schedules.random_ltd_scheduler

    def data_efficiency_config(self) -> dict:
        return self._config.data_efficiency_config

    def random_ltd_config(self) -> dict:
        return self._config.data_efficiency_config["data_routing"]["random_ltd"]

    def curriculum_learning_config(self) -> dict:
        return self._config.data_efficiency_config["data_sampling"]["curriculum_learning"]

    def random_ltd_initialize(self) -> None:
        """Hands each RandomLayerTokenDrop of the module whose name holds the next id of random_ltd_layer_id
        (in module order, DeepSpeed's matching) the scheduler and its rank; convert_to_random_ltd calls it."""
        if self.data_schedules.random_ltd_scheduler is None:
            raise RuntimeError("random_ltd_initialize: data_efficiency.data_routing.random_ltd.enabled is not set")
        cfg = self.data_schedules.random_ltd_config
        pending = deque(sorted(cfg["random_ltd_layer_id"]))
        count = 0
        for name, layer in self.module.named_modules():
            if isinstance(layer, RandomLayerTokenDrop) and pending and str(pending[0]) in name:
                layer.init_config(cfg, self.data_schedules.random_ltd_scheduler, count)
                pending.popleft()
                count += 1
        if count != cfg["random_ltd_layer_num"]:
            raise DeepSpeedConfigError(
                f"Config key 'data_efficiency.data_routing.random_ltd.random_ltd_layer_id' "
                f"({cfg['random_ltd_layer_id']}): {count} of the model's random-LTD layers matched, "
                f"random_ltd_layer_num is {cfg['random_ltd_layer_num']} (a layer matches when its module name "
                "contains the id)")

    def get_pld_theta(self) -> Optional[float]:
        pld = self.data_schedules.progressive_layer_drop
        return pld.get_theta() if pld is not None else None

    def set_data_post_process_func(self, post_process_func: Any) -> None:
        """fn(batch, sampler_state) -> batch, applied by the training loader to each batch it yields (Megatron-
        DeepSpeed sets it with data-efficiency curriculum learning); without a training loader, nothing."""
        if self.training_dataloader is not None:
            self.training_dataloader.set_post_process_func(post_process_func)

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Any) -> None:
        """The function of a `schedule_type: "custom"` curriculum: global_step -> difficulty. With the
        data-efficiency sampler, DeepSpeed's {metric_name: function} dict goes to its metrics; for the legacy
        seqlen curriculum, a callable (or a one-entry dict)."""
        loader = self.training_dataloader
        if self._config.curriculum_learning_enabled and loader is not None:
            loader.data_sampler.set_custom_curriculum_learning_schedule(schedule_func_dict)
            if not self._config.curriculum_enabled_legacy:
                return
        self.data_schedules.set_custom_schedule(schedule_func_dict)

    def _curriculum_loader(self, dataset: Any, dp_world: int, dp_rank: int, pin_memory: bool,
                           collate_fn: Any) -> Any:
        """The training loader of data_efficiency.data_sampling.curriculum_learning (DeepSpeed's
        DeepSpeedDataLoader with its DeepSpeedDataSampler)."""
        from deepspeed_c.runtime.data_pipeline.data_sampling.curriculum_loader import CurriculumDataLoader
        from deepspeed_c.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler

        cfg = self._config.data_efficiency_config
        group = self.mpu.get_data_parallel_group() if self.mpu is not None else None
        sampler = DeepSpeedDataSampler(cfg, len(dataset), self.train_micro_batch_size_per_gpu(), dp_rank, dp_world,
                                       group, self.gradient_accumulation_steps(), self.global_rank,
                                       drop_last=self.dataloader_drop_last())
        return CurriculumDataLoader(dataset, sampler, pin_memory=pin_memory and self.device.type == "cuda",
                                    tput_timer=self.tput_timer, collate_fn=collate_fn or self.collate_fn,
                                    num_workers=cfg["data_sampling"]["num_workers"])

    def _data_schedule_kwargs(self, kwargs: dict, training: bool, curriculum: bool = True) -> dict:
        if not training or not self.data_schedules.active:
            return kwargs
        return {**kwargs, **self.data_schedules.forward_kwargs(self.global_steps, curriculum)}
