"""examples/rlhf/ppo.py through the real launcher on 2 CPU ranks for a couple of iterations: the actor (hybrid
engine, ZeRO-3, LoRA) generates, the critic scores, both train; metrics.csv has one finite row an iteration."""
import csv
import math
import os
import subprocess
import sys

import pytest

from tests.harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("extra", [["--zero_stage", "3", "--lora_dim", "4"], ["--zero_stage", "2"]])
def test_ppo_example_runs(tmp_path, extra):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "deepspeed_c.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, "examples", "rlhf", "ppo.py"), "--iterations", "2", "--hidden", "32",
           "--out_dir", str(out), *extra]
    proc = subprocess.run(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert proc.returncode == 0, proc.stdout[-3000:]
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["iteration"]) for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 <= float(r["reward"]) <= 1.0
        assert all(math.isfinite(float(r[k])) for k in ("actor_loss", "critic_loss", "iteration_s"))
        assert float(r["gen_tokens_per_s"]) > 0
    assert "iter   2 | reward" in proc.stdout
