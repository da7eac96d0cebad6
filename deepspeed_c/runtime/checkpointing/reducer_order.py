"""The gradient reducers' bucket order in a checkpoint, so a resumed run reduces exactly as the run that
saved it.

Stage 0's reducers lay their buckets out in the parameters' registration order, then re-plan once in
the order gradients arrived in the first backward (reducer.py). Where an element sits in a bucket
decides the order a ring all-reduce sums it in, so a fresh engine that loaded a checkpoint would
reduce its first step with the initial layout and differ from the uninterrupted run in the last bit
(bf16 losses one unit apart). Each rank writes its reducers' adopted orders beside the shared files
(`dsc_reducer_order_rank_R_of_W.pt`; expert reducers' orders differ between expert groups) and, on
load, adopts them at once when the world size and every reducer's parameter count match; otherwise the
reducers re-plan after their first backward as usual (DeepSpeed's checkpoints have no such file)."""
from __future__ import annotations

import os
from typing import Any, Optional

from deepspeed_c.checkpoint import store
from deepspeed_c.runtime.backward_round import BucketOrderKeeping


def file_name(rank: int, world: int) -> str:
    return f"dsc_reducer_order_rank_{rank:05d}_of_{world:05d}.pt"


def _reducers(reducer: Optional[BucketOrderKeeping]) -> list[BucketOrderKeeping]:
    return [] if reducer is None else reducer.order_keepers()


def rank_file(reducer: Optional[BucketOrderKeeping], rank: int, world: int) -> Optional[tuple[str, dict]]:
    """(name, payload) of this rank's orders; None when no reducer has re-planned yet."""
    rs = _reducers(reducer)
    orders = [r.adopted_order() for r in rs]
    if not any(o is not None for o in orders):
        return None
    return file_name(rank, world), {"world": world, "sizes": [r.ordered_param_count() for r in rs],
                                    "orders": orders}


def restore(reducer: Optional[BucketOrderKeeping], tag_dir: str, manifest: Any, rank: int, world: int) -> bool:
    """Adopts the saved orders where they fit every reducer; True when they were adopted."""
    rs = _reducers(reducer)
    name = file_name(rank, world)
    if not rs or not os.path.isfile(os.path.join(tag_dir, name)):
        return False
    payload = store.load_file(tag_dir, name, manifest)
    sizes = [r.ordered_param_count() for r in rs]
    if payload.get("world") != world or payload.get("sizes") != sizes:
        return False
    for r, order in zip(rs, payload["orders"]):
        if order is not None:
            r.adopt_order(list(order))
    return True
