from deepspeed_c._lazy import lazy_exports as _lazy_exports

# submodules resolve on attribute access, as after DeepSpeed's eager imports
__getattr__, __dir__ = _lazy_exports(__name__, {})
