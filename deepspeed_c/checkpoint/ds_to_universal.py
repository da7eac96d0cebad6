"""Convert a ZeRO checkpoint (stage 1, 2 or 3; deepspeed_c's or DeepSpeed's, data-, tensor- or
pipeline-parallel) into DeepSpeed's universal checkpoint, which an engine of any other data-parallel degree
and ZeRO stage loads with `checkpoint: {"load_universal": true}`:

    python -m deepspeed_c.checkpoint.ds_to_universal --input_folder ckpt/global_step10 \
        --output_folder ckpt/global_step10_universal

The output folder holds the model-states files (copied), `zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt`
and `zero/optimizer_state.pt`; `latest_universal` beside it names it. Conversion works one optimizer
file, then one parameter, at a time (never the whole model). Options as DeepSpeed's script:
--num_extract_workers / --num_merge_workers (processes; 1 runs in this process), --keep_temp_folder,
--inject_missing_state (a checkpoint without `universal_checkpoint_info`, as deepspeed_c's and plain
DeepSpeed engines write, gets an empty one) and --no_strict (patterns matching no parameter warn instead
of raising). DeepSpeed's --strict default is kept; --strict is accepted for symmetry."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from deepspeed_c.checkpoint import constants as C
from deepspeed_c.checkpoint import ds_pickle
from deepspeed_c.checkpoint.universal_extract import extract_zero3, extract_zero12
from deepspeed_c.checkpoint.universal_merge import all_patterns, merge_param
from deepspeed_c.checkpoint.universal_source import SourceCheckpoint, load, read_source

_SHARDED = (C.BASE_OPTIMIZER_STATE, C.PARAM_SLICE_MAPPINGS, C.SINGLE_PARTITION_OF_FP32_GROUPS, C.FP32_FLAT_GROUPS,
            C.GROUP_PADDINGS, "param_alignment_paddings")


def parse_arguments(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ds_to_universal", description=__doc__.split("\n\n")[0])
    p.add_argument("--input_folder", type=str, required=True, help="the checkpoint tag folder to convert")
    p.add_argument("--output_folder", type=str, required=True, help="the universal checkpoint folder to write")
    p.add_argument("--num_extract_workers", default=4, type=int, help="processes cutting the ZeRO files")
    p.add_argument("--num_merge_workers", default=2, type=int, help="processes merging each parameter's fragments")
    p.add_argument("--keep_temp_folder", action="store_true", help="keep the fragments (output_folder/tmp)")
    p.add_argument("--no_strict", dest="strict", action="store_false",
                   help="warn, instead of failing, when a universal_checkpoint_info pattern matches no parameter")
    p.add_argument("--strict", dest="strict", action="store_true", help="fail on unmatched patterns (the default)")
    p.add_argument("--inject_missing_state", action="store_true",
                   help="convert a checkpoint without universal_checkpoint_info (give it an empty one)")
    args = p.parse_args(argv)
    for flag in ("num_extract_workers", "num_merge_workers"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    return args


def _parallel(work: Callable[[Any], Any], items: Iterable[Any], workers: int) -> list[Any]:
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [work(item) for item in items]
    with ProcessPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return list(pool.map(work, items))


def _save(obj: Any, path: str) -> None:
    pickler = {"pickle_module": ds_pickle} if ds_pickle.contains_stand_ins(obj) else {}
    torch.save(obj, path, **pickler)


def _optimizer_state(src: SourceCheckpoint, path: str) -> None:
    """zero/optimizer_state.pt: the first file's optimizer state less what is partitioned, with the param
    groups (hyperparameters) on top, and for a stage-3 source the step where DeepSpeed's stage-3 loader
    reads it (optimizer_state_dict.state[0].step)."""
    osd = load(src.optim_files[(0, 0)])[C.OPTIMIZER_STATE_DICT]
    out = {k: v for k, v in osd.items() if k not in _SHARDED and k != C.OPTIMIZER_STATE_DICT}
    if src.zero_stage == 3:
        inner = osd[C.OPTIMIZER_STATE_DICT]
        groups = inner[C.PARAM_GROUPS]
        steps = {i: {C.UNIVERSAL_STEP: s[C.UNIVERSAL_STEP]} for i, s in inner["state"].items() if C.UNIVERSAL_STEP in s}
        out[C.OPTIMIZER_STATE_DICT] = {"state": steps, C.PARAM_GROUPS: groups}
    else:
        groups = osd[C.BASE_OPTIMIZER_STATE][C.PARAM_GROUPS]
    out[C.PARAM_GROUPS] = groups
    _save(out, path)


def _universal_info(src: SourceCheckpoint, inject: bool) -> dict:
    info = src.universal_info
    if info is None:
        if src.zero_stage == 3 and src.tp_degree == 1 or inject:
            return {C.UNIVERSAL_CHECKPOINT_VERSION_KEY: C.UNIVERSAL_CHECKPOINT_VERSION_VALUE}
        raise ValueError(f"ds_to_universal: {src.folder}'s model-states file has no {C.UNIVERSAL_CHECKPOINT_INFO!r} "
                         "(the client, e.g. Megatron-DeepSpeed, saves it); pass --inject_missing_state to convert "
                         "a checkpoint without it")
    if not isinstance(info, dict):
        raise ValueError(f"ds_to_universal: {C.UNIVERSAL_CHECKPOINT_INFO} must be a dict, got {type(info).__name__}")
    return info


def _merge_shapes(src: SourceCheckpoint) -> dict[str, list[Optional[tuple]]]:
    """Each parameter's shard shape per tensor-parallel rank (pipeline stages hold different parameters)."""
    out: dict[str, list[Optional[tuple]]] = {}
    for mp, shapes in sorted(src.param_shapes.items()):
        tp, _ = src.mp_to_tp_pp(mp)
        for name, shape in shapes.items():
            out.setdefault(name, [None] * src.tp_degree)[tp] = shape
    return out


def main(args: argparse.Namespace) -> str:
    """Converts args.input_folder; returns the output folder."""
    src = read_source(args.input_folder)
    info = _universal_info(src, args.inject_missing_state)
    out = os.path.abspath(args.output_folder)
    if os.path.abspath(src.folder) == out:
        raise ValueError("ds_to_universal: --output_folder must differ from --input_folder")
    temp = os.path.join(out, "tmp")
    zero_out = os.path.join(out, C.UNIVERSAL_ZERO_FOLDER)
    shutil.rmtree(temp, ignore_errors=True)
    os.makedirs(zero_out, exist_ok=True)
    print(f"ds_to_universal: {src.folder} (ZeRO stage {src.zero_stage}, dp {src.dp_degree}, tp {src.tp_degree}, "
          f"pp {src.pp_degree}) -> {out}")
    extract = extract_zero3 if src.zero_stage == 3 else extract_zero12
    _parallel(partial(extract, src, temp), sorted(src.optim_files), args.num_extract_workers)
    shapes = _merge_shapes(src)
    used = _parallel(partial(_merge_one, info, zero_out, temp, src.tp_degree), sorted(shapes.items()),
                     args.num_merge_workers)
    unmatched = sorted(all_patterns(info) - set().union(*used)) if used else sorted(all_patterns(info))
    if unmatched:
        msg = (f"ds_to_universal: {C.UNIVERSAL_CHECKPOINT_INFO} patterns {unmatched} match no parameter of "
               f"{src.folder} (its parameters: {sorted(shapes)[:8]}...)")
        if args.strict:
            raise ValueError(msg + "; fix the patterns or pass --no_strict")
        print("warning: " + msg, file=sys.stderr)
    _optimizer_state(src, os.path.join(zero_out, C.UNIVERSAL_OPTIMIZER_STATE_FILE))
    for path in src.model_files + src.layer_files:
        shutil.copy2(path, out)
    if not args.keep_temp_folder:
        shutil.rmtree(temp, ignore_errors=True)
    root, name = os.path.split(out)
    with open(os.path.join(root, C.UNIVERSAL_LATEST), "w") as f:
        f.write(name)
    print(f"ds_to_universal: wrote {len(shapes)} parameters")
    return out


def _merge_one(info: dict, zero_out: str, temp: str, tp_degree: int, item: tuple) -> set[str]:
    name, shapes = item
    return merge_param(info, zero_out, temp, tp_degree, name, shapes)


def cli_main(argv: Optional[Sequence[str]] = None) -> None:
    main(parse_arguments(argv))


if __name__ == "__main__":
    cli_main()
