"""deepspeed.runtime.hybrid_engine.DeepSpeedHybridEngine: one engine that trains and generates (RLHF).

`initialize` returns it when `hybrid_engine.enabled` is true. `engine.generate(...)` takes Hugging Face's
generate arguments and runs over the live training weights:

- a family with fused inference blocks (GPT-2, LLaMA, Mistral, Qwen2) generates on a hook-free copy of the
  model whose decoder blocks are the injected kernels (module_inject/hybrid_inference.py). Before each
  generation the copy is refilled from the training weights; under ZeRO-3 they are gathered all at once
  (`pin_parameters`, the default) or `tp_gather_partition_size` layers at a time, and released after. LoRA
  layers (DeepSpeed-Chat's) are fused into the copy, never into the training weights, so training resumes
  on exactly the weights it left. `release_inference_cache` drops the copy and its KV cache after each
  generation (memory back to the training level); otherwise both are kept for the next one.
- any other family runs Hugging Face's generate on the training model itself (under ZeRO-3 through its
  gather hooks, all ranks stepping together: `synced_gpus`), with one warning naming the family.
- `inference_tp_size` k > 1: blocks of k consecutive ranks generate together, each holding 1/k of every
  fused block (module_inject/hybrid_tp.py); the group's prompts are gathered, generated as one batch, and
  each rank returns its own rows.

`fuse_lora_weight()` / `unfuse_lora_weight()` add / take the LoRA updates into / out of the base weights in place
and `layer_params` lists each transformer block's parameters (DeepSpeed's public names).

`engine.module.generate` is routed to engine.generate (DeepSpeed-Chat calls the module's). `train()` / `eval()`
switch modes as DeepSpeed's do; eval() logs the last RLHF iteration's latency split
(gather, generate, train) on rank 0, as DeepSpeed's hybrid engine prints it."""
from __future__ import annotations

import time
import warnings
from typing import Any, Optional

import torch

from deepspeed_c.runtime.engine import DeepSpeedEngine
from deepspeed_c.utils.logging import log_dist


class HybridEngineFallbackWarning(UserWarning):
    """The model's family has no fused inference path: generation runs Hugging Face's generate."""


class DeepSpeedHybridEngine(DeepSpeedEngine):
    r"""DeepSpeed engine for training and inference."""

    inference_mp_group = None

    def __init__(self, args: Any, model: torch.nn.Module, **kwargs: Any) -> None:
        super().__init__(args, model, **kwargs)
        he = self._config.hybrid_engine
        self._sync_rng()
        self.Z3_enabled = self.zero_optimization_stage() == 3
        self.gather_all_layers = he.pin_parameters
        self._release_cache = he.release_inference_cache
        self._group_size = he.tp_gather_partition_size
        from deepspeed_c.module_inject import hybrid_inference as hi

        if not hasattr(self.module, "generate"):
            raise TypeError(f"hybrid_engine.enabled: {type(self.module).__name__} has no generate(); the hybrid "
                            "engine generates with a Hugging Face causal LM (a *ForCausalLM model)")
        reason = hi.unsupported_reason(self.module, he.max_out_tokens)
        self._inference: Optional[hi.HybridInference] = None
        self.mp_group = self._inference_tp_group(he.inference_tp_size, reason)
        if reason is None:
            self._inference = hi.HybridInference(self.module, he.max_out_tokens, he.enable_cuda_graph, self.device,
                                                 tp_group=self.mp_group)
        else:
            warnings.warn(f"hybrid engine: model family {hi.model_family(self.module)} has no fused inference path "
                          f"({reason}); engine.generate runs Hugging Face's generate on the training model",
                          HybridEngineFallbackWarning, stacklevel=3)
        # DeepSpeed-Chat generates through actor.module.generate: routed here, as DeepSpeed's engine routes it
        self._hf_generate = hi.route_generate(self.module, self.generate)
        adapters = hi.lora_adapter_ids(self.module)
        self.all_lora_params = [p for p in self.module.parameters() if id(p) in adapters]
        # DeepSpeed's per-transformer-block parameter lists (the base weights, LoRA adapters apart)
        self.layer_params = [[p for p in block.parameters() if id(p) not in adapters]
                             for block in hi.decoder_blocks(self.module)]
        # DeepSpeed's performance counters
        self._t_start: Optional[float] = None
        self._total_latency = 0.0
        self._iters = 0
        self._training_start_time: Optional[float] = None
        self._generate_latency = 0.0
        self._training_latency = 0.0
        self._gather_latency = 0.0
        self._total_batch_size: Optional[int] = None
        self._hybrid_ready = True

    def _sync_rng(self) -> None:
        """Every rank starts from rank 0's generator state, as DeepSpeed's hybrid engine does (sampled
        generations then agree where the prompts do)."""
        import deepspeed_c.comm as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        state = torch.get_rng_state().to(self.device)
        dist.broadcast(state, 0)
        torch.set_rng_state(state.cpu())
        if self.device.type == "cuda":
            cuda_state = torch.cuda.get_rng_state().to(self.device)
            dist.broadcast(cuda_state, 0)
            torch.cuda.set_rng_state(cuda_state.cpu())

    def _inference_tp_group(self, tp: int, unsupported: Optional[str]) -> Any:
        """This rank's inference tensor-parallel group: blocks of tp consecutive ranks (DeepSpeed's grouping);
        None for tp 1. Every rank makes every group (new_group is collective)."""
        if tp == 1:
            return None
        if self.mpu is not None:
            raise NotImplementedError("deepspeed_c: config key 'hybrid_engine.inference_tp_size' > 1 with a model-"
                                      "parallel mpu is not built (DeepSpeed then uses the mpu's tensor group)")
        if unsupported is not None:
            raise NotImplementedError(f"deepspeed_c: config key 'hybrid_engine.inference_tp_size'={tp} needs the fused "
                                      f"inference blocks, which {type(self.module).__name__} does not get "
                                      f"({unsupported}); use inference_tp_size 1")
        import deepspeed_c.comm as dist

        mine = None
        for start in range(0, dist.get_world_size(), tp):
            group = dist.new_group(list(range(start, start + tp)))
            if start <= dist.get_rank() < start + tp:
                mine = group
        return mine

    @property
    def uses_fused_inference(self) -> bool:
        """Whether generate() runs the injected kernels (False: Hugging Face's generate, the fallback)."""
        return self._inference is not None

    @property
    def inference_module(self) -> Optional[torch.nn.Module]:
        """The generation copy (fused blocks) while it is built and kept; None on the fallback path or once
        released."""
        return None if self._inference is None else self._inference.shell

    def _gather(self, params: list) -> Any:
        from deepspeed_c.runtime.zero.partition_parameters import GatheredParameters

        return GatheredParameters(params)  # parameters that are not ZeRO-3's pass through

    # -- generation ----------------------------------------------------------------------------------
    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self.__dict__.get("_hybrid_ready", False):
            raise RuntimeError("DeepSpeedHybridEngine.generate() was called before the engine was built: create it "
                               "with deepspeed.initialize(model=..., config={... 'hybrid_engine': {'enabled': "
                               "True}}) and call generate on the engine it returns")
        ids = kwargs.get("input_ids", inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None)
        if self._total_batch_size is None and ids is not None:
            self._total_batch_size = ids.shape[0] * self.dp_world_size
        t0 = time.time()
        if self._inference is not None:
            self._inference.refresh(self._gather, self._group_size, all_at_once=self.gather_all_layers)
            self._gather_latency = time.time() - t0
            self._inference.check_length(ids, kwargs)
            try:
                out = self._inference.generate(*inputs, **kwargs)
            finally:
                if self._release_cache:
                    self._inference.release()
                    from deepspeed_c.accelerator import get_accelerator

                    get_accelerator().empty_cache()
        else:
            self._gather_latency = 0.0
            if self.Z3_enabled and self.dp_world_size > 1:
                # the gather hooks are collectives: ranks whose sequences end early keep stepping with the others
                kwargs.setdefault("synced_gpus", True)
            out = self._hf_generate(*inputs, **kwargs)
        self._generate_latency = time.time() - t0 - self._gather_latency
        return out

    def release_inference_cache(self) -> None:
        """Drops the generation copy and its KV cache now (what `release_inference_cache` does after each
        generation)."""
        if self._inference is not None:
            self._inference.release()

    # -- LoRA --------------------------------------------------------------------------------------------
    def fuse_lora_weight(self) -> None:
        """Adds every LoRA layer's update into its base weight in place, W += s * (right @ left)^T
        (DeepSpeed's public method; generation here never needs it: the fused copy folds LoRA in itself).
        Under ZeRO-3 call it inside GatheredParameters, as with DeepSpeed."""
        self._shift_lora(1.0)

    def unfuse_lora_weight(self) -> None:
        """Takes the LoRA updates back out of the base weights (fuse_lora_weight's inverse, up to rounding)."""
        self._shift_lora(-1.0)

    @torch.no_grad()
    def _shift_lora(self, sign: float) -> None:
        from deepspeed_c.module_inject import hybrid_inference as hi
        from deepspeed_c.runtime.zero.param_store import ZeroParamStatus

        for m in hi.lora_modules(self.module):
            w = m.weight
            status = getattr(w, "ds_status", None)
            if status is not None and status != ZeroParamStatus.AVAILABLE:  # partitioned, or a prefetch in flight
                raise RuntimeError("fuse_lora_weight/unfuse_lora_weight: the LoRA base weights are partitioned by "
                                   "ZeRO-3; call it inside deepspeed.zero.GatheredParameters(engine.parameters())")
            delta = torch.matmul(m.lora_right_weight, m.lora_left_weight).t()
            w.data.add_(delta.to(w.dtype), alpha=sign * float(m.lora_scaling))

    # -- modes and counters --------------------------------------------------------------------------
    def eval(self) -> "DeepSpeedHybridEngine":
        if self._t_start is not None:
            latency = time.time() - self._t_start
            self._total_latency += latency
            self._iters += 1
            rate = ""
            if self._total_batch_size is not None:
                rate = (f" |CurSamplesPerSec={self._total_batch_size / latency:.2f}"
                        f" |AvgSamplesPerSec={self._total_batch_size * self._iters / self._total_latency:.2f}")
            others = latency - (self._generate_latency + self._training_latency + self._gather_latency)
            pct = (lambda t: 100.0 * t / latency) if latency > 0 else (lambda t: 0.0)
            log_dist(f"|E2E latency={latency:.2f}s |Gather latency={self._gather_latency:.2f}s "
                     f"({pct(self._gather_latency):.2f}%) |Generate time={self._generate_latency:.2f}s "
                     f"({pct(self._generate_latency):.2f}%) |Training time={self._training_latency:.2f}s "
                     f"({pct(self._training_latency):.2f}%) |Others={others:.2f} ({pct(others):.2f}%)" + rate,
                     ranks=[0])
        self._t_start = time.time()
        self._training_latency = 0.0
        return super().eval()

    def train(self, mode: bool = True) -> "DeepSpeedHybridEngine":
        super().train(mode)
        if mode:
            self._training_start_time = time.time()
        return self

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        super().step(lr_kwargs=lr_kwargs)
        if self._training_start_time is not None:
            now = time.time()
            self._training_latency += now - self._training_start_time
            self._training_start_time = now
