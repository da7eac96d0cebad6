"""Issue 37 item 3: the ZeRO optimizers export their partitions as data (partition_export) and apply a
runtime-layout state (import_partition_state); the checkpointers convert. So the optimizer modules import
no checkpoint code, and the checkpointers reach the ZeRO state only through the export."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "deepspeed_c"
OPTIMIZERS = ("runtime/zero/stage_1_and_2.py", "runtime/zero/stage3.py")
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
    from deepspeed_c.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed_c.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for cls in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
        for name in ("partition_checkpoint_state", "load_checkpoint_state", "load_checkpoint_weights",
                     "partitioned_model_state"):
            assert getattr(cls, name) is getattr(EngineOptimizer, name), (cls.__name__, name)
        assert cls.partition_export is not EngineOptimizer.partition_export
