"""The engine's face of the forward schedules (legacy curriculum, progressive layer drop): DeepSpeed's
attributes and methods over `self.data_schedules` (runtime/data_pipeline/forward_schedules.py)."""
from __future__ import annotations

from typing import Any, Optional

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

    def get_pld_theta(self) -> Optional[float]:
        pld = self.data_schedules.progressive_layer_drop
        return pld.get_theta() if pld is not None else None

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Any) -> None:
        """The function of a `schedule_type: "custom"` curriculum: global_step -> difficulty (a callable, or
        DeepSpeed's {metric_name: function} dict)."""
        self.data_schedules.set_custom_schedule(schedule_func_dict)

    def _data_schedule_kwargs(self, kwargs: dict, training: bool, curriculum: bool = True) -> dict:
        if not training or not self.data_schedules.active:
            return kwargs
        return {**kwargs, **self.data_schedules.forward_kwargs(self.global_steps, curriculum)}
