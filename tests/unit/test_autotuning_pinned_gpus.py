"""`deepspeed_c --autotuning` under CUDA_VISIBLE_DEVICES: the launcher turns the variable into --include and
drops it (as DeepSpeed's does), so the tuner's experiment relaunches must carry that --include, or each
experiment would see every GPU of the node (another world size than the one tuned for)."""
from __future__ import annotations

from typing import Any

import pytest


def test_autotuner_relaunches_keep_the_visible_devices(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import deepspeed_c.autotuning.autotuner as autotuner
    from deepspeed_c.launcher import runner

    seen: dict[str, Any] = {}

    def fake_tune(mode: str, raw: list, user_script: str, world: int) -> int:
        seen.update(mode=mode, raw=list(raw), world=world)
        return 0

    monkeypatch.setattr(autotuner, "main", fake_tune)
    monkeypatch.setattr(runner, "count_local_gpus", lambda: 4)
    monkeypatch.setattr(runner, "_local_resource_pool", lambda: {"localhost": 4})
    monkeypatch.setattr(runner, "fetch_hostfile", lambda path: {})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    with pytest.raises(SystemExit) as done:
        runner.main(["--autotuning", "tune", str(script), "--deepspeed_config", "ds.json"])
    assert done.value.code == 0
    assert seen["raw"][:2] == ["--include", "localhost:2"], seen["raw"]
    assert seen["raw"][2:] == ["--autotuning", "tune", str(script), "--deepspeed_config", "ds.json"]
    assert seen["world"] == 1

    # without the variable nothing is added: the user's own flags go through unchanged
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the launcher dropped it
    with pytest.raises(SystemExit):
        runner.main(["--num_gpus", "2", "--autotuning", "run", str(script)])
    assert seen["raw"] == ["--num_gpus", "2", "--autotuning", "run", str(script)] and seen["world"] == 2
