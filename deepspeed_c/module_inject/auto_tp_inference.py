"""AutoTP for inference: the training AutoTP's column/row detection (auto_tp.plan) widened to what
serving needs, then the same LinearLayer / LinearAllreduce replacement.

Added here:
- BERT-style encoders: `intermediate.dense` is column parallel, the `output.dense` that follows the
  attention (BertSelfOutput) and the MLP (BertOutput) row parallel (their `dense` has no column sibling,
  so training AutoTP leaves it alone).
- `injection_policy={Block: ('attn.out_proj', 'mlp.down_proj')}` (DeepSpeed's user policy for models
  AutoTP does not know): inside every instance of Block the named Linears (matched by name suffix) are row
  parallel and every other Linear of the block column parallel.
- T5-style blocks: q/k/v column, o row; wi/wi_0/wi_1 column, wo row; the relative-attention-bias table
  ([buckets, heads]) keeps this rank's heads' columns.
- The word embedding and the LM head split along the vocabulary (vocab_parallel.py), tied or not.
GPT-2's Conv1D layers are handled as the nn.Linear they compute (auto_tp), so GPT-2 is sharded here
although DeepSpeed's AutoTP refuses it; its MLP width (4 * n_embd) is split evenly, width / tp_size
features a rank (any granularity: the width must be divisible by tp_size)."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from deepspeed_c import comm as dist
from deepspeed_c.module_inject import auto_tp
from deepspeed_c.module_inject.vocab_parallel import VocabParallelEmbedding, VocabParallelLMHead

Plan = list[tuple[str, str, Optional[list[int]]]]


def _encoder_rules(model: nn.Module, planned: set[str]) -> Plan:
    """BERT/RoBERTa/ELECTRA-style blocks: intermediate.dense (column), attention/output dense (row)."""
    out: Plan = []
    for name, module in model.named_modules():
        if name in planned or not isinstance(module, nn.Linear) or not name.endswith(".dense"):
            continue
        parent = name[:-len(".dense")]
        if parent.endswith("intermediate"):
            out.append((name, "column", None))
        elif parent.endswith("output"):
            out.append((name, "row", None))
    return out


def policy_plan(model: nn.Module, injection_policy: dict) -> Plan:
    """DeepSpeed's injection_policy: {block class: (row-parallel layer name suffixes, ...)}."""
    out: Plan = []
    cfg = getattr(model, "config", None)
    names = [n for n, _ in model.named_modules()]
    for block_cls, policy in injection_policy.items():
        if not (isinstance(block_cls, type) and issubclass(block_cls, nn.Module)):
            raise ValueError(f"injection_policy: key {block_cls!r} is not a subclass of torch.nn.Module")
        suffixes = (policy,) if isinstance(policy, str) else tuple(policy)
        for suffix in suffixes:
            if not any(n.endswith(suffix) for n in names):
                raise ValueError(f"injection_policy: layer '{suffix}' of {block_cls.__name__} matches no module of "
                                 f"{type(model).__name__}")
        blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, block_cls)]
        if not blocks:
            raise ValueError(f"injection_policy: {type(model).__name__} has no module of class {block_cls.__name__}")
        for prefix, block in blocks:
            for sub, module in block.named_modules():
                if not sub or not auto_tp._linear_like(module):
                    continue
                full = f"{prefix}.{sub}" if prefix else sub
                out_features = module.weight.shape[1] if auto_tp._is_conv1d(module) else module.weight.shape[0]
                if any(sub.endswith(s) or full.endswith(s) for s in suffixes):
                    out.append((full, "row", None))
                else:
                    out.append((full, "column", auto_tp._fused_sizes(sub.rsplit(".", 1)[-1], out_features, cfg)))
    return out


def _t5_rules(model: nn.Module, planned: set[str]) -> Plan:
    """T5-style attention (q, k, v column; o row, beside q) and MLP (wi, wi_0, wi_1 column; wo is a row name)."""
    out: Plan = []
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if name in planned or not isinstance(module, nn.Linear):
            continue
        parent, _, leaf = name.rpartition(".")
        siblings = {n for n, _ in modules[parent].named_children()} if parent in modules else set()
        if leaf in ("q", "k", "v") and "o" in siblings or leaf in ("wi", "wi_0", "wi_1") and "wo" in siblings:
            out.append((name, "column", None))
        elif leaf == "o" and "q" in siblings:
            out.append((name, "row", None))
    return out


def inference_plan(model: nn.Module, injection_policy: Optional[dict] = None) -> Plan:
    if injection_policy:
        return policy_plan(model, injection_policy)
    layers = auto_tp.plan(model)
    layers += _encoder_rules(model, {n for n, _, _ in layers})
    return layers + _t5_rules(model, {n for n, _, _ in layers})


class HeadSlicedEmbedding(nn.Embedding):
    """A per-head table (T5's relative_attention_bias, [buckets, heads]) keeping this rank's heads' columns."""

    def __init__(self, module: nn.Embedding, world: int, rank: int) -> None:
        heads = module.weight.shape[1]
        super().__init__(module.weight.shape[0], heads // world, device="meta")
        self.world, self.rank = world, rank
        self.weight = nn.Parameter(self.shard_of("weight", module.weight.data), requires_grad=False)

    def shard_of(self, key: str, full: torch.Tensor) -> torch.Tensor:
        local = full.shape[1] // self.world
        return full[:, self.rank * local:(self.rank + 1) * local].clone()


def _slice_head_tables(model: nn.Module, tp_size: int, rank: int) -> None:
    for name, module in list(model.named_modules()):
        table = getattr(module, "relative_attention_bias", None)
        if isinstance(table, nn.Embedding) and not isinstance(table, HeadSlicedEmbedding):
            module.relative_attention_bias = HeadSlicedEmbedding(table, tp_size, rank)


def check_heads(model: nn.Module, tp_size: int) -> None:
    cfg = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads"):
        value = getattr(cfg, key, None) if cfg is not None else None
        if isinstance(value, int) and value > 0 and value % tp_size != 0:
            raise ValueError(f"init_inference: tensor_parallel.tp_size={tp_size} does not divide the model's "
                             f"{key}={value}: each rank must hold whole attention heads")


def _embedding_pair(model: nn.Module) -> tuple[Optional[str], Optional[str]]:
    """Qualified names of the word embedding and the LM head (Hugging Face's accessors), when they exist."""
    by_id = {id(m): n for n, m in model.named_modules()}
    emb = head = None
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        try:
            module = fn() if callable(fn) else None
        except (NotImplementedError, AttributeError):
            module = None
        if module is None or id(module) not in by_id:
            continue
        if getter == "get_input_embeddings" and type(module).forward is nn.Embedding.forward \
                and module.max_norm is None:
            emb = by_id[id(module)]
        if getter == "get_output_embeddings" and isinstance(module, nn.Linear):
            head = by_id[id(module)]
    return emb, head


def shard_vocab(model: nn.Module, tp_group: Any) -> list[str]:
    """Replaces the word embedding and the LM head by their vocabulary-parallel forms (sharing one shard
    when tied); returns the names replaced."""
    emb_name, head_name = _embedding_pair(model)
    done: list[str] = []
    shared = None
    if emb_name is not None:
        emb = model.get_submodule(emb_name)
        layer = VocabParallelEmbedding(emb, tp_group, name=emb_name)
        tied = head_name is not None and model.get_submodule(head_name).weight is emb.weight
        shared = layer.weight if tied else None
        # T5: encoder/decoder embed_tokens are other Embedding modules on the same weight: one shard serves all
        for alias, module in list(model.named_modules(remove_duplicate=False)):
            if module is emb or isinstance(module, nn.Embedding) and module.weight is emb.weight:
                auto_tp._set_child(model, alias, layer)
        done.append(emb_name)
    if head_name is not None:
        head = model.get_submodule(head_name)
        auto_tp._set_child(model, head_name, VocabParallelLMHead(head, tp_group, shared=shared, name=head_name))
        done.append(head_name)
    return done


@torch.no_grad()
def shard_for_inference(model: nn.Module, tp_group: Any, injection_policy: Optional[dict] = None) -> nn.Module:
    """Shards `model` in place over `tp_group` (every rank of the group calls it on the same model)."""
    tp_size = dist.get_world_size(tp_group)
    check_heads(model, tp_size)
    layers = inference_plan(model, injection_policy)
    auto_tp.apply_autotp(model, tp_group, layers=layers)
    _slice_head_tables(model, tp_size, dist.get_rank(tp_group))
    shard_vocab(model, tp_group)
    for p in model.parameters():
        p.requires_grad_(False)
    return model
