"""AutoEP: expert parallelism for Hugging Face MoE models, from the `expert_parallel` config section."""
from deepspeed_c.moe.autoep.layer import AutoEPExperts
from deepspeed_c.moe.autoep.replace import apply_autoep

__all__ = ["AutoEPExperts", "apply_autoep"]
