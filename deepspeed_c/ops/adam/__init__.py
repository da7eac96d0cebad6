from deepspeed_c._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "DeepSpeedCPUAdam": "deepspeed_c.ops.adam.cpu_adam:DeepSpeedCPUAdam",
    "FusedAdam": "deepspeed_c.ops.adam.fused_adam:FusedAdam",
})
