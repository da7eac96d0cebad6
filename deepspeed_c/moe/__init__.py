"""deepspeed.moe: Mixture of Experts (layer.MoE, sharded_moe.TopKGate / MOELayer, experts.Experts,
utils.split_params_into_different_moe_groups_for_optimizer / is_moe_param)."""
