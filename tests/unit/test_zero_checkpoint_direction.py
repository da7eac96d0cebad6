"""Issue 37 item 3: the ZeRO optimizers export their partitions as data (partition_export) and apply a
runtime-layout state (import_partition_state); the checkpointers convert. So the optimizer modules import
no checkpoint code, and the checkpointers reach the ZeRO state only through the export."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "deepspeed_c"
OPTIMIZERS = ("runtime/zero/stage_1_and_2.py", "runtime/zero/stage3.py", "runtime/zero/moe_zero.py")
CHECKPOINT_PACKAGES = ("deepspeed_c.runtime.checkpointing", "deepspeed_c.checkpoint")


def _imports(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def test_zero_optimizers_import_no_checkpoint_code() -> None:
    for rel in OPTIMIZERS:
        bad = [m for m in _imports(ROOT / rel) if m.startswith(CHECKPOINT_PACKAGES)]
        assert not bad, f"{rel} imports checkpoint code {bad}: export data through partition_export instead"


def test_zero_optimizers_keep_no_checkpoint_entry_points() -> None:
    """The conversion lives on the checkpointer's side: the ZeRO optimizers do not override the protocol's
    file-writing entry points (the base class's defaults say 'not partitioned')."""
    from deepspeed_c.runtime.optimizer_seam import EngineOptimizer
    from deepspeed_c.runtime.zero.moe_zero import MoEZeroOptimizer
    from deepspeed_c.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed_c.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for cls in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, MoEZeroOptimizer):
        for name in ("partition_checkpoint_state", "load_checkpoint_state", "load_checkpoint_weights",
                     "partitioned_model_state"):
            assert getattr(cls, name) is getattr(EngineOptimizer, name), (cls.__name__, name)
        assert cls.partition_export is not EngineOptimizer.partition_export
        assert cls.import_partition_state is not EngineOptimizer.import_partition_state


def test_moe_zero_files_module_is_gone() -> None:
    """The MoE ZeRO optimizer's checkpoint side was runtime/zero/moe_zero_files.py, which called the checkpoint
    code; its export (MemberExports) now goes to runtime/checkpointing/moe.py through checkpointing/zero.py."""
    assert not (ROOT / "runtime/zero/moe_zero_files.py").exists()
    for path in (ROOT / "runtime").rglob("*.py"):
        assert "moe_zero_files" not in _imports(path), path


def test_moe_export_dispatch() -> None:
    """save_partition / load_partition hand a MemberExports to checkpointing/moe.py and its states back to
    the composite's import_partition_state, without calling the composite's file methods."""
    import contextlib

    from deepspeed_c.runtime.checkpointing import moe as checkpoint_moe
    from deepspeed_c.runtime.checkpointing import zero as checkpoint_zero
    from deepspeed_c.runtime.optimizer_seam import EngineOptimizer, MemberExports

    mex = MemberExports(rank=1, world_size=2, members=[])
    calls = []

    class Composite(EngineOptimizer):
        def partition_export(self):  # type: ignore[override]
            return contextlib.nullcontext(mex)

        def import_partition_state(self, state, load_optimizer_states,  # type: ignore[override]
                                   load_from_fp32_weights):
            calls.append(("import", state, load_optimizer_states, load_from_fp32_weights))

        def partition_checkpoint_state(self, param_name):  # type: ignore[override]
            raise AssertionError("the checkpointer converts the export")

        def load_checkpoint_state(self, saved, load_optimizer_states):  # type: ignore[override]
            raise AssertionError("the checkpointer converts the export")

    orig_save, orig_load = checkpoint_moe.save_members, checkpoint_moe.load_members
    try:
        checkpoint_moe.save_members = lambda ex, name: (ex.rank, {"seen": ex})  # type: ignore[assignment]
        checkpoint_moe.load_members = lambda ex, saved, states: [{"m": 0}, {"m": 1}]  # type: ignore[assignment]
        assert checkpoint_zero.save_partition(Composite(), str) == (1, {"seen": mex})

        class Saved:
            load_from_fp32_weights = False

        checkpoint_zero.load_partition(Composite(), Saved(), True)  # type: ignore[arg-type]
    finally:
        checkpoint_moe.save_members, checkpoint_moe.load_members = orig_save, orig_load
    assert calls == [("import", [{"m": 0}, {"m": 1}], True, False)]
