from deepspeed_c._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "DeepSpeedCPUAdagrad": "deepspeed_c.ops.adagrad.cpu_adagrad:DeepSpeedCPUAdagrad",
})
