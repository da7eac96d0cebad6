"""Universal checkpoints (deepspeed_c.checkpoint.ds_to_universal, checkpoint.load_universal): a ZeRO
checkpoint converted to DeepSpeed's universal layout loads at another data-parallel degree and ZeRO stage
and continues with the uninterrupted run's losses (fp32, relative 1e-5).

Ours: saved at DP 2 with ZeRO-1/2/3 (gloo), converted, loaded at DP 1, 2, 3 with stages 0-3; the global
batch (12 samples) is the same at every degree, so the losses are the same function of the weights and
optimizer state. DeepSpeed's: the checkpoints DeepSpeed 0.19.8 wrote (tests/fixtures/deepspeed_written,
ZeRO-1/2 at DP 2) converted by our script load at DP 1 and 2, ZeRO 0-3, and continue with DeepSpeed's
own next losses (`next_losses`)."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.distributed.universal_helpers import resume_deepspeed_written
from tests.harness import run_distributed

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "deepspeed_written")
GLOBAL, SAVE_AT, AFTER = 12, 3, 2


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.emb = torch.nn.Linear(5, 9)
        self.mid = torch.nn.Linear(9, 7)  # sizes that do not divide the ranks evenly
        self.out = torch.nn.Linear(7, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.out(torch.tanh(self.mid(torch.relu(self.emb(x))))), y)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL, 5, generator=g), torch.randn(GLOBAL, 3, generator=g)


def _config(stage: int, world: int, universal: bool) -> dict:
    cfg = {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": GLOBAL // world,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True}},
           "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def _steps(engine: Any, rank: int, world: int, first: int, count: int) -> list[float]:
    losses = []
    n = GLOBAL // world
    for step in range(first, first + count):
        x, y = _batch(step)
        loss = engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(mean)
        losses.append(float(mean) / world)
    return losses


def save_runs(rank: int, world: int, root: str) -> dict:
    import deepspeed_c

    out = {}
    for stage in (1, 2, 3):
        engine = deepspeed_c.initialize(model=Net(), config=_config(stage, world, False))[0]
        _steps(engine, rank, world, 0, SAVE_AT)
        engine.save_checkpoint(os.path.join(root, f"z{stage}"), tag="step3")
        out[stage] = _steps(engine, rank, world, SAVE_AT, AFTER)
        engine.destroy()
    return out


def resume_runs(rank: int, world: int, root: str, targets: list) -> dict:
    import deepspeed_c

    out = {}
    for source, stage in targets:
        engine = deepspeed_c.initialize(model=Net(), config=_config(stage, world, True))[0]
        path, _ = engine.load_checkpoint(os.path.join(root, f"z{source}"))  # the tag from latest_universal
        assert path is not None and "step3_universal" in path
        assert engine.global_steps == SAVE_AT
        out[(source, stage)] = _steps(engine, rank, world, SAVE_AT, AFTER)
        engine.destroy()
    return out


def _convert(folder: str, out: str) -> None:
    from deepspeed_c.checkpoint.ds_to_universal import main, parse_arguments

    main(parse_arguments(["--input_folder", folder, "--output_folder", out, "--inject_missing_state",
                          "--num_extract_workers", "1", "--num_merge_workers", "1"]))


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: Any) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("uc"))
    straight = run_distributed(save_runs, 2, args=(root,), timeout=300)[0]
    for stage in (1, 2, 3):
        folder = os.path.join(root, f"z{stage}")
        _convert(os.path.join(folder, "step3"), os.path.join(folder, "step3_universal"))
    return root, straight


# (source stage, target stage) per world size: every source loads at a changed stage somewhere
TARGETS = {1: [(1, 1), (2, 0), (3, 2)], 2: [(1, 3), (2, 2), (3, 1)], 3: [(1, 2), (2, 3), (3, 3)]}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ours_resume_at_other_degree_and_stage(converted: tuple, world: int) -> None:
    root, straight = converted
    got = run_distributed(resume_runs, world, args=(root, TARGETS[world]), timeout=300)[0]
    for (source, stage), losses in got.items():
        _close(losses, straight[source])


def test_universal_layout(converted: tuple) -> None:
    from deepspeed_c.checkpoint import safe_load

    root, _ = converted
    folder = os.path.join(root, "z2", "step3_universal")
    with open(os.path.join(root, "z2", "latest_universal")) as f:
        assert f.read() == "step3_universal"
    assert sorted(os.listdir(os.path.join(folder, "zero"))) == sorted(
        ["optimizer_state.pt"] + [n for n, _ in Net().named_parameters()])
    rec = safe_load.load(os.path.join(folder, "zero", "mid.weight", "fp32.pt"))
    assert rec["cat_dim"] == 0 and tuple(rec["param"].shape) == (7, 9)
    assert sorted(os.listdir(os.path.join(folder, "zero", "mid.weight"))) == [
        "exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
    assert float(safe_load.load(os.path.join(folder, "zero", "mid.weight", "step.pt"))) == SAVE_AT
    assert not os.path.exists(os.path.join(folder, "tmp"))


# -- checkpoints written by DeepSpeed 0.19.8 ---------------------------------------------------------------
@pytest.mark.parametrize("case", ["z1_fp32_train_w2", "z2_fp32_train_w2"])
def test_deepspeed_written_checkpoint_converts_and_continues(tmp_path: Any, case: str) -> None:
    out = str(tmp_path / "universal")
    _convert(os.path.join(HERE, case, "ckpt"), out)
    want = torch.load(os.path.join(HERE, case, "expected.pt"), weights_only=True)["next_losses"]
    for world, stages in ((1, [0, 1, 3]), (2, [1, 2, 3])):
        got = run_distributed(resume_deepspeed_written, world, args=(out, stages), timeout=300)[0]
        for stage, losses in got.items():
            _close(losses, want)


def test_deepspeed_written_bf16_checkpoint_continues_in_bf16(tmp_path: Any) -> None:
    """bf16 (fp32 masters in the universal files, bf16 weights refreshed from them): DeepSpeed's bf16
    ZeRO-1 checkpoint at ZeRO-1/2/3 and DP 1/2, its next losses to bf16's tolerance (relative 2e-2)."""
    case = "z1_bf16_train_w2"
    out = str(tmp_path / "universal")
    _convert(os.path.join(HERE, case, "ckpt"), out)
    want = torch.load(os.path.join(HERE, case, "expected.pt"), weights_only=True)["next_losses"]
    for world, stages in ((1, [1, 3]), (2, [2])):
        runs = run_distributed(resume_deepspeed_written, world, args=(out, stages, True), timeout=300)
        for stage, losses in runs[0].items():
            for a, b in zip(losses, want):
                assert abs(a - b) <= 2e-2 * abs(b), (stage, world, losses, want)


# -- bad input ---------------------------------------------------------------------------------------------
def _load_error(rank: int, world: int, load_dir: str, tag: str) -> str:
    import deepspeed_c

    engine = deepspeed_c.initialize(model=Net(), config=_config(2, world, True))[0]
    try:
        engine.load_checkpoint(load_dir, tag=tag)
    except Exception as e:  # noqa: BLE001 (the message is what the test checks)
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_load_universal_refuses_a_plain_checkpoint(converted: tuple) -> None:
    root, _ = converted
    err = run_distributed(_load_error, 1, args=(os.path.join(root, "z1"), "step3"), timeout=120)[0]
    assert "not a universal checkpoint" in err and "ds_to_universal" in err


def test_universal_folder_missing_a_parameter_names_it(converted: tuple, tmp_path: Any) -> None:
    import shutil

    root, _ = converted
    broken = str(tmp_path / "broken")
    shutil.copytree(os.path.join(root, "z1", "step3_universal"), broken)
    shutil.rmtree(os.path.join(broken, "zero", "mid.weight"))
    err = run_distributed(_load_error, 1, args=(str(tmp_path), "broken"), timeout=120)[0]
    assert "mid.weight" in err and "no state" in err


def test_deepspeed_checkpoint_inspects_ours(converted: tuple) -> None:
    from deepspeed_c.checkpoint import DeepSpeedCheckpoint

    root, _ = converted
    ckpt = DeepSpeedCheckpoint(os.path.join(root, "z2", "step3"))
    assert (ckpt.tp_degree, ckpt.pp_degree, ckpt.dp_degree) == (1, 1, 2)
    held = sum(t.numel() for dp in range(2) for t in ckpt.get_zero_checkpoint_state(0, 0, dp)["optimizer_state_dict"][
        "single_partition_of_fp32_groups"])
    assert held == sum(p.numel() for p in Net().parameters())


# -- frozen parameters: not in zero/ (the optimizer does not step them), from the copied model-states files --
class FrozenNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.emb.bias.requires_grad_(False)


def _frozen_engine(stage: int, world: int, universal: bool, poison: bool) -> Any:
    import deepspeed_c

    model = FrozenNet()
    if poison:  # the frozen bias must come back from the checkpoint
        with torch.no_grad():
            model.emb.bias.fill_(7.0)
    return deepspeed_c.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                  config=_config(stage, world, universal))[0]


def frozen_save(rank: int, world: int, root: str) -> list[float]:
    engine = _frozen_engine(3, world, False, False)
    _steps(engine, rank, world, 0, SAVE_AT)
    engine.save_checkpoint(root, tag="f")
    return _steps(engine, rank, world, SAVE_AT, AFTER)


def frozen_resume(rank: int, world: int, root: str, stage: int) -> list[float]:
    engine = _frozen_engine(stage, world, True, True)
    engine.load_checkpoint(root, tag="f_universal")
    return _steps(engine, rank, world, SAVE_AT, AFTER)


def test_zero3_frozen_parameters_come_back(tmp_path: Any) -> None:
    root = str(tmp_path)
    want = run_distributed(frozen_save, 2, args=(root,), timeout=300)[0]
    _convert(os.path.join(root, "f"), os.path.join(root, "f_universal"))
    for world, stage in ((1, 3), (2, 1), (1, 0)):
        _close(run_distributed(frozen_resume, world, args=(root, stage), timeout=300)[0], want)
