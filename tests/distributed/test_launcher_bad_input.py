"""Bad input met at launch, through the real launcher and real rank processes (2 CPU ranks, gloo).

- The rendezvous port is taken: the launcher refuses before starting any rank, naming the port and
  --master_port (it used to start the ranks, which died with "Connection reset by peer").
- The one-time note about gradient_clipping's changed default is printed by rank 0 only, not once
  per rank.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.harness import free_port

# Each rank records that it started, then trains one step without gradient_clipping in its config.
SCRIPT = textwrap.dedent("""
    import argparse, os
    open(os.path.join(os.environ["OUT_DIR"], "started" + os.environ["RANK"]), "w").close()
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    import torch, deepspeed_c
    model = torch.nn.Linear(4, 2)
    engine, *_ = deepspeed_c.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
""")


def _launch(tmp_path: Path, port: int) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "deepspeed_c.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
           str(script)]
    env = dict(os.environ, OUT_DIR=str(tmp_path), DS_ACCELERATOR="cpu")
    return subprocess.run(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=180)


def test_port_in_use_fails_before_any_rank_starts_naming_port(tmp_path: Path) -> None:
    with socket.socket() as holder:  # another job's rendezvous store, say
        holder.bind(("127.0.0.1", 0))
        holder.listen(8)
        port = holder.getsockname()[1]
        start = time.monotonic()
        proc = _launch(tmp_path, port)
        took = time.monotonic() - start
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert f"rendezvous port {port}" in proc.stdout and "--master_port=" in proc.stdout, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    assert not list(tmp_path.glob("started*")), "ranks were started although the port was taken"
    assert took < 30, took


def test_clipping_default_note_is_printed_once_by_rank_0(tmp_path: Path) -> None:
    proc = _launch(tmp_path, free_port())
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert sorted(p.name for p in tmp_path.glob("started*")) == ["started0", "started1"]
    notes = [ln for ln in proc.stdout.splitlines() if "Config key 'gradient_clipping' is not set" in ln]
    assert len(notes) == 1, json.dumps(notes, indent=1)
