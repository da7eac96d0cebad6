"""Monitoring: training metrics to TensorBoard, CSV files, W&B, Comet and Trackio.

    from deepspeed_c.monitor.monitor import MonitorMaster
    monitor = MonitorMaster(ds_config.monitor_config)
    monitor.write_events([("Train/Samples/train_loss", loss, engine.global_samples)])

Events are (tag, value, step) tuples. Only global rank 0 writes; other ranks hold no backend.
A backend is imported only when its section is enabled.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterable, Sequence

from deepspeed_c.monitor.utils import monitor_rank

Event = tuple[str, Any, int]


class Monitor(ABC):
    """A destination for (tag, value, step) events."""

    @abstractmethod
    def __init__(self, monitor_config: Any) -> None:
        self.monitor_config = monitor_config

    @abstractmethod
    def write_events(self, event_list: Sequence[Event]) -> None:
        """Record the events."""

    def update_config(self, config_dict: dict) -> None:
        """Record the run's configuration (backends that can store it override this)."""


class MonitorMaster(Monitor):
    """Fans events out to every enabled backend of a DeepSpeedMonitorConfig (on rank 0)."""

    def __init__(self, monitor_config: Any) -> None:
        super().__init__(monitor_config)
        self.tb_monitor = None
        self.wandb_monitor = None
        self.csv_monitor = None
        self.comet_monitor = None
        self.trackio_monitor = None
        self.enabled = monitor_config.enabled
        if monitor_rank() != 0:
            return
        if monitor_config.tensorboard.enabled:
            from deepspeed_c.monitor.tensorboard import TensorBoardMonitor
            self.tb_monitor = TensorBoardMonitor(monitor_config.tensorboard)
        if monitor_config.wandb.enabled:
            from deepspeed_c.monitor.wandb import WandbMonitor
            self.wandb_monitor = WandbMonitor(monitor_config.wandb)
        if monitor_config.csv_monitor.enabled:
            from deepspeed_c.monitor.csv_monitor import csvMonitor
            self.csv_monitor = csvMonitor(monitor_config.csv_monitor)
        if monitor_config.comet.enabled:
            from deepspeed_c.monitor.comet import CometMonitor
            self.comet_monitor = CometMonitor(monitor_config.comet)
        trackio = getattr(monitor_config, "trackio", None)
        if trackio is not None and trackio.enabled:
            from deepspeed_c.monitor.trackio import TrackioMonitor
            self.trackio_monitor = TrackioMonitor(trackio)

    def _backends(self) -> Iterable[Monitor]:
        for backend in (self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor,
                        self.trackio_monitor):
            if backend is not None:
                yield backend

    def write_events(self, event_list: Sequence[Event]) -> None:
        if monitor_rank() != 0:
            return
        for backend in self._backends():
            backend.write_events(event_list)

    def update_config(self, config_dict: dict) -> None:
        if monitor_rank() != 0:
            return
        for backend in self._backends():
            backend.update_config(config_dict)
