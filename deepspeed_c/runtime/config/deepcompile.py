"""What `compile.deepcompile` can run with, checked when the config is parsed (before the model is touched).

deepspeed_c's DeepCompile puts ZeRO-3's gathers and reduce-scatters in the graph; at ZeRO-1/2 the compiled
model keeps ZeRO's bucketed reduction. With `compile.passes` ["autosp"] it is AutoSP instead (ZeRO stage 0 only).
Otherwise it needs a ZeRO stage, an optimizer that steps on the reduced
gradient partition on the device (no offload, ZenFlow, 1-bit or Muon: they reduce or step on their own
terms), the compile section's keys that deepspeed_c builds, and a torch with the compiler features used."""
from __future__ import annotations

from typing import Any

from deepspeed_c.runtime.config.utils import DeepSpeedConfigError, unbuilt

# optimizer types with their own communication or their own gradient path
_OWN_COMM_OPTIMIZERS = {"onebitadam", "zerooneadam", "onebitlamb", "muon", "muonwithauxadam"}
# compile keys that ask for a DeepCompile pass deepspeed_c does not build (what they ask for)
_UNBUILT_KEYS = {
    "offload_activation": "DeepCompile's activation offload pass",
    "offload_opt_states": "DeepCompile's optimizer-state offload pass",
    "offload_parameters": "DeepCompile's parameter offload pass",
    "free_activation": "DeepCompile's eager activation freeing",
    "symmetric_memory": "DeepCompile's symmetric-memory all-gathers",
}


def _check_passes(compile_cfg: Any, param_dict: dict, stage: int) -> bool:
    """compile.passes: only "autosp" is built, at ZeRO stage 0 (DeepSpeed's rule). True when AutoSP is on."""
    passes = list(compile_cfg.passes or [])
    if not passes:
        return False
    unknown = [p for p in passes if p != "autosp"]
    if unknown:
        raise unbuilt(f"compile.passes {unknown}", "DeepCompile passes other than 'autosp'")
    if not compile_cfg.deepcompile:
        raise DeepSpeedConfigError("config key 'compile.passes' ['autosp'] needs 'compile.deepcompile': true")
    if stage != 0:
        raise DeepSpeedConfigError(f"config key 'compile.passes' ['autosp'] needs ZeRO stage 0, got "
                                   f"'zero_optimization.stage' {stage}: AutoSP shards the sequence, not the weights")
    return True


def check_deepcompile(compile_cfg: Any, param_dict: dict) -> None:
    zero = param_dict.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0)) if isinstance(zero, dict) else 0
    autosp = _check_passes(compile_cfg, param_dict, stage)
    if not compile_cfg.deepcompile:
        return
    from deepspeed_c.runtime.compiler import deepcompile_unsupported_reason

    reason = deepcompile_unsupported_reason()
    if reason is not None:
        raise RuntimeError(f"config key 'compile.deepcompile' needs torch's compiler features: {reason}")
    if stage not in (1, 2, 3) and not autosp:
        raise DeepSpeedConfigError(f"config key 'compile.deepcompile' needs ZeRO stage 1, 2 or 3, got "
                                   f"'zero_optimization.stage' {stage}: DeepCompile turns ZeRO's partitioning into "
                                   "graph passes (set the stage, or drop compile.deepcompile and call engine.compile)")
    for key, what in _UNBUILT_KEYS.items():
        if getattr(compile_cfg, key):
            raise unbuilt(f"compile.{key}", what)
    if isinstance(zero, dict):
        for sub in ("offload_optimizer", "offload_param"):
            dev = (zero.get(sub) or {}).get("device", "none") if isinstance(zero.get(sub), dict) else "none"
            if dev not in (None, "none"):
                raise DeepSpeedConfigError(f"config key 'compile.deepcompile' does not run with "
                                           f"'zero_optimization.{sub}.device' {dev!r}: the compiled graph "
                                           "gathers and reduces on the device (drop one of the two)")
        for key, off in (("zero_quantized_weights", False), ("zero_quantized_gradients", False),
                         ("zero_quantized_nontrainable_weights", False), ("zero_hpz_partition_size", 1)):
            if zero.get(key, off) not in (off, None):
                raise DeepSpeedConfigError(f"config key 'compile.deepcompile' does not run with "
                                           f"'zero_optimization.{key}' {zero[key]!r}: the compiled graph's gathers "
                                           "and reduce-scatters are plain ones (ZeRO++ is not in the graph)")
        if zero.get("zenflow") is not None:
            raise DeepSpeedConfigError("config key 'compile.deepcompile' does not run with 'zero_optimization.zenflow' "
                                       "(ZenFlow steps gradients on its own schedule)")
    opt = param_dict.get("optimizer") or {}
    kind = str(opt.get("type", "")).lower() if isinstance(opt, dict) else ""
    if kind in _OWN_COMM_OPTIMIZERS:
        raise DeepSpeedConfigError(f"config key 'compile.deepcompile' does not run with 'optimizer.type' "
                                   f"{opt.get('type')!r}: that optimizer reduces or steps gradients its own way, "
                                   "DeepCompile's graph reduces them for a ZeRO optimizer (use Adam/AdamW/Lamb/Lion/SGD)")
