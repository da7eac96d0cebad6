"""Bad client mpus are refused at initialize with errors that name the problem (issue 54), 4 gloo ranks:
a missing protocol method (named), data-parallel groups that do not partition the world, sizes whose
product is not the world size, stated data-parallel ranks that are not the ranks in the stated groups, and a
model-parallel axis wider than the tensor axis (pipeline stages in
the engine's mpu); and, not built, MoE layers with tensor parallelism and node-local checkpoint storage
with mp_rank files. Every rank raises (no rank is left waiting in a collective)."""
from __future__ import annotations

import torch

from tests.distributed import megatron_models as mm
from tests.harness import run_distributed


class NoDataRank(mm.MegatronMPU):
    get_data_parallel_rank = None  # type: ignore[assignment]


class Overlapping(mm.MegatronMPU):
    """Rank 3's data-parallel group is {2, 3} while rank 2's is {0, 2}: not a partition."""

    def __init__(self) -> None:
        super().__init__(tp=2)
        import torch.distributed as dist

        extra = dist.new_group([2, 3])
        if self.rank == 3:
            self._dp_group = extra


class WrongSizes(mm.MegatronMPU):
    def get_data_parallel_world_size(self) -> int:
        return 1


class DataRankZero(mm.MegatronMPU):
    """Every rank says it is data-parallel rank 0: ranks 2 and 3 would write rank 0's zero_pp_rank_0 files."""

    def get_data_parallel_rank(self) -> int:
        return 0


class PipeInMpu(mm.MegatronMPU):
    """Megatron's model-parallel axis spanning pipeline x tensor (2 x 2), data 1."""

    def __init__(self, tp: int) -> None:
        super().__init__(tp)
        import torch.distributed as dist

        for r in range(dist.get_world_size()):  # data 1: every rank its own data-parallel group
            group = dist.new_group([r])
            if r == self.rank:
                self._dp_group = group

    def get_model_parallel_world_size(self) -> int:
        return 4

    def get_model_parallel_rank(self) -> int:
        return self.rank

    def get_data_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_rank(self) -> int:
        return 0


def body(rank: int, world: int, tmp: str) -> dict:
    import deepspeed_c

    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    out = {}
    for name, make in (("missing", lambda: NoDataRank(tp=2)), ("overlap", Overlapping),
                       ("sizes", lambda: WrongSizes(tp=2)), ("pipe", lambda: PipeInMpu(tp=2)),
                       ("rank", lambda: DataRankZero(tp=2))):
        mpu = make()
        try:
            deepspeed_c.initialize(model=mm.MegatronGPT(mpu.context()), config=cfg, mpu=mpu)
            out[name] = ("accepted", "")
        except (TypeError, ValueError, NotImplementedError) as e:
            out[name] = (type(e).__name__, str(e))
    from deepspeed_c.moe.layer import MoE

    mpu = mm.MegatronMPU(tp=2)  # a good mpu with MoE layers: expert groups over tensor ranks are not built
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), MoE(hidden_size=4, expert=torch.nn.Linear(4, 4), num_experts=2))
    try:
        deepspeed_c.initialize(model=model, config=cfg, mpu=mpu)
        out["moe"] = ("accepted", "")
    except NotImplementedError as e:
        out["moe"] = (type(e).__name__, str(e))
    mpu = mm.MegatronMPU(tp=2)  # a good mpu, but node-local checkpoint storage: not built for mp_rank files
    engine, *_ = deepspeed_c.initialize(model=mm.MegatronGPT(mpu.context()), mpu=mpu,
                                        config=dict(cfg, checkpoint={"use_node_local_storage": True}))
    try:
        engine.save_checkpoint(tmp, tag="t")
        out["node_local"] = ("accepted", "")
    except NotImplementedError as e:
        out["node_local"] = (type(e).__name__, str(e))
    torch.distributed.barrier()
    return out


def test_bad_mpus_are_refused_naming_the_problem(tmp_path):
    for rank, r in enumerate(run_distributed(body, 4, args=(str(tmp_path),), timeout=300)):
        kind, msg = r["missing"]
        assert kind == "TypeError" and "['get_data_parallel_rank']" in msg, msg
        kind, msg = r["overlap"]
        assert kind == "ValueError" and "do not partition the world" in msg, msg
        kind, msg = r["sizes"]
        assert kind == "ValueError" and "data-parallel size 1 x model-parallel size 2 = 2, but the world size is 4" in msg
        kind, msg = r["rank"]  # found on ranks 2 and 3, raised on every rank
        assert kind == "ValueError" and "mpu.get_data_parallel_rank() is 0 on rank 2" in msg, msg
        assert "its rank in mpu.get_data_parallel_group() is 1" in msg, msg
        kind, msg = r["pipe"]
        assert kind == "NotImplementedError" and "PipelineModule" in msg, msg
        kind, msg = r["moe"]
        assert kind == "NotImplementedError" and "MoE layers with tensor parallelism" in msg, msg
        kind, msg = r["node_local"]
        assert kind == "NotImplementedError" and "use_node_local_storage" in msg, msg
