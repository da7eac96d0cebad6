"""TensorBoard backend: scalars through torch.utils.tensorboard's SummaryWriter.

Event files go to `output_path/job_name` (DeepSpeed's layout; an empty output_path means the
launch directory). Each `write_events` call flushes, so the files are readable while training.
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

from deepspeed_c.monitor.monitor import Event, Monitor
from deepspeed_c.monitor.utils import check_tb_availability, event_value, monitor_rank


class TensorBoardMonitor(Monitor):

    def __init__(self, tensorboard_config: Any) -> None:
        super().__init__(tensorboard_config)
        check_tb_availability()
        self.summary_writer = None
        self.enabled = tensorboard_config.enabled
        self.output_path = tensorboard_config.output_path
        self.job_name = tensorboard_config.job_name
        if self.enabled and monitor_rank() == 0:
            self.get_summary_writer()

    @property
    def log_dir(self) -> str:
        return os.path.join(self.output_path, self.job_name)

    def get_summary_writer(self):
        if self.enabled and monitor_rank() == 0 and self.summary_writer is None:
            from torch.utils.tensorboard import SummaryWriter
            os.makedirs(self.log_dir, exist_ok=True)
            self.summary_writer = SummaryWriter(log_dir=self.log_dir)
        return self.summary_writer

    def write_events(self, event_list: Sequence[Event], flush: bool = True) -> None:
        if not self.enabled or self.summary_writer is None or monitor_rank() != 0:
            return
        for tag, value, step in event_list:
            self.summary_writer.add_scalar(tag, event_value(value), step)
        if flush:
            self.summary_writer.flush()

    def flush(self) -> None:
        if self.summary_writer is not None:
            self.summary_writer.flush()

    def close(self) -> None:
        if self.summary_writer is not None:
            self.summary_writer.close()
            self.summary_writer = None

    def update_config(self, config_dict: dict) -> None:
        if self.summary_writer is not None:
            self.summary_writer.add_text("DeepSpeed/config", json.dumps(config_dict, indent=2, default=str),
                                         global_step=0)
            self.summary_writer.flush()
