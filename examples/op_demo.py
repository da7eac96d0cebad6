"""The main job until the training demo lands: JIT-build a C op into the cache (timed), then run
it on data embedded here and check it against plain PyTorch."""
from __future__ import annotations

import time

import torch

from deepspeed_c.ops.op_builder import ALL_OPS, UtilsBuilder

EMBEDDED = [[0.5, -1.25, 3.0], [2.0], [7.5, 8.25, -9.0, 10.0]]


def main() -> None:
    builder = UtilsBuilder()
    print(f"building op 'utils' for {builder.simd} into {builder.build_dir()} ...")
    start = time.perf_counter()
    op = builder.load()
    print(f"  ready in {time.perf_counter() - start:.2f}s (a second run loads it from the cache)")
    tensors = [torch.tensor(row) for row in EMBEDDED]
    flat = torch.empty(sum(t.numel() for t in tensors))
    op.flatten(tensors, flat)
    assert torch.equal(flat, torch.cat(tensors))
    print(f"  flatten({[t.tolist() for t in tensors]}) -> {flat.tolist()}  [matches torch.cat]")
    print(f"ops this install knows: {sorted(ALL_OPS)}")


if __name__ == "__main__":
    main()
