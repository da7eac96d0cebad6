"""The 1-bit optimizers (DeepSpeed's deepspeed.runtime.fp16.onebit): OnebitAdam, ZeroOneAdam,
OnebitLamb. They compress their momentum exchange after a warm-up and do their own
communication; the engine builds them from the config's "OneBitAdam" / "ZeroOneAdam" /
"OneBitLamb" (factory.py) at ZeRO stage 0."""

from deepspeed_c._lazy import lazy_exports as _lazy_exports

__getattr__, __dir__ = _lazy_exports(__name__, {
    "OnebitAdam": "deepspeed_c.runtime.fp16.onebit.adam:OnebitAdam",
    "OnebitLamb": "deepspeed_c.runtime.fp16.onebit.lamb:OnebitLamb",
    "ZeroOneAdam": "deepspeed_c.runtime.fp16.onebit.zoadam:ZeroOneAdam",
})
