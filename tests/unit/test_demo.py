"""A short run of the README's main job through the real launcher: 2 CPU ranks, the loss falls,
and the CSV and PNG are written."""
import csv
import os
import subprocess
import sys

from tests.harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_gpt_demo_short(tmp_path):
    out = tmp_path / "out"
    # a free port: the launcher's default (29500) may be taken by another test's job running beside this one
    cmd = [sys.executable, "-m", "deepspeed_c.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, "examples", "train_gpt", "train.py"), "--steps", "60", "--n_layer", "2", "--n_embd", "64",
           "--deepspeed_config", os.path.join(ROOT, "examples", "train_gpt", "ds_config.json"),
           "--out_dir", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert proc.returncode == 0, proc.stdout[-3000:]
    with open(out / "loss.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 60 and [int(r["step"]) for r in rows] == list(range(1, 61))
    losses = [float(r["loss"]) for r in rows]
    head, tail = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert tail < 0.8 * head, (head, tail)
    assert (out / "loss.png").stat().st_size > 10_000
    assert "loss" in proc.stdout and "->" in proc.stdout
