"""MiCS (runtime/zero/mics.py: `zero_optimization.mics_shard_size`, `mics_hierarchical_params_gather`,
`deepspeed_c.zero.MiCS_Init`) on 4 gloo ranks, one shared launch for the module.

A tiny GPT (embeddings, causal attention without q/k/v bias (the key bias's gradient is rounding noise that
Adam would blow up to a step), MLP, untied head) trained 4 steps with gradient accumulation 2,
clipping 0.5 and AdamW, every rank feeding its own micro-batches:
- mics_shard_size 2 (2 shard groups x 2), model partitioned by MiCS_Init(module=...) (the resumed engine's is
  built under the MiCS_Init context): each rank holds 1/2 of every
  parameter; the weights and losses equal single-process float64 PyTorch training on all 4 ranks' batches
  within 1e-5 (norm-wise relative; measured ~3e-7: fp32 sums in another order);
- the replica all-reduce runs once per step (not per micro-step); mics_shard_size 1 (whole parameters on every
  rank, the replica all-reduce alone) trains the same within the same tolerance;
- hierarchical gather on (one rank per node: the cross-node gather is the shard group's) equals it off,
  bit for bit; at shard size 4 (= world), flat and with 2 "nodes" of 2 (NDEV_PER_NODE=2: cross-node, then intra-node
  gather and the permutation) it equals plain ZeRO-3 bit for bit;
- checkpoints: written in DeepSpeed's MiCS layout (first shard group only: zero_pp_rank_0/1 files,
  dp_world_size 4); a MiCS engine resuming from the step-2 checkpoint repeats the uninterrupted run's
  steps 3-4 exactly, and a plain ZeRO-3 engine on 4 ranks loads the same checkpoint (resharded 2 -> 4)
  with exactly the saved weights, which zero_to_fp32 consolidates too;
- bytes received from outside the shard group, counted per collective (benchmarks/mics.py): 4x fewer than plain
  ZeRO-3 at shard size 2 on 4 ranks, same losses; a 2-rank launch: shard size 2 = world is ZeRO-3 bit for bit;
- bad input: mics_shard_size 3 on 4 ranks raises naming the key; at stage 2 the config is refused naming it.
Under DSC_TEST_BACKEND=nccl the same run takes one GPU a rank (.devrun/gpu_46b.sh, 4 GPUs)."""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.harness import deterministic, rank_device, run_distributed

VOCAB, SEQ, D, MICRO, GAS, STEPS, WORLD, SAVE_AT = 32, 8, 16, 2, 2, 4, 4, 2
TOL = 1e-5
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d, bias=False), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, 2, d // 2).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, dim=-1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(VOCAB, D), torch.nn.Embedding(SEQ, D)
        self.blocks = torch.nn.ModuleList(Block(D) for _ in range(2))
        self.ln, self.head = torch.nn.LayerNorm(D), torch.nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _gpt(seed: int = 7) -> GPT:
    torch.manual_seed(seed)
    return GPT()


def _tokens(step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def _config(**zero: Any) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.5,
            "steps_per_print": 10**9, "optimizer": ADAMW,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}


def _weights(engine: Any) -> dict[str, np.ndarray]:
    import deepspeed_c

    params = list(engine.module.named_parameters())
    with deepspeed_c.zero.GatheredParameters([p for _, p in params]):
        return {n: p.detach().cpu().clone().numpy() for n, p in params}


def _train(engine: Any, rank: int, steps: range, save: str = "") -> list[float]:
    losses = []
    for step in steps:
        if save and step == SAVE_AT:
            engine.save_checkpoint(save, tag="mid")
        for micro in range(GAS):
            loss = engine(_tokens(step, micro, rank).to(rank_device()))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


def _engine(cfg: dict, mics_init: str = "", seed: int = 7) -> Any:
    """mics_init: "module" partitions a model built whole on the host (DeepSpeed's MiCS_Init(module=...): the host
    generator's weights on every backend), "context" builds it under MiCS_Init (on the GPU under nccl)."""
    import deepspeed_c

    if mics_init == "context":
        with deepspeed_c.zero.MiCS_Init(config_dict_or_path=cfg):
            model = _gpt(seed)
    else:
        model = _gpt(seed)
        if mics_init == "module":
            deepspeed_c.zero.MiCS_Init(module=model, config_dict_or_path=cfg)
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def body(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    deterministic()  # DSC_TEST_BACKEND=nccl (.devrun/gpu_46b.sh): one GPU a rank, bitwise checks hold there too
    out: dict[str, Any] = {}
    # MiCS 2 x 2, built under MiCS_Init; saved at step 2
    cfg2 = _config(mics_shard_size=2)
    engine = _engine(cfg2, mics_init="module")
    store = engine.optimizer.store
    out["shard"] = (store.world_size, sum(int(s.numel()) for s in store.shards),
                    sum(int(p.ds_numel) for p in engine.module.parameters()))
    out["mics2_losses"] = _train(engine, rank, range(STEPS), save=ckpt)
    out["mics2"] = _weights(engine)
    out["replica_all_reduces"] = engine.optimizer.replica_all_reduces
    out["optimizer"] = type(engine.optimizer).__name__
    out["first_group"] = engine.is_first_weights_partition_group()
    # shard size 1: whole parameters on every rank, only the replica all-reduce
    engine = _engine(_config(mics_shard_size=1), mics_init="module")
    _train(engine, rank, range(STEPS))
    out["mics1"] = _weights(engine)
    # hierarchical gather, one rank per node: the same numbers
    os.environ["NDEV_PER_NODE"] = "1"
    engine = _engine(_config(mics_shard_size=2, mics_hierarchical_params_gather=True))
    out["mics2h_losses"] = _train(engine, rank, range(STEPS))
    out["mics2h"] = _weights(engine)
    # shard size = world, 2 nodes of 2 ranks: cross-node + intra-node gathers; and plain ZeRO-3
    os.environ["NDEV_PER_NODE"] = "2"
    engine = _engine(_config(mics_shard_size=4, mics_hierarchical_params_gather=True), mics_init="module")
    out["mics4h_losses"] = _train(engine, rank, range(STEPS))
    out["hier_collectives"] = engine.optimizer.store.gatherer.collectives
    out["mics4h"] = _weights(engine)
    engine = _engine(_config(mics_shard_size=4), mics_init="module")  # the flat gather at shard size = world
    out["mics4_losses"] = _train(engine, rank, range(STEPS))
    out["mics4"] = _weights(engine)
    engine = _engine(_config())
    out["zero3_losses"] = _train(engine, rank, range(STEPS))
    out["zero3"] = _weights(engine)
    # resume: another MiCS engine (other initial weights) from the step-2 checkpoint
    engine = _engine(cfg2, mics_init="context", seed=99)
    engine.load_checkpoint(ckpt, tag="mid")
    out["resumed_losses"] = _train(engine, rank, range(SAVE_AT, STEPS))
    out["resumed"] = _weights(engine)
    # plain ZeRO-3 on 4 ranks loads the MiCS checkpoint (partitions resharded 2 -> 4)
    engine = _engine(_config(), seed=99)
    engine.load_checkpoint(ckpt, tag="mid")
    out["zero3_loaded"] = _weights(engine)
    out["files"] = sorted(os.listdir(os.path.join(ckpt, "mid")))
    # stage 3 without an optimizer (evaluation): the store sharded over the shard group
    cfg = {k: v for k, v in cfg2.items() if k != "optimizer"}
    engine = _engine(cfg, mics_init="module")
    out["eval_shard_world"] = engine.optimizer.store.world_size
    with torch.no_grad():
        out["eval_loss"] = float(engine(_tokens(0, 0, rank).to(rank_device())))
    try:
        _engine(_config(mics_shard_size=3))
        out["bad_size"] = ""
    except ValueError as e:
        out["bad_size"] = str(e)
    return out


def _reference(steps: int, world: int = WORLD) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, float64: each step's gradient of the mean loss over `world` ranks x 2 micro-batches, clipped to
    norm 0.5 (DeepSpeed's coefficient), AdamW. Returns rank 0's losses, the weights at SAVE_AT and at the end.
    One thread: the test process's default thread count, on a loaded machine, made it 50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_steps(steps, world)
    finally:
        torch.set_num_threads(threads)


def _reference_steps(steps: int, world: int) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = _gpt().double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses, mid = [], {}
    for step in range(steps):
        if step == SAVE_AT:
            mid = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        for micro in range(GAS):
            for rank in range(world):
                loss = model(_tokens(step, micro, rank))
                (loss / (GAS * world)).backward()
                if rank == 0:
                    losses.append(float(loss.detach()))
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters())).item()
        coef = min(1.0, 0.5 / (norm + 1e-6))
        for p in model.parameters():
            p.grad.mul_(coef)
        opt.step()
    return losses, mid, {n: p.detach().clone() for n, p in model.named_parameters()}


def _close(a: Any, b: Any, tol: float = TOL) -> None:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    assert (a - b).norm() <= tol * max(b.norm().item(), 1e-12), ((a - b).norm() / b.norm()).item()


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory: Any) -> str:
    return str(tmp_path_factory.mktemp("mics") / "ckpt")


@pytest.fixture(scope="module")
def runs(ckpt_dir: str) -> list[dict[str, Any]]:
    return run_distributed(body, WORLD, args=(ckpt_dir,), timeout=300)


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return _reference(STEPS)


def test_mics_2x2_equals_single_process_training(runs: list[dict[str, Any]], reference: Any) -> None:
    ref_losses, _, ref = reference
    for rank, r in enumerate(runs):
        assert r["optimizer"] == "MiCS_Optimizer"
        assert r["first_group"] == (rank < 2)  # DeepSpeed's writer of the MiCS checkpoint files
        world, local, full = r["shard"]
        assert world == 2 and full // 2 <= local <= full // 2 + 64, r["shard"]  # 1/2 of the model, not 1/4
        for name, w in ref.items():
            _close(r["mics2"][name], w)
            _close(r["mics1"][name], w)
        if rank == 0:
            np.testing.assert_allclose(r["mics2_losses"], ref_losses, rtol=TOL)
        assert r["replica_all_reduces"] == STEPS  # once per step, after the boundary's reduce-scatters
        _equal(r["mics2"], runs[0]["mics2"])  # every replica holds the same model
        assert r["eval_loss"] == r["mics2_losses"][0]  # no optimizer: same gathers, same first loss
        assert r["eval_shard_world"] == 2


def test_hierarchical_gather_is_bitwise_the_flat_one(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        _equal(r["mics2h"], r["mics2"])
        assert r["mics2h_losses"] == r["mics2_losses"]
        # shard size = world: MiCS is ZeRO-3; the 2-level gather (cross-node + intra-node, permuted) too
        _equal(r["mics4h"], r["zero3"])
        assert r["mics4h_losses"] == r["zero3_losses"]
        _equal(r["mics4"], r["zero3"])
        assert r["mics4_losses"] == r["zero3_losses"]
        assert r["hier_collectives"] > 0


def test_checkpoint_layout_resume_and_reshard(runs: list[dict[str, Any]], reference: Any, ckpt_dir: str) -> None:
    from deepspeed_c.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    _, ref_mid, _ = reference
    consolidated = get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag="mid")  # 2 partitions, 4 ranks ran
    for name, w in ref_mid.items():
        assert np.array_equal(consolidated[name].numpy(), runs[0]["zero3_loaded"][name]), name
    files = runs[0]["files"]
    assert [f for f in files if "zero_pp_rank" in f] == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    for r in runs:
        _equal(r["resumed"], r["mics2"])
        assert r["resumed_losses"] == r["mics2_losses"][SAVE_AT * GAS:]
        for name, w in ref_mid.items():
            _close(r["zero3_loaded"][name], w)
    # the ZeRO-3 engine holds exactly the weights the MiCS run had at the save (same on every rank)
    for r in runs[1:]:
        _equal(r["zero3_loaded"], runs[0]["zero3_loaded"])


def test_bad_input_names_the_key(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        assert "mics_shard_size" in r["bad_size"] and "divide" in r["bad_size"]
    from deepspeed_c.runtime.config.zero import parse_zero_config

    with pytest.raises(ValueError, match="mics_shard_size"):
        parse_zero_config({"zero_optimization": {"stage": 2, "mics_shard_size": 2}})
    with pytest.raises(NotImplementedError, match="offload_optimizer"):
        parse_zero_config({"zero_optimization": {"stage": 3, "mics_shard_size": 2,
                                                 "offload_optimizer": {"device": "cpu"}}})


def body_two(rank: int, world: int) -> dict[str, Any]:
    """2 ranks: shard size 2 (= world, flat and hierarchical over 2 one-rank "nodes") is ZeRO-3; shard size 1 is
    the replica all-reduce alone; shard size 4 does not divide 2."""
    deterministic()
    out: dict[str, Any] = {}
    for name, zero in (("mics2", {"mics_shard_size": 2}), ("zero3", {}), ("mics1", {"mics_shard_size": 1})):
        engine = _engine(_config(**zero), mics_init="module" if zero else "")
        out[f"{name}_losses"] = _train(engine, rank, range(STEPS))
        out[name] = _weights(engine)
        out[f"{name}_optimizer"] = type(engine.optimizer).__name__
    os.environ["NDEV_PER_NODE"] = "1"
    engine = _engine(_config(mics_shard_size=2, mics_hierarchical_params_gather=True), mics_init="module")
    out["mics2h_losses"] = _train(engine, rank, range(STEPS))
    out["mics2h"] = _weights(engine)
    out["hier_collectives"] = engine.optimizer.store.gatherer.collectives
    try:
        _engine(_config(mics_shard_size=4))
        out["bad_size"] = ""
    except ValueError as e:
        out["bad_size"] = str(e)
    return out


def test_mics_two_ranks_equals_zero3_and_single_process() -> None:
    """Issue 46's bar on 2 gloo ranks (the module's launch is 4): MiCS at shard size = world equals plain ZeRO-3
    bit for bit (flat and hierarchical gather); shard size 1 equals single-process float64 training."""
    runs = run_distributed(body_two, 2, timeout=300)
    ref_losses, _, ref = _reference(STEPS, world=2)
    for rank, r in enumerate(runs):
        assert r["mics2_optimizer"] == r["mics1_optimizer"] == "MiCS_Optimizer", r["mics2_optimizer"]
        assert r["zero3_optimizer"] != "MiCS_Optimizer"
        _equal(r["mics2"], r["zero3"])
        assert r["mics2_losses"] == r["zero3_losses"]
        _equal(r["mics2h"], r["zero3"])
        assert r["mics2h_losses"] == r["zero3_losses"] and r["hier_collectives"] > 0
        for name, w in ref.items():
            _close(r["mics1"][name], w)
            _close(r["zero3"][name], w)
        if rank == 0:
            np.testing.assert_allclose(r["mics1_losses"], ref_losses, rtol=TOL)
        assert "mics_shard_size=4" in r["bad_size"] and "(2)" in r["bad_size"], r["bad_size"]


def body_bytes(rank: int, world: int) -> dict[str, Any]:
    """benchmarks/mics.py's run on 4 ranks: each collective's bytes counted as it is issued, split by
    whether they come from inside or outside the rank's block of 2 (MiCS's shard group)."""
    from types import SimpleNamespace

    from benchmarks.mics import Bytes, _run

    backend = "nccl" if rank_device().type == "cuda" else "gloo"  # DSC_TEST_BACKEND=nccl: one GPU a rank
    args = SimpleNamespace(backend=backend, layers=2, d=32, vocab=64, seq=16, micro=2, gas=2, warmup=1, steps=2,
                           shard=2)
    counter = Bytes(args.shard)
    try:
        return {"zero3": _run(rank, args, "zero3", counter), "mics": _run(rank, args, "mics", counter)}
    finally:
        counter.restore()


def test_mics_fewer_bytes_between_shard_groups() -> None:
    """Issue 46's bar (counted on gloo here): MiCS at shard size 2 on 4 ranks trains plain ZeRO-3's losses while
    receiving far fewer bytes from outside its shard group (gathers stay inside; only the replica all-reduce of
    the gradient partitions crosses)."""
    for rank, r in enumerate(run_distributed(body_bytes, WORLD, timeout=300)):
        z, m = r["zero3"], r["mics"]
        np.testing.assert_allclose(m["losses"], z["losses"], rtol=1e-4)
        assert z["outside"] > 0 and m["outside"] > 0, (z, m)  # both counted something across the blocks
        assert m["outside"] * 3 < z["outside"], (rank, m["outside"], z["outside"])  # 4.0x fewer measured
