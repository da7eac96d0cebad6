from deepspeed_c._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "DeepSpeedCPULion": "deepspeed_c.ops.lion.cpu_lion:DeepSpeedCPULion",
    "FusedLion": "deepspeed_c.ops.lion.fused_lion:FusedLion",
})
