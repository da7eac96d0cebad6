"""deepspeed.moe: Mixture of Experts (layer.MoE, sharded_moe.TopKGate / MOELayer, experts.Experts,
utils.split_params_into_different_moe_groups_for_optimizer / is_moe_param)."""
from deepspeed_c._lazy import lazy_exports

# Submodules resolve as attributes, as after DeepSpeed's eager imports: scripts import only
# `deepspeed.moe.utils` and then build `deepspeed.moe.layer.MoE(...)`.
__getattr__, __dir__ = lazy_exports(__name__, {})
