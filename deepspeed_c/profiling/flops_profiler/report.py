"""The flops profiler's printed report: the summary (with the engine's fwd/bwd/step timers when
there is one), the aggregated top-modules-per-depth table and the annotated module tree, in the
layout DeepSpeed prints so that logs read and parse the same."""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional, TextIO

from torch import nn

from deepspeed_c.profiling.flops_profiler.profiler import get_module_duration, get_module_flops, get_module_macs
from deepspeed_c.profiling.flops_profiler.units import (DEFAULT_PRECISION, duration_to_string, flops_to_string,
                                                        macs_to_string, number_to_string, params_to_string)

_LINE = "{:<70}  {:<8}"
_NOTATIONS = ("Notations:\n"
              "data parallel size (dp_size), model parallel size(mp_size),\n"
              "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
              "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
              "fwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
              "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n")
_DETAILED_HEADER = ("Each module profile is listed after its name in the following order: \n"
                    "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
                    "percentage of total fwd latency, fwd FLOPS")
_DETAILED_NOTE = (
    "\nNote: 1. A module can have torch.nn.module or torch.nn.functional to compute logits (e.g. CrossEntropyLoss). "
    "They are not counted as submodules, thus not to be printed out. However they make up the difference between a "
    "parent's MACs (or latency) and the sum of its submodules'.\n"
    "2. Number of floating-point operations is a theoretical estimation, thus FLOPS computed using that could be "
    "larger than the maximum system throughput.\n"
    "3. The fwd latency listed in the top module's profile is directly captured at the module forward function in "
    "PyTorch, thus it's less than the fwd latency shown above which is captured in DeepSpeed.\n")


def emit(output_file: Optional[str], write: Callable[[TextIO], None]) -> None:
    """Run `write` on stdout, or on output_file (its directory created) when one is named."""
    if not output_file:
        write(sys.stdout)
        return
    directory = os.path.dirname(os.path.abspath(output_file))
    os.makedirs(directory, exist_ok=True)
    with open(output_file, "w") as out:
        write(out)


def _pct(part: float, total: float) -> float:
    return round(100 * part / total, DEFAULT_PRECISION) if total else 0


def _timer_seconds(timers: Callable[[str], Any], name: str, micro_steps: int) -> float:
    """A global timer over this step, per micro-batch: under gradient accumulation the timers cover
    every micro-step (and the one optimizer step) while the counted flops are one micro-batch's, so
    the figures are divided by gradient_accumulation_steps (DeepSpeed leaves them undivided); at
    gradient_accumulation_steps 1 this is DeepSpeed's figure."""
    return timers(name).elapsed(False) / 1000.0 / micro_steps


def _write_summary(prof: Any, out: TextIO, profile_step: int) -> None:
    from deepspeed_c.utils import timer as timers

    engine, model = prof.ds_engine, prof.model
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    prof.flops, prof.macs, prof.params = flops, macs, params
    mp = int(getattr(engine, "mp_world_size", 1) or 1) if engine is not None else 1
    model_dense = model.__params__ * mp if engine is not None else 0
    model_expert = 0
    etp: Optional[int] = None
    moe = engine is not None and bool(getattr(engine, "has_moe_layers", False))
    if moe:
        etp = mp if prof.is_expert_tensor_parallelism_enabled() else 1
        model_expert = model.__model_expert_params__ * etp

    def line(label: str, value: Any) -> None:
        print(_LINE.format(label, value), file=out)

    print("\n-------------------------- DeepSpeed Flops Profiler --------------------------", file=out)
    print(f"Profile Summary at step {profile_step}:", file=out)
    print(_NOTATIONS, file=out)
    if engine is not None:
        line("world size: ", engine.world_size)
        # an engine under Ulysses sequence parallelism may report dp_world_size as None: its
        # data-parallel replication is then the sequence-data-parallel group (DeepSpeed prints that)
        dp = engine.dp_world_size
        line("data parallel size: ", dp if dp is not None else getattr(engine, "seq_dp_world_size", None))
        line("model parallel size: ", mp)
        line("batch size per GPU: ", engine.train_micro_batch_size_per_gpu())
        if moe:
            line("expert tensor parallelism enabled: ", etp is not None and etp > 1)
    line("params per GPU: ", params_to_string(params))
    if model_expert > 0:
        line("params of model: ", params_to_string(model_dense + model_expert))
        line("   non-expert params of model: ", params_to_string(model_dense))
        line("   expert params of model: ", params_to_string(model_expert))
    else:
        line("params of model = params per GPU * mp_size: ", params_to_string(model_dense))
    line("fwd MACs per GPU: ", macs_to_string(macs))
    line("fwd flops per GPU: ", number_to_string(flops))
    line("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(flops * mp))
    timed = engine is not None and engine.wall_clock_breakdown()
    gas = getattr(engine, "gradient_accumulation_steps", None)
    micro_steps = max(int(gas()), 1) if callable(gas) else 1
    fwd = (_timer_seconds(engine.timers, timers.FORWARD_GLOBAL_TIMER, micro_steps) if timed
           else prof.get_total_duration())
    line("fwd latency: ", duration_to_string(fwd))
    line("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", flops_to_string(flops / fwd if fwd else 0))
    if not timed:
        return
    factor = 2 + prof.recompute_fwd_factor  # backward costs twice the forward, plus any recomputation
    bwd = _timer_seconds(engine.timers, timers.BACKWARD_GLOBAL_TIMER, micro_steps)
    step = _timer_seconds(engine.timers, timers.STEP_GLOBAL_TIMER, micro_steps)
    iteration = fwd + bwd + step
    line("bwd latency: ", duration_to_string(bwd))
    line(f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
         flops_to_string(factor * flops / bwd if bwd else 0))
    line(f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
         flops_to_string((factor + 1) * flops / (fwd + bwd) if fwd + bwd else 0))
    line("step latency: ", duration_to_string(step))
    line("iter latency: ", duration_to_string(iteration))
    line(f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ",
         flops_to_string((factor + 1) * flops / iteration if iteration else 0))
    samples = engine.train_micro_batch_size_per_gpu() * engine.world_size
    line("samples/second: ", round(samples / iteration, DEFAULT_PRECISION) if iteration else 0)


def _module_profile_repr(module: nn.Module, totals: tuple[float, float, float], original: Callable[[], str]) -> str:
    total_params, total_macs, total_duration = totals
    params = module.__params__ + module.__expert_params__
    flops, macs, duration = get_module_flops(module), get_module_macs(module), get_module_duration(module)
    items = [f"{params_to_string(params)} = {_pct(params, total_params):g}% Params",
             f"{macs_to_string(macs)} = {_pct(macs, total_macs):g}% MACs",
             f"{duration_to_string(duration)} = {_pct(duration, total_duration):g}% latency",
             flops_to_string(round(flops / duration, DEFAULT_PRECISION) if duration else 0)]
    extra = original()
    if extra:
        items.append(extra)
    return ", ".join(items)


def _write_tree(prof: Any, out: TextIO) -> None:
    """print(model) with each module's extra_repr temporarily prefixed by its profile."""
    totals = (prof.get_total_params(), prof.get_total_macs(), prof.get_total_duration())
    replaced: list[tuple[nn.Module, bool, Any]] = []
    try:
        for module in prof.model.modules():
            own = "extra_repr" in module.__dict__
            original = module.extra_repr
            replaced.append((module, own, module.__dict__.get("extra_repr")))
            module.extra_repr = (lambda m=module, o=original: _module_profile_repr(m, totals, o))
        print(prof.model, file=out)
    finally:
        for module, own, previous in replaced:
            if own:
                module.extra_repr = previous
            else:
                del module.extra_repr


def write_model_profile(prof: Any, out: TextIO, *, profile_step: int, module_depth: int, top_modules: int,
                        detailed: bool) -> None:
    _write_summary(prof, out, profile_step)
    print("\n----------------------------- Aggregated Profile per GPU -----------------------------", file=out)
    write_aggregated_profile(prof.model, out, module_depth=module_depth, top_modules=top_modules)
    if detailed:
        print("\n------------------------------ Detailed Profile per GPU ------------------------------", file=out)
        print(_DETAILED_HEADER, file=out)
        print(_DETAILED_NOTE, file=out)
        _write_tree(prof, out)
    print("------------------------------------------------------------------------------", file=out)


def write_aggregated_profile(model: nn.Module, out: Optional[TextIO], *, module_depth: int, top_modules: int) -> None:
    out = out if out is not None else sys.stdout
    if not hasattr(model, "__flops__"):
        print("no __flops__ attribute in the model, call this function after start_profile and before end_profile",
              file=out)
        return
    # per depth: class name -> [macs, params, latency], summed over the modules of that class
    per_depth: list[dict[str, list[float]]] = []

    def walk(module: nn.Module, depth: int) -> None:
        if depth == len(per_depth):
            per_depth.append({})
        row = per_depth[depth].setdefault(type(module).__name__, [0, 0, 0])
        row[0] += get_module_macs(module)
        row[1] += module.__params__ + module.__expert_params__
        row[2] += get_module_duration(module)
        for child in module.children():
            walk(child, depth + 1)

    walk(model, 0)
    depth = len(per_depth) - 1 if module_depth == -1 else module_depth
    print(f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:", file=out)
    for d in range(min(depth, len(per_depth))):
        rows = per_depth[d]
        n = min(top_modules, len(rows))

        def top(index: int, fmt: Callable[[float], str]) -> dict[str, str]:
            ranked = sorted(rows.items(), key=lambda item: item[1][index], reverse=True)[:n]
            return {name: fmt(values[index]) for name, values in ranked}

        print(f"depth {d}:", file=out)
        print(f"    params      - {top(1, params_to_string)}", file=out)
        print(f"    MACs        - {top(0, macs_to_string)}", file=out)
        print(f"    fwd latency - {top(2, duration_to_string)}", file=out)
