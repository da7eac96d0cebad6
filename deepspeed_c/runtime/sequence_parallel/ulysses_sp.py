"""deepspeed.runtime.sequence_parallel.ulysses_sp: Arctic Long Sequence Training (ALST) for Hugging Face models.

`UlyssesSPAttentionHF.register_with_transformers(...)` swaps the model's core attention function in
transformers' ALL_ATTENTION_FUNCTIONS (under its own name, so every other branch transformers takes
for that implementation still runs) for a Ulysses wrapper: each rank holds a contiguous slice of the
sequence, q/k/v are all-to-all'ed to whole-sequence / heads-per-rank, the original attention runs
causally (attention masks are dropped: a 4-D mask of the whole sequence is O(n^2), and the one
transformers built covers only the local slice; the global position_ids are all-gathered instead),
and the output is all-to-all'ed back. `UlyssesSPDataLoaderAdapter` cuts each batch's sequence into
those slices and turns labels into `shift_labels` first, so no slice boundary loses a target.

Sequence lengths: a batch whose length is not a multiple of the sequence-parallel size raises
ValueError (as DeepSpeed does: pad the batch in the collator); lengths may change between batches
(seq_length_is_variable=True, the default). The loss is the caller's: each rank has the logits of
its slice. With deepspeed_c's engine (as with DeepSpeed's) gradients are summed over the ranks of a
sequence-parallel group and averaged over data-parallel replicas, so the per-rank loss whose
gradients add up to the whole sequence's mean-token loss is sum(token losses of the slice) /
(non-ignored tokens of the whole sequence) -- e.g. `model.loss_function(logits=..., labels=None,
shift_labels=..., vocab_size=..., num_items_in_batch=<count all-reduced over the SP group>)`.
"""
from __future__ import annotations

import importlib.metadata
from collections import deque
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from deepspeed_c import comm as dist
from deepspeed_c.runtime.sequence_parallel.tiled_compute import (  # noqa: F401 (DeepSpeed's names live here)
    SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute)
from deepspeed_c.sequence.layer import _SeqAllToAll

_TRANSFORMERS_MIN = "4.51.3"
_UNSUPPORTED = ("eager", "paged|eager")


class UlyssesSPAttentionHF(torch.nn.Module):
    """Ulysses around a transformers attention function `attn(module, q, k, v, mask, **kw)` whose
    q/k/v are [batch, heads, local_seq, head_dim]; returns ([batch, local_seq, heads * head_dim], weights).

    Query heads must divide by the group size; key/value heads must divide it or be divided by it
    (fewer kv heads than ranks: each kv head is replicated to the ranks whose query heads use it)."""

    def __init__(self, attn: Any, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group: Any, seq_length_is_variable: bool = False,
                 local_seq_length: Optional[int] = None, global_seq_length: Optional[int] = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.sp_rank = dist.get_rank(process_group)
        self.batch_size = batch_size
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length
        self.disable_in_eval = disable_in_eval
        self.attn_head_size = attn_head_size
        self.attn_head_count = attn_head_count
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.core_attn_implementation: Optional[str] = None  # set by register_with_transformers
        have = importlib.metadata.version("transformers")
        if _version_tuple(have) < _version_tuple(_TRANSFORMERS_MIN):
            raise ValueError(f"transformers>={_TRANSFORMERS_MIN} is required, but you have transformers=={have}")
        if attn_head_count % self.world_size != 0:
            raise ValueError(f"Attention head count {attn_head_count} is not divisible by SP size {self.world_size}")
        if not (kv_head_count % self.world_size == 0 or self.world_size % kv_head_count == 0):
            raise ValueError(f"KV attention head count {kv_head_count} is not divisible by SP size {self.world_size} "
                             "or vice versa")
        if not seq_length_is_variable and (local_seq_length is None or global_seq_length is None):
            raise ValueError("seq_length_is_variable=False needs local_seq_length and global_seq_length")
        self.local_q_head_count = attn_head_count // self.world_size
        self.kv_replication_factor = max(1, self.world_size // kv_head_count)
        self.local_kv_head_count = max(1, kv_head_count // self.world_size)

    def _check_shapes(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        for name, t, heads in (("query", query, self.attn_head_count), ("key", key, self.global_kv_head_count),
                               ("value", value, self.global_kv_head_count)):
            want = (self.batch_size, heads, self.local_seq_length, self.attn_head_size)
            if t.dim() != 4 or tuple(t.shape) != want:
                raise ValueError(f"[{dist.get_rank()}]: UlyssesSPAttentionHF: {name} has shape {tuple(t.shape)}, "
                                 f"expected [batch, heads, local_seq, head_dim] = {want} (micro_batch_size, head "
                                 "counts and sequence length as given to register_with_transformers)")

    def _gather_positions(self, kwargs: dict) -> None:
        if kwargs.get("position_ids") is None:
            raise ValueError("Ulysses SP requires position_ids in every forward() call: after the all-to-all each "
                             "rank sees the whole sequence, and local positions [0..chunk_len-1] from every rank "
                             "would look like packed sequences. Use UlyssesSPDataLoaderAdapter (it shards the "
                             "batch's position_ids) or pass position_ids = the token's global position.")
        pos = kwargs["position_ids"].contiguous()
        parts = [torch.empty_like(pos) for _ in range(self.world_size)]
        dist.all_gather(parts, pos, group=self.process_group)
        kwargs["position_ids"] = torch.cat(parts, dim=-1)

    def forward(self, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        if self.seq_length_is_variable:
            self.local_seq_length = query.shape[2]
            self.global_seq_length = self.local_seq_length * self.world_size
        self._check_shapes(query, key, value)
        self._gather_positions(kwargs)
        if self.kv_replication_factor > 1:  # fewer kv heads than ranks: each rank needs the kv head of its q heads
            key = key.repeat_interleave(self.kv_replication_factor, dim=1)
            value = value.repeat_interleave(self.kv_replication_factor, dim=1)
        group = self.process_group
        # [b, h, s_l, d] -> [b, s_l, h, d] -> all-to-all (heads scattered, sequence gathered) -> [b, h/P, s, d]
        q, k, v = (_SeqAllToAll.apply(group, t.transpose(1, 2), 2, 1).transpose(1, 2).contiguous()
                   for t in (query, key, value))
        if getattr(module, "num_key_value_groups", None) is not None:
            # local q heads per local kv head (changes only when kv heads were replicated)
            module = _LocalHeadsView(module, q.shape[1] // k.shape[1])
        context, weights = self.attn(module, q, k, v, attention_mask, *args, **kwargs)  # [b, s, h/P, d]
        if tuple(context.shape[:3]) != (self.batch_size, self.global_seq_length, self.local_q_head_count):
            raise ValueError(f"UlyssesSPAttentionHF: the core attention returned shape {tuple(context.shape)}, "
                             "expected [batch, seq, heads/P, head_dim] = "
                             f"({self.batch_size}, {self.global_seq_length}, {self.local_q_head_count}, "
                             f"{self.attn_head_size})")
        out = _SeqAllToAll.apply(group, context.contiguous(), 1, 2)  # [b, s_l, h, d]
        return out.reshape(*out.shape[:2], -1), weights

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: Optional[int] = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: Optional[int] = None) -> Any:
        """Installs Ulysses in transformers' `core_attn_implementation` ("sdpa" or a flash attention variant)
        and returns the mpu (parallel_state_sp); None when sequence_parallel_size is 1.

        model_name_or_path: a model (anything with `.config`, e.g. a PEFT wrapper), a model name or local
        path (read with AutoConfig.from_pretrained), or -- a deepspeed_c addition -- a PretrainedConfig."""
        if sequence_parallel_size == 1:
            return None
        if max_length is not None:
            from deepspeed_c.utils.logging import logger

            logger.warning("The 'max_length` argument is deprecated and will be eventually removed, please use "
                           "`seq_length` instead")
            seq_length = max_length if seq_length is None else seq_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("Either `seq_length_is_variable` needs to be `True` or `seq_length` needs to be set to an "
                             "integer value of the fixed batch size length.")
        config, loaded = _hf_config(model_name_or_path)
        if loaded:  # a loaded model resolved its implementation: the one intercepted must be the one it calls
            have = getattr(config, "_attn_implementation", None)
            if have is not None and have != core_attn_implementation:
                raise ValueError(f"core_attn_implementation='{core_attn_implementation}' does not match model config "
                                 f"attn_implementation='{have}'. Set both to the same value so the sequence-parallel "
                                 "wrapper can intercept the active attention path.")
        if core_attn_implementation in _UNSUPPORTED:
            raise ValueError(f"{core_attn_implementation} attn_implementation isn't supported by Ulysses sequence "
                             "parallelism: it needs a 4D attention_mask of the whole sequence (O(n^2) memory). Use "
                             "'sdpa' or a flash attention variant.")
        if core_attn_implementation == "flex_attention":
            raise NotImplementedError("deepspeed_c: core_attn_implementation='flex_attention' with Ulysses is not "
                                      "built (its BlockMask would have to be rebuilt for the whole sequence); use "
                                      "'sdpa' or a flash attention variant")
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"{core_attn_implementation} is not a valid attn_implementation. The choices are "
                             f"{ALL_ATTENTION_FUNCTIONS.valid_keys()}")
        from deepspeed_c.runtime.sequence_parallel import parallel_state_sp as mpu

        mpu.initialize_sequence_parallel(sequence_parallel_size=sequence_parallel_size)
        core = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
        core = _WRAPPED_CORE.get(core, core)  # registering again wraps the original, not the wrapper
        arch = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = arch.num_attention_heads
        local = None if seq_length_is_variable else seq_length // sequence_parallel_size
        uattn = cls(attn=core, batch_size=micro_batch_size, attn_head_count=heads,
                    attn_head_size=getattr(arch, "head_dim", None) or arch.hidden_size // heads,
                    kv_head_count=getattr(arch, "num_key_value_heads", None) or heads,
                    num_hidden_layers=arch.num_hidden_layers, process_group=mpu.get_sequence_parallel_group(),
                    seq_length_is_variable=seq_length_is_variable, local_seq_length=local,
                    global_seq_length=None if seq_length_is_variable else seq_length, disable_in_eval=disable_in_eval)
        uattn.core_attn_implementation = core_attn_implementation

        def uattn_wrapper(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                          *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
            # the mask transformers built covers the local slice only: causality comes from is_causal instead
            return uattn(module, query, key, value, None, *args, **kwargs)

        _WRAPPED_CORE[uattn_wrapper] = core
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = uattn_wrapper
        return mpu


# register_with_transformers' wrappers -> the core attention each wraps
_WRAPPED_CORE: dict[Any, Any] = {}


class _LocalHeadsView:
    """The attention module as the core attention sees it after the all-to-all: the module itself, except
    that num_key_value_groups counts this rank's q heads per local kv head (the module is not changed)."""

    def __init__(self, module: torch.nn.Module, num_key_value_groups: int) -> None:
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _version_tuple(v: str) -> tuple:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def _hf_config(model_name_or_path: Any) -> tuple[Any, bool]:
    """(config, whether it came from a loaded model)."""
    from transformers import PretrainedConfig

    if isinstance(model_name_or_path, PretrainedConfig):
        return model_name_or_path, False
    if hasattr(model_name_or_path, "config"):
        return model_name_or_path.config, True
    if isinstance(model_name_or_path, str):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_name_or_path), False
    raise TypeError(f"model_name_or_path must be a model (with .config), a transformers config, or a model name / "
                    f"path string, got {type(model_name_or_path).__name__}")


class UlyssesSPDataLoaderAdapter:
    """Wraps a DataLoader for Ulysses: each refill takes one batch from every rank of the
    sequence-parallel group, and the next sp iterations give every rank its slice of batch 0, then
    of batch 1, ... (so the group processes each rank's batch in turn; len() is len(dl) * sp).

    Batches are dicts with input_ids, position_ids and labels of shape [batch, seq, ...]; every
    tensor is cut along dimension 1, non-tensors are copied. labels become shift_labels (labels
    shifted left by one, -100 at the end) before cutting, so the last token of a slice still has
    the next slice's first token as its target. The slices come back on the CPU (as DeepSpeed's do).
    Lengths may differ between ranks' batches and between batches; each must be a multiple of the
    sequence-parallel size (ValueError otherwise: pad in the collator)."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> dict:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts on the next call
            raise
        if not isinstance(batch, dict):
            raise TypeError(f"UlyssesSPDataLoaderAdapter expects dict batches (input_ids, position_ids, labels), got "
                            f"{type(batch).__name__}")
        for key in ("input_ids", "position_ids", "labels"):
            if key not in batch:
                raise ValueError(f"Ulysses SP requires `{key}` in every dataloader batch (for position_ids: each "
                                 "token's global position, torch.arange(seq_len) per sample for unpacked sequences, "
                                 "restarting at document boundaries for packed ones)")
        seqlen = batch["input_ids"].shape[1]
        for key, value in batch.items():
            if torch.is_tensor(value) and (value.dim() < 2 or value.shape[1] != seqlen):
                raise ValueError(f"{key}'s shape {tuple(value.shape)} must match input_ids's shape "
                                 f"{tuple(batch['input_ids'].shape)} in dimensions 0-1")
        # variable shapes across ranks: objects carry their own shapes (tensors go as CPU tensors)
        cpu = {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in batch.items()}
        everyone: list = [None] * self.sp_world_size
        dist.all_gather_object(everyone, cpu, group=self.sp_group)
        for full in everyone:
            self.micro_batches.append(self._slice(full))

    def _slice(self, full: dict) -> dict:
        seq = full["input_ids"].shape[1]
        if seq % self.sp_world_size != 0:
            raise ValueError(f"batch's seqlen={seq} isn't divisible by sp-size={self.sp_world_size}")
        chunk = seq // self.sp_world_size
        out = dict(full)
        labels = out.pop("labels")
        out["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        lo = chunk * self.sp_rank
        return {k: (v[:, lo:lo + chunk].contiguous() if torch.is_tensor(v) else v) for k, v in out.items()}
