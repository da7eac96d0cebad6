"""deepspeed_c.monitor: DeepSpeed's monitor package (TensorBoard, CSV, W&B, Comet, Trackio).

`MonitorMaster(config.monitor_config).write_events([(tag, value, step), ...])` writes on rank 0.
"""
from deepspeed_c._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "Monitor": "deepspeed_c.monitor.monitor:Monitor",
    "MonitorMaster": "deepspeed_c.monitor.monitor:MonitorMaster",
    "DeepSpeedMonitorConfig": "deepspeed_c.monitor.config:DeepSpeedMonitorConfig",
    "get_monitor_config": "deepspeed_c.monitor.config:get_monitor_config",
})
