"""deepspeed_c.utils: logger, data loading helpers, partitioned-state accessors."""
from deepspeed_c._lazy import lazy_exports
from deepspeed_c.utils.logging import logger, log_dist

__getattr__, __dir__ = lazy_exports(__name__, {
    "RepeatingLoader": "deepspeed_c.runtime.dataloader:RepeatingLoader",
    "groups": "deepspeed_c.utils.groups",
    "zero_to_fp32": "deepspeed_c.utils.zero_to_fp32",
})
