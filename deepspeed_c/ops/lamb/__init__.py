from deepspeed_c._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "FusedLamb": "deepspeed_c.ops.lamb.fused_lamb:FusedLamb",
})
