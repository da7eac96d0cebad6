"""DeepSpeed's `deepspeed.runtime.zenflow.zenflow_config` path. The schema lives in the config package
(`deepspeed_c/runtime/config/zenflow.py`), beside the zero section that holds it: here it made an import cycle
(importing this module first entered runtime.config, whose zero section imports ZenFlowConfig back)."""
from deepspeed_c.runtime.config.zenflow import ZENFLOW, ZenFlowConfig, ZenFlowSchedule, resolve_schedule

__all__ = ["ZENFLOW", "ZenFlowConfig", "ZenFlowSchedule", "resolve_schedule"]
