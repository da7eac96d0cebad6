"""CSV backend: one file per tag under `output_path/job_name`, as DeepSpeed writes them.

The tag "Train/Samples/train_loss" goes to Train_Samples_train_loss.csv (slashes and spaces
become underscores) with the header `step,train_loss` (the tag's last component), then one
`step,value` row per event. A file that already has content is appended to without a second
header, so a resumed run continues the same files.
"""
from __future__ import annotations

import csv
import os
from typing import Any, Sequence

from deepspeed_c.monitor.monitor import Event, Monitor
from deepspeed_c.monitor.utils import event_value, monitor_rank


class csvMonitor(Monitor):  # noqa: N801 - DeepSpeed's class name

    def __init__(self, csv_config: Any) -> None:
        super().__init__(csv_config)
        self.filenames: list[str] = []
        self.enabled = csv_config.enabled
        self.output_path = csv_config.output_path
        self.job_name = csv_config.job_name
        self.log_dir = self.setup_log_dir()

    def setup_log_dir(self) -> str | None:
        if self.enabled and monitor_rank() == 0:
            log_dir = os.path.join(self.output_path, self.job_name)
            os.makedirs(log_dir, exist_ok=True)
            return log_dir
        return None

    @staticmethod
    def file_name(tag: str) -> str:
        return tag.replace("/", "_").replace(" ", "_") + ".csv"

    def write_events(self, event_list: Sequence[Event]) -> None:
        if not self.enabled or self.log_dir is None or monitor_rank() != 0:
            return
        for tag, value, step in event_list:
            header = tag.split("/")[-1]
            filename = self.file_name(tag)
            path = os.path.join(self.log_dir, filename)
            with open(path, "a+", newline="") as fd:
                writer = csv.writer(fd)
                if filename not in self.filenames:
                    self.filenames.append(filename)
                    if fd.tell() == 0:
                        writer.writerow(["step", header])
                writer.writerow([step, event_value(value)])

    def update_config(self, config_dict: dict) -> None:
        if not self.enabled or self.log_dir is None or monitor_rank() != 0:
            return
        with open(os.path.join(self.log_dir, "deepspeed_config.csv"), "w", newline="") as fd:
            writer = csv.writer(fd)
            writer.writerow(["key", "value"])
            for key, value in config_dict.items():
                writer.writerow([key, value])
