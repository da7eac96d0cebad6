"""Weights & Biases backend (the `wandb` section); needs the wandb package."""
from __future__ import annotations

from typing import Any, Sequence

from deepspeed_c.monitor.monitor import Event, Monitor
from deepspeed_c.monitor.utils import event_value, monitor_rank, require_backend


class WandbMonitor(Monitor):

    def __init__(self, wandb_config: Any) -> None:
        super().__init__(wandb_config)
        self._wandb = require_backend("wandb", "wandb", "wandb")
        self.enabled = wandb_config.enabled
        self.group = wandb_config.group
        self.team = wandb_config.team
        self.project = wandb_config.project
        if self.enabled and monitor_rank() == 0:
            self._wandb.init(project=self.project, group=self.group, entity=self.team)

    def log(self, data: dict, step: int | None = None, commit: bool | None = None):
        if self.enabled and monitor_rank() == 0:
            return self._wandb.log(data, step=step, commit=commit)
        return None

    def write_events(self, event_list: Sequence[Event]) -> None:
        if not self.enabled or monitor_rank() != 0:
            return
        for tag, value, step in event_list:
            self.log({tag: event_value(value)}, step=step)

    def update_config(self, config_dict: dict) -> None:
        if self.enabled and monitor_rank() == 0:
            self._wandb.config.update(config_dict, allow_val_change=True)
