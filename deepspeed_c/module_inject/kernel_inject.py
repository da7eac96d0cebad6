"""Kernel injection (`replace_with_kernel_inject=True`): the transformer body of a known
architecture is replaced by an InjectedDecoder whose blocks run the fused inference kernels
(CUDA on a GPU, their torch reference on the host). `inject(model, config)` returns the injected
model, or None when the architecture has no kernels (the caller falls back to AutoTP with a
warning naming it).

Architectures: GPT-2 (`gpt2`), the LLaMA family (`llama`, `mistral`, `qwen2`) and Mixtral (`mixtral`: its
mixture-of-experts MLP as module_inject.fused_moe_block).

With tensor parallelism (a group of tp ranks) every rank builds its part of each fused block
(hybrid_tp's Megatron split: its heads, its MLP rows) and the attention-out and MLP-down partial
products are all-reduced over the group before their bias; norms, embeddings and the head stay whole."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from deepspeed_c.module_inject import hybrid_tp
from deepspeed_c.module_inject.fused_block import BlockSpec, FusedDecoderBlock
from deepspeed_c.module_inject.fused_decoder import InjectedDecoder
from deepspeed_c.module_inject.fused_moe_block import FusedMoEDecoderBlock
from deepspeed_c.module_inject.fused_encoder import ENCODER_TYPES, inject_encoder
from deepspeed_c.module_inject.hf_compat import attention_scale, rope_tables, route_beam_reorder

_GPT2_GELUS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True, "gelu": False}


def supported_model_types() -> tuple[str, ...]:
    return tuple(_POLICIES) + ENCODER_TYPES


def _cfg(config: Any, name: str, default: Any) -> Any:
    value = getattr(config, name, default) if config is not None else default
    return default if value is None else value


def _dtype(value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        if value is not None and value not in (torch.float32, torch.float16, torch.bfloat16):
            raise NotImplementedError(f"dtype={value}: the injected kernels run float32, float16 or bfloat16")
        return value
    names = {"fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "fp16": torch.float16,
             "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    key = str(value).replace("torch.", "").lower()
    if key not in names:
        raise NotImplementedError(f"dtype={value!r}: the injected kernels run float32, float16 or bfloat16 "
                                  "(int8/int4 weights: init_inference quantizes the injected blocks after inject)")
    return names[key]


def _tp_size(config: Any) -> int:
    tp = getattr(config, "tensor_parallel", None)
    size = getattr(tp, "tp_size", None) if tp is not None else None
    if size is None and isinstance(tp, dict):
        size = tp.get("tp_size")
    return int(size or _cfg(config, "mp_size", 1) or 1)


def _body_of(model: torch.nn.Module, attr: str) -> tuple[str | None, torch.nn.Module]:
    """(attribute on the wrapper, body); attribute None when `model` is the body itself."""
    body = getattr(model, attr, None)
    return (attr, body) if isinstance(body, torch.nn.Module) else (None, model)


class _Blocks:
    """Makes one architecture's fused blocks: whole, or this rank's part of each over a TP group."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.tp = 1 if group is None else torch.distributed.get_world_size(group)
        self.rank = 0 if group is None else torch.distributed.get_rank(group)

    def spec(self, spec: BlockSpec, ffn: int, arch: str) -> BlockSpec:
        if self.tp == 1:
            return spec
        why = hybrid_tp.check_divisible(spec, ffn, self.tp)
        if why is not None:
            raise ValueError(f"replace_with_kernel_inject=True with tensor_parallel.tp_size={self.tp}: {arch} "
                             f"cannot be split: {why.replace('hybrid_engine.inference_tp_size', 'tp_size')}")
        return hybrid_tp.local_spec(spec, self.tp)

    def make(self, spec: BlockSpec, i: int, scale: float, *args: Any) -> FusedDecoderBlock:
        if self.tp == 1:
            return FusedDecoderBlock(spec, i, scale, *args)
        part = hybrid_tp.shard_args(spec, args, self.rank, self.tp)
        return hybrid_tp.TPFusedDecoderBlock(hybrid_tp.local_spec(spec, self.tp), i, scale, *part, group=self.group)


def _gpt2(body: torch.nn.Module, max_out: int, graphs: bool, mk: _Blocks) -> InjectedDecoder:
    cfg = body.config
    if getattr(cfg, "add_cross_attention", False):
        raise NotImplementedError("kernel injection for GPT-2 with add_cross_attention=True is not built")
    act = getattr(cfg, "activation_function", "gelu_new")
    if act not in _GPT2_GELUS:
        raise NotImplementedError(f"kernel injection for GPT-2 with activation_function={act!r} is not built "
                                  f"(supported: {sorted(_GPT2_GELUS)})")
    if max_out > cfg.n_positions:
        raise ValueError(f"max_out_tokens={max_out} exceeds GPT-2's n_positions={cfg.n_positions} "
                         "(its learned position table has no rows past that)")
    c, nh = cfg.n_embd, cfg.n_head
    d = c // nh
    spec = BlockSpec(hidden=c, n_heads=nh, n_kv=nh, head_dim=d, eps=cfg.layer_norm_epsilon,
                     layer_norm=True, gated_silu=False, gelu_tanh=_GPT2_GELUS[act], rotary=False)
    local = mk.spec(spec, body.h[0].mlp.c_fc.weight.shape[1], "GPT-2")  # Conv1D: [in, out]
    blocks = []
    for i, blk in enumerate(body.h):
        scale = (1.0 / math.sqrt(d)) if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            scale /= float(i + 1)
        a, m = blk.attn, blk.mlp  # Conv1D stores weight [in, out]: transposed to F.linear's [out, in]
        blocks.append(mk.make(
            spec, i, scale, (blk.ln_1.weight, blk.ln_1.bias), (blk.ln_2.weight, blk.ln_2.bias),
            a.c_attn.weight.t(), a.c_attn.bias, a.c_proj.weight.t(), a.c_proj.bias,
            m.c_fc.weight.t(), m.c_fc.bias, m.c_proj.weight.t(), m.c_proj.bias))
    return InjectedDecoder(cfg, local, blocks, {"wte": body.wte, "wpe": body.wpe},
                           (body.ln_f.weight, body.ln_f.bias), None, max_out, graphs)


def _llama_spec(body: torch.nn.Module, max_out: int) -> BlockSpec:
    cfg = body.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"kernel injection with hidden_act={cfg.hidden_act!r} is not built (silu only)")
    window = getattr(cfg, "sliding_window", None)
    uses_window = window is not None and getattr(cfg, "use_sliding_window", True) and (
        "sliding_attention" in (getattr(cfg, "layer_types", None) or ["sliding_attention"]))
    if uses_window and max_out > window:
        raise NotImplementedError(f"max_out_tokens={max_out} exceeds sliding_window={window}: sliding-window "
                                  "attention is not built for kernel injection (use max_out_tokens <= the window)")
    first = body.layers[0].self_attn
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = first.head_dim
    return BlockSpec(hidden=cfg.hidden_size, n_heads=nh, n_kv=nkv, head_dim=d, eps=cfg.rms_norm_eps,
                     layer_norm=False, gated_silu=True, rotary=True)


def _llama_attention(blk: torch.nn.Module) -> tuple:
    """(ln1, ln2, wqkv, bqkv, wo, bo, scale) of a LLaMA-family block."""
    a = blk.self_attn
    bq = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
    bqkv = None if all(b is None for b in bq) else torch.cat([
        b if b is not None else torch.zeros(p.out_features, dtype=p.weight.dtype, device=p.weight.device)
        for b, p in zip(bq, (a.q_proj, a.k_proj, a.v_proj))])
    return ((blk.input_layernorm.weight, None), (blk.post_attention_layernorm.weight, None),
            torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), bqkv, a.o_proj.weight, a.o_proj.bias,
            attention_scale(a, a.head_dim))


def _llama(body: torch.nn.Module, max_out: int, graphs: bool, mk: _Blocks) -> InjectedDecoder:
    spec = _llama_spec(body, max_out)
    local = mk.spec(spec, body.config.intermediate_size, type(body).__name__)
    blocks = []
    for i, blk in enumerate(body.layers):
        m = blk.mlp
        *attn, scale = _llama_attention(blk)
        b1 = None if m.gate_proj.bias is None else torch.cat([m.gate_proj.bias, m.up_proj.bias])
        blocks.append(mk.make(spec, i, scale, *attn, torch.cat([m.gate_proj.weight, m.up_proj.weight]), b1,
                              m.down_proj.weight, m.down_proj.bias))
    return InjectedDecoder(body.config, local, blocks, {"embed_tokens": body.embed_tokens}, (body.norm.weight, None),
                           rope_tables(body, max_out, spec.head_dim), max_out, graphs)


def _mixtral(body: torch.nn.Module, max_out: int, graphs: bool, mk: _Blocks) -> InjectedDecoder:
    """Mixtral: LLaMA attention, a top-k mixture of SiLU-gated experts for the MLP (transformers 5's fused
    expert tensors: experts.gate_up_proj [E, 2F, C], experts.down_proj [E, C, F], router gate.weight [E, C])."""
    if mk.tp > 1:
        raise NotImplementedError("kernel injection of Mixtral with tensor_parallel.tp_size > 1 is not built "
                                  "(for experts over several GPUs use moe.ep_size without kernel injection)")
    spec = _llama_spec(body, max_out)
    blocks = []
    for i, blk in enumerate(body.layers):
        moe = blk.mlp
        experts = getattr(moe, "experts", None)
        if not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
            raise NotImplementedError(f"kernel injection of Mixtral layer {i}: its experts are not transformers 5's "
                                      "fused gate_up_proj / down_proj tensors")
        *attn, scale = _llama_attention(blk)
        blocks.append(FusedMoEDecoderBlock(spec, i, scale, *attn, router=moe.gate.weight,
                                           gate_up=experts.gate_up_proj, down=experts.down_proj,
                                           top_k=int(moe.gate.top_k), norm_topk=True))
    return InjectedDecoder(body.config, spec, blocks, {"embed_tokens": body.embed_tokens}, (body.norm.weight, None),
                           rope_tables(body, max_out, spec.head_dim), max_out, graphs)


# model_type -> (attribute of the body on the *ForCausalLM wrapper, builder)
_POLICIES: dict[str, tuple[str, Callable[[torch.nn.Module, int, bool, _Blocks], InjectedDecoder]]] = {
    "gpt2": ("transformer", _gpt2),
    "llama": ("model", _llama),
    "mistral": ("model", _llama),
    "qwen2": ("model", _llama),
    "mixtral": ("model", _mixtral),
}


_FROM_CONFIG = object()


def inject(model: torch.nn.Module, config: Any, group: Any = None, dtype: Any = _FROM_CONFIG) -> torch.nn.Module | None:
    """Replace `model`'s transformer body by fused blocks; `config` is the parsed inference config
    (read duck-typed: dtype, enable_cuda_graph, max_out_tokens, tensor_parallel.tp_size); `group` the
    tensor-parallel group when tp_size > 1; `dtype` (default: the config's) None keeps the model's dtype
    (the weights are quantized from it afterwards).
    Returns the injected model (the same wrapper object; the new body when `model` was a bare
    body), or None when the architecture has no kernels."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    policy = _cfg(config, "injection_policy", None) or {}
    if model_type in ENCODER_TYPES:  # layer by layer; an injection_policy's keys pick the layer classes
        dtype = _dtype(_cfg(config, "dtype", None) if dtype is _FROM_CONFIG else dtype)
        if _tp_size(config) > 1:
            raise NotImplementedError(f"kernel injection of {model_type} with tensor_parallel.tp_size="
                                      f"{_tp_size(config)} is not built (encoders are injected on one device; "
                                      "AutoTP shards them without injection)")
        return inject_encoder(model, dtype, tuple(policy) or None)
    if model_type not in _POLICIES:
        return None
    tp = _tp_size(config)
    if tp > 1 and (group is None or torch.distributed.get_world_size(group) != tp):
        raise ValueError(f"replace_with_kernel_inject=True with tensor_parallel.tp_size={tp} needs the "
                         "tensor-parallel process group of that size (init_inference makes it)")
    dtype = _dtype(_cfg(config, "dtype", None) if dtype is _FROM_CONFIG else dtype)
    max_out = int(_cfg(config, "max_out_tokens", 1024))
    if max_out < 1:
        raise ValueError(f"max_out_tokens must be positive, got {max_out}")
    graphs = bool(_cfg(config, "enable_cuda_graph", False))
    if dtype is not None:
        model.to(dtype)
    attr, builder = _POLICIES[model_type]
    where, body = _body_of(model, attr)
    with torch.no_grad():
        decoder = builder(body, max_out, graphs, _Blocks(group if tp > 1 else None))
    decoder.to(next(body.parameters()).device)
    if where is None:
        return decoder
    setattr(model, where, decoder)
    route_beam_reorder(model)
    return model
