"""ZeRO++ on stage 3: the communication of ZeRO-3 made cheaper, as DeepSpeed's four switches in
`zero_optimization` do.

- qwZ, `zero_quantized_weights`: the parameter all-gathers of gather-on-use carry each rank's chunk
  as int8 codes with one fp32 scale per WEIGHT_BLOCK elements and are dequantized on arrival (about
  half the bytes of a 16-bit gather, a quarter of an fp32 one). Gathers whose values must be exact
  (GatheredParameters, save_16bit_model, persistent units) stay unquantized, as DeepSpeed's do.
- hpZ, `zero_hpz_partition_size` H > 1: when gather-on-use releases a gathered unit, each rank keeps
  1/H of it (a secondary shard, over groups of H consecutive data-parallel ranks, a node's ranks), so
  later gathers of that unit until the weights change (the backward's) run inside the group of H.
  The secondary copy holds the same values as the gathered one: results are bitwise those of ZeRO-3.
- qgZ, `zero_quantized_gradients`: the gradient reduce-scatter becomes an all-to-all of int4 codes
  (one scale per GRAD_BLOCK elements) whose pieces each rank dequantizes and sums in fp32; with more
  than one node (LOCAL_WORLD_SIZE ranks each) it runs in two hops, inside the node then across
  nodes, each int4, as DeepSpeed's all_to_all_quant_reduce does.
- `zero_quantized_nontrainable_weights`: units whose parameters are all frozen travel as int8 codes
  cut once from their shard (quantize_nontrainable_params() re-decides which units are frozen, for
  LoRA). Their 16-bit shard stays in memory (DeepSpeed stores only the codes; that memory saving is
  not built), so checkpoints and GatheredParameters keep the exact weights.

This module holds the switches, the process groups they need and the quantized collectives; the
parameter store (param_store.py) and the gradient partitioner (grad_partition.py) call it."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from deepspeed_c.ops.quantizer import GRAD_BLOCK, WEIGHT_BLOCK, dequantize, dequantize_sum, quantize
from deepspeed_c.runtime.zero.loco import LocoErrorFeedback

HPZ_KEY = "zero_optimization.zero_hpz_partition_size"


def _comm() -> Any:
    import deepspeed_c.comm as dist

    return dist


def _group_ranks(group: Any, world_size: int) -> list[int]:
    import torch.distributed as tdist

    return list(range(world_size)) if group is None else list(tdist.get_process_group_ranks(group))


def _new_groups(blocks: list[list[int]], me: int) -> Any:
    """Every rank creates every group (torch.distributed requires it); returns the one holding `me`."""
    mine = None
    for ranks in blocks:
        g = _comm().new_group(ranks)
        if me in ranks:
            mine = g
    return mine


def check_hpz_size(hpz: int, world_size: int) -> None:
    """DeepSpeed's rule: the secondary group has min(H, world) ranks, which must divide the world."""
    hpz = min(hpz, world_size)
    if hpz > 1 and world_size % hpz != 0:
        raise ValueError(f"{HPZ_KEY}={hpz} must divide the data-parallel world size ({world_size}): the secondary "
                         f"weight shards are kept over groups of {hpz} consecutive ranks")


@dataclass
class ZeroPlusPlus:
    """The ZeRO++ switches of one ZeRO-3 model and the groups they run over."""
    quantized_weights: bool = False
    quantized_nontrainable_weights: bool = False
    quantized_gradients: bool = False
    hpz_size: int = 1
    rank: int = 0
    world_size: int = 1
    group: Any = None
    hpz_group: Any = None
    hpz_rank: int = 0
    local_size: int = 1  # ranks per node for qgZ's two hops (1 hop when it is the whole world)
    local_group: Any = None
    cross_group: Any = None
    weight_block: int = WEIGHT_BLOCK
    grad_block: int = GRAD_BLOCK
    gathers: dict = field(default_factory=lambda: {"quantized": 0, "secondary": 0, "primary": 0})
    loco: Any = None  # LoCo-Zero++ error feedback (loco.py), or None
    _reduces: int = 0  # quantized reduce-scatters since the round began

    def end_round(self) -> None:
        """The backward's reductions are over: the next bucket reduced is the first of a new round."""
        self._reduces = 0

    @classmethod
    def from_config(cls, zero_cfg: Any, *, rank: int, world_size: int, group: Any) -> Optional["ZeroPlusPlus"]:
        hpz = int(zero_cfg.zero_hpz_partition_size)
        on = (zero_cfg.zero_quantized_weights or zero_cfg.zero_quantized_nontrainable_weights
              or zero_cfg.zero_quantized_gradients or hpz > 1)
        if not on:
            return None
        check_hpz_size(hpz, world_size)
        zpp = cls(quantized_weights=bool(zero_cfg.zero_quantized_weights),
                  quantized_nontrainable_weights=bool(zero_cfg.zero_quantized_nontrainable_weights),
                  quantized_gradients=bool(zero_cfg.zero_quantized_gradients),
                  hpz_size=max(1, min(hpz, world_size)), rank=rank, world_size=world_size, group=group)
        zpp.loco = LocoErrorFeedback.from_config(getattr(zero_cfg, "zeropp_loco_param", None), GRAD_BLOCK)
        if world_size > 1:
            zpp._make_groups()
        return zpp

    def _make_groups(self) -> None:
        import torch.distributed as tdist

        ranks = _group_ranks(self.group, self.world_size)
        me = tdist.get_rank()
        if self.hpz_size > 1:
            h = self.hpz_size
            self.hpz_group = _new_groups([ranks[i:i + h] for i in range(0, len(ranks), h)], me)
            self.hpz_rank = self.rank % h
        if self.quantized_gradients:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size) or self.world_size)
            if 1 < local < self.world_size and self.world_size % local == 0:
                self.local_size = local
                self.local_group = _new_groups([ranks[i:i + local] for i in range(0, len(ranks), local)], me)
                self.cross_group = _new_groups([ranks[i::local] for i in range(local)], me)
            else:
                self.local_size = self.world_size

    # -- weights -------------------------------------------------------------------------------------
    def gather(self, chunk: torch.Tensor, full: torch.Tensor, *, quantized: bool, secondary: bool,
               codes: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> Any:
        """Starts gathering `chunk` (this rank's piece) of every rank of the data-parallel group, or of the
        hpZ group when `secondary`, into `full` (as int8 codes when `quantized`: `codes` when the chunk's
        are at hand); returns what to wait() on."""
        group, world = (self.hpz_group, self.hpz_size) if secondary else (self.group, self.world_size)
        self.gathers["secondary" if secondary else "primary"] += 1
        if not quantized:
            return _comm().all_gather_into_tensor(full, chunk, group=group, async_op=True)
        self.gathers["quantized"] += 1
        return QuantizedGather(chunk, full, group, world, self.weight_block, codes)

    def secondary_piece(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's 1/H of a gathered unit (a copy: the gathered buffer is about to be dropped)."""
        n = full.numel() // self.hpz_size
        return full[self.hpz_rank * n:(self.hpz_rank + 1) * n].clone()

    # -- gradients -----------------------------------------------------------------------------------
    @torch.no_grad()
    def reduce_scatter(self, buf: torch.Tensor) -> torch.Tensor:
        """fp32 [len(buf) / W]: this rank's chunk of the sum of every rank's `buf`, through int4 all-to-alls."""
        W, L = self.world_size, self.local_size
        c = buf.numel() // W
        key = (self._reduces, buf.numel())  # the bucket's place in this round: LoCo's error buffers follow it
        self._reduces += 1
        if L >= W:  # one hop: segment d of buf goes to rank d
            return _a2a_sum(buf, W, self.group, self.grad_block, self.loco, key + ("intra",))
        N = W // L  # nodes; rank = node * L + local index
        by_local = buf.view(N, L, c).transpose(0, 1).contiguous()  # [local peer][node][c]
        partial = _a2a_sum(by_local.view(-1), L, self.local_group, self.grad_block, self.loco,
                           key + ("intra",))  # [node][c], node sums
        return _a2a_sum(partial, N, self.cross_group, self.grad_block, self.loco, key + ("inter",))


class QuantizedGather:
    """An all-gather of int8 codes and scales in flight; wait() dequantizes into the gathered buffer."""

    def __init__(self, chunk: torch.Tensor, full: torch.Tensor, group: Any, world: int, block: int,
                 codes: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        q, scales = quantize(chunk.contiguous(), 8, block) if codes is None else codes
        self.q = torch.empty(world * q.numel(), dtype=torch.uint8, device=full.device)
        self.scales = torch.empty(world * scales.numel(), dtype=torch.float32, device=full.device)
        dist = _comm()
        self.works = [dist.all_gather_into_tensor(self.q, q.to(full.device), group=group, async_op=True),
                      dist.all_gather_into_tensor(self.scales, scales.to(full.device), group=group, async_op=True)]
        self.full, self.world, self.block = full, world, block

    def wait(self) -> None:
        if self.works is None:
            return
        for w in self.works:
            if w is not None:
                w.wait()
        self.works = None
        dequantize(self.q, self.scales, self.full.numel(), 8, self.block, self.world, out=self.full)


def _a2a_sum(x: torch.Tensor, peers: int, group: Any, block: int, loco: Any = None,
             key: Any = None) -> torch.Tensor:
    """x holds `peers` equal segments, segment p for peer p: each is sent as int4 codes (with LoCo's error
    feedback when `loco`), and the pieces received from every peer are dequantized and summed (fp32)."""
    seg = x.numel() // peers
    q, scales = quantize(x.contiguous(), 4, block, peers) if loco is None else loco.quantize(key, x, 4, peers)
    rq, rs = torch.empty_like(q), torch.empty_like(scales)
    dist = _comm()
    works = [dist.all_to_all_single(rq, q, group=group, async_op=True),
             dist.all_to_all_single(rs, scales, group=group, async_op=True)]
    for w in works:
        if w is not None:
            w.wait()
    return dequantize_sum(rq, rs, seg, peers, 4, block)
