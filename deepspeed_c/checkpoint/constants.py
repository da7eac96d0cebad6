"""The key and file names of DeepSpeed 0.19.8's checkpoints (deepspeed.checkpoint.constants): the names
its files and its universal checkpoint layout use, so code written against DeepSpeed's module reads the
same names from deepspeed_c."""
from __future__ import annotations

# the ZeRO optimizer files
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
FP32_GROUPS = "fp32_groups"
FP32_FLAT_GROUPS = "fp32_flat_groups"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
BASE_OPTIMIZER_STATE_STEP = "base_optimizer_state_step"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
PARAM_GROUPS = "param_groups"
GROUP_PADDINGS = "group_paddings"
PARTITION_COUNT = "partition_count"
ZERO_STAGE = "zero_stage"
CLIP_GRAD = "clip_grad"
FP32_WEIGHT_KEY = "fp32"
LOSS_SCALER = "loss_scaler"

# the model-states files
PARAM = "param"
PARAM_SHAPES = "param_shapes"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"

# file names
MODEL_FILE_PREFIX = "mp_rank_"
ZERO_FILE_PREFIX = "zero_pp_rank_"
OPTIM_FILE_SUFFIX = "_optim_states.pt"
MODEL_FILE_SUFFIX = "_model_states.pt"
LAYER_FILE_PREFIX = "layer_"
BF16_ZERO_FILE_PREFIX = "bf16_" + ZERO_FILE_PREFIX
FP16_ZERO_FILE_PREFIX = "fp16_" + ZERO_FILE_PREFIX

# parallel dimensions and versions
CHECKPOINT_PARALLEL_DIMS = "checkpoint_parallel_dimensions"
CHECKPOINT_PP_DEGREE = "pp_degree"
CHECKPOINT_TP_DEGREE = "tp_degree"
DS_VERSION = "ds_version"

# universal checkpoints
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
UNIVERSAL_CHECKPOINT_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_CHECKPOINT_VERSION_VALUE = 0.4
VOCAB_TENSOR = "vocab_tensor"
PADDED_VOCAB_SIZE = "padded_vocab_size"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"
CAT_DIM = "cat_dim"
PARAM_N_SUB_PARAMS = "param_n_sub_params"
SUB_PARAM_SHAPE = "sub_param_shape"
VOCABULARY_PARAMETER_PATTERNS = "vocabulary_parameter_patterns"
PIPELINE_REPLICATED_PARAMETER_PATTERNS = "pipeline_replicated_parameter_patterns"
PARAMETER_TO_AVERAGE_PATTERNS = "parameter_to_average_patterns"
PARAMETER_WITH_ROW_PARALLELISM_PATTERNS = "parameter_with_row_parallelism_patterns"
TP_REPLICATED_PARAMETER_PATTERNS = "tp_replicated_parameter_patterns"
PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0 = "parameter_with_2_sub_params_cat_dim_0"
PARAMETER_WITH_SUB_PARAMS = "parameter_with_sub_params"
SUB_PARAM_SHARD_WIDTHS = "sub_param_shard_widths"
SUB_PARAMS_SHAPE = "sub_params_shape"

# the universal layout on disk (deepspeed_c's names for DeepSpeed's fixed strings)
UNIVERSAL_ZERO_FOLDER = "zero"
UNIVERSAL_OPTIMIZER_STATE_FILE = "optimizer_state.pt"
UNIVERSAL_LATEST = "latest_universal"
UNIVERSAL_STEP = "step"

# key names DeepSpeed 0.19.8's format reserves for AutoTP/AutoEP universal metadata, the affine shard maps
# and folding metadata (deepspeed_c writes none of them; exported so code importing them runs)
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"
DS_AUTOTP_UC_META = "ds_autotp_universal_checkpoint_meta"
AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS = "autotp_unsupported_parameter_patterns"
AFFINE_MAP, AFFINE_MAP_VERSION, AFFINE_MAP_PARAMS = "affine_map", "version", "params"
AUTOEP_LAYERS_KEY, AUTOEP_LAYERS_KEY_LEGACY = "ds_autoep_layers", "autoep_layers"
AUTOEP_EXPERT_KEY_PREFIX = "expert_key_prefix"
AUTOEP_NUM_EXPERTS, AUTOEP_NUM_LOCAL_EXPERTS, AUTOEP_EP_SIZE = "num_experts", "num_local_experts", "ep_size"
AUTOEP_EXPERT_PLACEMENT, AUTOEP_AFFINE_MAPS = "expert_placement", "affine_maps"
DS_AUTOEP_UC_META = "ds_autoep_uc_meta"
AUTOEP_PARAM_LOGICAL_SHAPE, AUTOEP_PARAM_EP_RANK, AUTOEP_PARAM_LOCAL_EXPERTS = "logical_shape", "ep_rank", "local_experts"
AUTOEP_ZERO12_REQUIRED_FIELDS = (AUTOEP_EXPERT_KEY_PREFIX, AUTOEP_NUM_EXPERTS, AUTOEP_NUM_LOCAL_EXPERTS, AUTOEP_EP_SIZE)
AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY = "checkpoint_format"
AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT = "zero3_partitioned"
AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION_KEY, AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION = "checkpoint_format_version", 1
AUTOEP_PLACEMENT_VERSION_KEY, AUTOEP_PLACEMENT_VERSION = "version", 1
AUTOEP_PLACEMENT_NUM_EXPERTS, AUTOEP_PLACEMENT_EP_SIZE = "num_experts", "ep_size"
AUTOEP_PLACEMENT_RANKS, AUTOEP_PLACEMENT_RANK, AUTOEP_PLACEMENT_EXPERTS = "ranks", "rank", "experts"
EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS = "is_expert_param", "ep_num_experts"
EXPERT_PARAMETER_PATTERNS = "expert_parameter_patterns"
FOLDING_METADATA_KEY, FOLDING_METADATA_VERSION = "folding", 1
FOLDING_TP_SIZE, FOLDING_TP_RANK = "tp_size", "tp_rank"
FOLDING_EP_SIZE, FOLDING_EP_RANK = "ep_size", "ep_rank"
FOLDING_ETP_SIZE, FOLDING_ETP_RANK = "etp_size", "etp_rank"
FOLDING_ZERO_PARTITION_GROUP = "zero_partition_group"
FOLDING_ZERO_PARTITION_RANK = "zero_partition_rank"
FOLDING_ZERO_PARTITION_COUNT = "zero_partition_count"
FOLDING_DISPATCH_STRATEGY, FOLDING_SHARED_EXPERT_PLACEMENT = "dispatch_strategy", "shared_expert_placement"
FOLDING_FAMILY, FOLDING_PARAM_FAMILIES = "family", "param_families"
