"""The injected decoder body: takes the place of an HF model's transformer body (GPT2Model's
`transformer`, LlamaModel's `model`) and keeps its call signature and output, so the HF wrapper
around it (LM head, `generate()`, `pipeline`) runs unchanged.

It owns the KV cache ([layers, 2, B, Hkv, max_out_tokens, D]) instead of HF's cache: the
`past_key_values` it returns is a small handle (`InjectedCache`) reporting the cached length,
which generate() hands back on the next step. A call without our live handle starts a new
sequence; a handle from an older sequence raises. With `enable_cuda_graph` the one-token decode
step on a GPU is captured once per batch size and replayed with new inputs copied into static
buffers (the kernels read the past length from a device int, so one graph serves every step)."""
from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

try:  # transformers >= 4.36 (Mixtral's release); only MoE models, which need a newer one anyway, return it
    from transformers.modeling_outputs import MoeModelOutputWithPast
except ImportError:  # pragma: no cover - transformers 4.35
    MoeModelOutputWithPast = None

from deepspeed_c.module_inject.fused_block import BlockSpec, FusedDecoderBlock, StepContext
from deepspeed_c.module_inject.fused_moe_block import FusedMoEDecoderBlock
from deepspeed_c.ops.transformer.inference import kernels as K


class InjectedCache:
    """What generate() carries between steps: our decoder and the length it has cached."""

    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "InjectedDecoder", epoch: int, length: int) -> None:
        self.owner, self.epoch, self.length = owner, epoch, length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def __len__(self) -> int:
        return len(self.owner.layers)

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers 4.x reads the past length as `past_key_values[0][0].shape[2]` (legacy tuples of
        [B, H, S, D] keys and values): layer `layer`'s cached keys and values as views of that shape."""
        cache = self.owner._cache
        if cache is None or self.epoch != self.owner._epoch or self.length != self.owner._past:
            raise ValueError("this injected-kernel cache handle belongs to an earlier sequence")
        kv = cache[layer, :, :, :, :self.length]
        return kv[0], kv[1]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: batch row i continues from row beam_idx[i]."""
        self.owner._reorder(self, beam_idx)


class InjectedDecoder(torch.nn.Module):
    def __init__(self, hf_config: Any, spec: BlockSpec, blocks: list[FusedDecoderBlock],
                 embeddings: dict[str, torch.nn.Module], final_norm: tuple, rope: tuple | None,
                 max_out_tokens: int, enable_cuda_graph: bool) -> None:
        super().__init__()
        self.config = hf_config
        self.spec = spec
        self._embed_names = list(embeddings)
        for name, module in embeddings.items():  # HF's names (wte/wpe, embed_tokens): tied heads keep working
            setattr(self, name, module)
        self.layers = torch.nn.ModuleList(blocks)
        self.norm_w = torch.nn.Parameter(final_norm[0].detach().clone(), requires_grad=False)
        self.norm_b = None if final_norm[1] is None else \
            torch.nn.Parameter(final_norm[1].detach().clone(), requires_grad=False)
        self.max_out_tokens = int(max_out_tokens)
        self.enable_cuda_graph = bool(enable_cuda_graph)
        # fp32 rotary tables kept off the module's buffers so model.to(bf16) leaves them fp32
        self._rope_host = rope
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._cache: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._past_dev: torch.Tensor | None = None
        self._past = 0
        self._epoch = 0
        self._graphs: dict[int, dict[str, Any]] = {}

    # --- HF accessors -----------------------------------------------------------------------
    def get_input_embeddings(self) -> torch.nn.Module:
        return getattr(self, self._embed_names[0])

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        setattr(self, self._embed_names[0], value)

    # --- state ------------------------------------------------------------------------------
    def _prepare_state(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        s = self.spec
        shape = (len(self.layers), 2, batch, s.n_kv, self.max_out_tokens, s.head_dim)
        c = self._cache
        if c is None or c.shape != shape or c.dtype != dtype or c.device != device:
            self._cache = None
            self._graphs.clear()  # graphs hold the old cache's addresses
            # normal tensors even when the first call runs under inference_mode (a pipeline), so later
            # calls outside it may still update them in place
            with torch.inference_mode(False):
                self._cache = torch.zeros(shape, dtype=dtype, device=device)
                self._mask = torch.ones(batch, self.max_out_tokens, dtype=torch.int32, device=device)
                self._past_dev = torch.zeros(1, dtype=torch.int32, device=device)
        if self._rope_host is not None and (self._rope is None or self._rope[0].device != device):
            self._rope = (self._rope_host[0].to(device), self._rope_host[1].to(device))

    def _start(self, past_key_values: Any) -> int:
        """The past length this call continues from (0 starts a new sequence)."""
        if isinstance(past_key_values, InjectedCache):
            if past_key_values.owner is self and past_key_values.epoch == self._epoch \
                    and past_key_values.length == self._past:
                return self._past
            raise ValueError(
                "past_key_values is an injected-kernel cache handle of an earlier sequence (or another "
                "model): the fused KV cache holds only the latest sequence; pass past_key_values=None to "
                "start again")
        if isinstance(past_key_values, (tuple, list)) and len(past_key_values) > 0:
            raise ValueError(
                "past_key_values is a legacy tuple of (key, value) tensors; a kernel-injected model keeps its own "
                "KV cache and cannot continue from it: pass past_key_values=None")
        if past_key_values is not None and hasattr(past_key_values, "get_seq_length") \
                and past_key_values.get_seq_length() > 0:
            raise ValueError(
                f"past_key_values is a {type(past_key_values).__name__} holding "
                f"{past_key_values.get_seq_length()} tokens; a kernel-injected model keeps its own KV "
                "cache and cannot continue from a Hugging Face cache: pass past_key_values=None")
        self._epoch += 1
        self._past = 0
        return 0

    def _reorder(self, handle: InjectedCache, beam_idx: torch.Tensor) -> None:
        if handle.epoch != self._epoch or handle.length != self._past or self._cache is None:
            raise ValueError("reorder_cache on a cache handle of an earlier sequence")
        idx = beam_idx.to(device=self._cache.device, dtype=torch.long)
        n = self._past
        with torch.no_grad():  # in place: captured graphs keep the cache's address
            live = self._cache[:, :, :, :, :n]
            live.copy_(live.index_select(2, idx))
            self._mask.copy_(self._mask.index_select(0, idx))

    # --- forward ----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Any = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, **kwargs: Any) -> BaseModelOutputWithPastAndCrossAttentions:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if kwargs.get("output_router_logits"):
            raise NotImplementedError("output_router_logits is not available from a kernel-injected model (its MoE "
                                      "blocks keep no router logits)")
        if output_attentions or output_hidden_states:
            raise NotImplementedError("output_attentions/output_hidden_states are not available from a "
                                      "kernel-injected model (the fused blocks keep no per-layer outputs)")
        unsupported = [k for k in ("token_type_ids", "encoder_hidden_states", "head_mask")
                       if kwargs.get(k) is not None]
        if unsupported:
            raise NotImplementedError(f"{', '.join(unsupported)} are not supported by a kernel-injected model")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"a kernel-injected model takes a 2D attention_mask [batch, past + new], "
                             f"got shape {tuple(attention_mask.shape)}")
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        ref = input_ids if input_ids is not None else inputs_embeds
        batch, t = ref.shape[0], ref.shape[1]
        past = self._start(past_key_values)
        if past + t > self.max_out_tokens:
            raise ValueError(f"the KV cache holds max_out_tokens={self.max_out_tokens} tokens but this call needs "
                             f"{past + t} ({past} cached + {t} new): pass a larger max_out_tokens to init_inference")
        dtype = self.norm_w.dtype
        device = self.norm_w.device
        if past and self._cache is not None and self._cache.shape[2] != batch:
            raise ValueError(f"batch size changed from {self._cache.shape[2]} to {batch} within one sequence")
        self._prepare_state(batch, dtype, device)
        if past == 0:
            self._mask.fill_(1)
        if attention_mask is not None:
            if attention_mask.shape != (batch, past + t):
                raise ValueError(f"attention_mask must have shape [batch, past + new] = {(batch, past + t)}, "
                                 f"got {tuple(attention_mask.shape)}")
            self._mask[:, :past + t].copy_(attention_mask)
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=device).unsqueeze(0)
        # the kernels read positions as contiguous int64 [B, T]
        position_ids = position_ids.to(device=device, dtype=torch.long).expand(batch, t).contiguous()
        self._past_dev.fill_(past)

        graph = (self.enable_cuda_graph and device.type == "cuda" and t == 1 and past > 0
                 and input_ids is not None and not torch.cuda.is_current_stream_capturing())
        if graph:
            hidden = self._graph_step(input_ids, position_ids, past)
        else:
            hidden = self._body(input_ids, inputs_embeds, position_ids, past)
        if use_cache:
            self._past = past + t
            cache = InjectedCache(self, self._epoch, self._past)
        else:
            self._epoch += 1  # nothing to continue from
            cache = None
        if isinstance(self.layers[0], FusedMoEDecoderBlock):  # the MoE wrappers read .router_logits
            return MoeModelOutputWithPast(last_hidden_state=hidden, past_key_values=cache, router_logits=None)
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden, past_key_values=cache)

    def _embed(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
               position_ids: torch.Tensor) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else getattr(self, self._embed_names[0])(input_ids)
        if "wpe" in self._embed_names:  # learned positions (GPT-2)
            x = x + self.wpe(position_ids)
        return x.to(self.norm_w.dtype)

    def _body(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
              position_ids: torch.Tensor, past: int) -> torch.Tensor:
        x = self._embed(input_ids, inputs_embeds, position_ids)
        batch, t, c = x.shape
        rope = self._rope
        ctx = StepContext(past=past, past_dev=self._past_dev, positions=position_ids if rope else None,
                          key_mask=self._mask, cache=self._cache,
                          cos=rope[0] if rope else None, sin=rope[1] if rope else None)
        h = x.reshape(batch * t, c).contiguous()
        y, yb = None, None
        for block in self.layers:
            h, y, yb = block(h, y, yb, batch, ctx)
        out = torch.empty_like(h)
        K.add_norm(h, y, yb, self.norm_w, self.norm_b, self.spec.eps, None, out)
        return out.view(batch, t, c)

    def _graph_step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, past: int) -> torch.Tensor:
        batch = input_ids.shape[0]
        g = self._graphs.get(batch)
        if g is None:
            with torch.inference_mode(False):  # static inputs stay writable outside inference_mode
                ids = input_ids.clone()
                pos = position_ids.clone().contiguous()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            # warm-up outside capture (lazy allocations, cuBLAS handles; with tensor parallelism the NCCL
            # communicator is created by its first collective, which must not happen under capture)
            with torch.cuda.stream(side):
                self._body(ids, None, pos, past)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # tensor-parallel blocks capture NCCL all-reduces (every rank of the group captures the same step, in
            # the same order, as generate() runs in lockstep there); the process group's watchdog thread keeps
            # querying its events meanwhile, which the default (global) capture mode would turn into a capture
            # error
            tp = any(getattr(block, "group", None) is not None for block in self.layers)
            with torch.cuda.graph(graph, capture_error_mode="thread_local" if tp else "global"):
                out = self._body(ids, None, pos, past)
            g = self._graphs[batch] = {"graph": graph, "ids": ids, "pos": pos, "out": out}
        g["ids"].copy_(input_ids)
        g["pos"].copy_(position_ids)
        g["graph"].replay()
        return g["out"].clone()  # the static output is overwritten by the next replay
