"""ds_to_universal's second phase: one parameter at a time, its fragments joined over data-parallel ranks
into each tensor-parallel rank's shard, the shards merged into the whole parameter by the patterns of the
checkpoint's `universal_checkpoint_info`, written as DeepSpeed's universal layout:
`zero/<param>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt` ({"param": tensor, "cat_dim": d, ...}) and
`step.pt`. Merging (DeepSpeed's rules): a name matching TP_REPLICATED_PARAMETER_PATTERNS keeps the first
shard (all must be equal), PARAMETER_TO_AVERAGE_PATTERNS averages, PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0
joins the two halves of each shard separately, PARAMETER_WITH_ROW_PARALLELISM_PATTERNS concatenates along
dim 1 and any other along dim 0; VOCABULARY_PARAMETER_PATTERNS then trims the padded vocabulary rows to
`original_vocab_size`."""
from __future__ import annotations

import glob
import os
import re
from typing import Any, Optional

import torch

from deepspeed_c.checkpoint import constants as C
from deepspeed_c.checkpoint.universal_extract import fragment_path

_PATTERN_KEYS = (C.TP_REPLICATED_PARAMETER_PATTERNS, C.PARAMETER_TO_AVERAGE_PATTERNS,
                 C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, C.VOCABULARY_PARAMETER_PATTERNS,
                 C.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0)


def all_patterns(info: dict) -> set[str]:
    out: set[str] = set()
    for key in _PATTERN_KEYS:
        out.update(info.get(key, []))
    return out


def _states(temp: str, name: str) -> list[str]:
    base = os.path.join(temp, name, "0")
    return sorted({os.path.basename(p).rsplit(".", 1)[0] for p in glob.glob(os.path.join(base, "*.*"))})


def _load(path: str) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def _tp_shard(temp: str, name: str, tp: int, state: str, shape: Optional[tuple]) -> Any:
    paths = sorted(glob.glob(fragment_path(temp, name, tp, state, 0)[:-2] + "[0-9]*"),
                   key=lambda p: int(p.rsplit(".", 1)[1]))
    if not paths:
        raise FileNotFoundError(f"ds_to_universal: no {state} fragments of {name!r} for tensor-parallel rank {tp}")
    parts = [_load(p) for p in paths]
    if state == C.UNIVERSAL_STEP:
        first = parts[0]
        if any(not _same(first, p) for p in parts[1:]):
            raise ValueError(f"ds_to_universal: {name!r}: the data-parallel ranks saved different steps {parts}")
        return first
    flat = torch.cat([p.reshape(-1) for p in parts])
    return flat.view(shape) if shape is not None else flat


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return bool(torch.equal(a, b))
    return a == b


def _match(patterns: list[str], name: str, used: set[str]) -> bool:
    hits = [p for p in patterns if re.match(p, name)]
    if len(hits) > 1:
        raise ValueError(f"ds_to_universal: parameter {name!r} matches more than one pattern: {hits}")
    used.update(hits)
    return bool(hits)


def merge_param(info: dict, out_zero: str, temp: str, tp_degree: int, name: str,
                shapes: list[Optional[tuple]]) -> set[str]:
    """Writes zero/<name>/<state>.pt for every state of `name`; returns the patterns that matched it."""
    used: set[str] = set()
    folder = os.path.join(out_zero, name)
    os.makedirs(folder, exist_ok=True)
    for state in _states(temp, name):
        if state == C.UNIVERSAL_STEP:
            torch.save(_tp_shard(temp, name, 0, state, None), os.path.join(folder, "step.pt"))
            continue
        shards = [_tp_shard(temp, name, tp, state, shapes[tp]) for tp in range(tp_degree)]
        record: dict[str, Any] = {}
        if _match(info.get(C.TP_REPLICATED_PARAMETER_PATTERNS, []), name, used):
            if any(not torch.equal(shards[0], s) for s in shards[1:]):
                raise ValueError(f"ds_to_universal: {name!r} is tensor-parallel replicated "
                                 f"({C.TP_REPLICATED_PARAMETER_PATTERNS}) but its shards differ")
            whole = shards[0]
        elif _match(info.get(C.PARAMETER_TO_AVERAGE_PATTERNS, []), name, used):
            whole = sum(shards[1:], shards[0]) / len(shards)
        elif _match(info.get(C.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0, []), name, used):
            halves = [torch.chunk(s, 2, dim=0) for s in shards]
            whole = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
            record[C.CAT_DIM] = 0
            record[C.PARAM_N_SUB_PARAMS] = 2
        else:
            dim = 1 if _match(info.get(C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, []), name, used) else 0
            whole = torch.cat(shards, dim=dim) if len(shards) > 1 else shards[0]
            record[C.CAT_DIM] = dim
        if _match(info.get(C.VOCABULARY_PARAMETER_PATTERNS, []), name, used):
            if C.ORIGINAL_VOCAB_SIZE not in info:
                raise ValueError(f"ds_to_universal: {name!r} matches {C.VOCABULARY_PARAMETER_PATTERNS} but "
                                 f"{C.UNIVERSAL_CHECKPOINT_INFO} has no {C.ORIGINAL_VOCAB_SIZE!r}")
            whole = whole[:int(info[C.ORIGINAL_VOCAB_SIZE])]
            record[C.VOCAB_TENSOR] = True
        record[C.PARAM] = whole.contiguous()
        torch.save(record, os.path.join(folder, f"{state}.pt"))
    return used
