"""Comet backend (the `comet` section); needs comet_ml >= 3.41.0.

A metric is sent when `samples_log_interval` samples have passed since it was last sent (the
step of a DeepSpeed event is the engine's global sample count); the first value always goes.
"""
from __future__ import annotations

from typing import Any, Sequence

from deepspeed_c.monitor.monitor import Event, Monitor
from deepspeed_c.monitor.utils import event_value, monitor_rank, require_backend


class EventsLogScheduler:
    """Decides per metric name whether enough samples passed since its last logged value."""

    def __init__(self, samples_log_interval: int) -> None:
        self._samples_log_interval = samples_log_interval
        self._last_logged: dict[str, int] = {}

    def needs_logging(self, name: str, current_sample: int) -> bool:
        last = self._last_logged.get(name)
        if last is None or current_sample - last >= self._samples_log_interval:
            self._last_logged[name] = current_sample
            return True
        return False


class CometMonitor(Monitor):

    def __init__(self, comet_config: Any) -> None:
        super().__init__(comet_config)
        comet_ml = require_backend("comet", "comet_ml", "comet_ml>=3.41.0", min_version="3.41.0")
        self.enabled = comet_config.enabled
        self._samples_log_interval = comet_config.samples_log_interval
        self._experiment = None
        if self.enabled and monitor_rank() == 0:
            self._experiment = comet_ml.start(api_key=comet_config.api_key, project=comet_config.project,
                                              workspace=comet_config.workspace,
                                              experiment_key=comet_config.experiment_key, mode=comet_config.mode,
                                              online=comet_config.online)
            if comet_config.experiment_name is not None:
                self._experiment.set_name(comet_config.experiment_name)
        self._events_log_scheduler = EventsLogScheduler(comet_config.samples_log_interval)

    @property
    def experiment(self):
        return self._experiment

    @property
    def samples_log_interval(self) -> int:
        return self._samples_log_interval

    def write_events(self, event_list: Sequence[Event]) -> None:
        if not self.enabled or self._experiment is None or monitor_rank() != 0:
            return
        for name, value, samples in event_list:
            if self._events_log_scheduler.needs_logging(name, samples):
                self._experiment.log_metric(name, event_value(value), step=samples)

    def update_config(self, config_dict: dict) -> None:
        if self._experiment is not None:
            self._experiment.log_parameters(config_dict)
