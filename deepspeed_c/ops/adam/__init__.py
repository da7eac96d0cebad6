from deepspeed_c._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "DeepSpeedCPUAdam": "deepspeed_c.ops.adam.cpu_adam:DeepSpeedCPUAdam",
    "FusedAdam": "deepspeed_c.ops.adam.fused_adam:FusedAdam",
    "ZenFlowCPUAdam": "deepspeed_c.ops.adam.zenflow_cpu_adam:ZenFlowCPUAdam",
    "ZenFlowSelectiveAdamW": "deepspeed_c.ops.adam.zenflow_torch_adam:ZenFlowSelectiveAdamW",
    "ZenFlowSelectiveAdamW_stage3": "deepspeed_c.ops.adam.zenflow_torch_adam:ZenFlowSelectiveAdamW_stage3",
})
