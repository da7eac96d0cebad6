"""DeepNVMe tooling (DeepSpeed's `deepspeed.nvme`): the `dsc_nvme_tune` sweep (deepspeed_c.nvme.tune)."""
from deepspeed_c._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {name: f"deepspeed_c.nvme.tune:{name}" for name in
                                               ("cli_main", "generate_main", "parse_sweep_arguments", "sweep_main")})
