"""Trackio backend (the `trackio` section); needs the trackio package."""
from __future__ import annotations

from typing import Any, Sequence

from deepspeed_c.monitor.monitor import Event, Monitor
from deepspeed_c.monitor.utils import event_value, monitor_rank, require_backend


class TrackioMonitor(Monitor):

    def __init__(self, trackio_config: Any) -> None:
        super().__init__(trackio_config)
        self._trackio = require_backend("trackio", "trackio", "trackio")
        self.enabled = trackio_config.enabled
        self.project = trackio_config.project
        if self.enabled and monitor_rank() == 0:
            self._trackio.init(project=self.project)

    def log(self, data: dict, step: int | None = None):
        if self.enabled and monitor_rank() == 0:
            return self._trackio.log(data, step=step)
        return None

    def write_events(self, event_list: Sequence[Event]) -> None:
        if not self.enabled or monitor_rank() != 0:
            return
        for tag, value, step in event_list:
            self.log({tag: event_value(value)}, step=step)
