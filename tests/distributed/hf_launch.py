"""Running a Hugging Face script the way a user does (shared by the Trainer tests): a fresh shell with no
rank variables inherited, the alias distribution first on PYTHONPATH, offline, one OpenMP thread."""
from __future__ import annotations

import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "CROSS_RANK", "CROSS_SIZE")


def run_user_command(cmd: list[str], alias: pathlib.Path, cwd: pathlib.Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    # the caller's own PYTHONPATH entries stay after ours (a machine whose packages live there, such as
    # the offline GPU machine's carried wheels)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join([str(alias), str(ROOT), *inherited]), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=str(cwd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout
