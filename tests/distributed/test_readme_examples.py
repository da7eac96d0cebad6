"""Every Python block of README.md that is meant to run is run here, as the README shows it.

The blocks are extracted with the marker convention of tests/distributed/readme_blocks.py: a
```python block is preceded by `<!-- runnable: file=NAME.py check=... -->` or by
`<!-- not-runnable: why -->`; a runnable block is followed by `<!-- file: NAME -->` blocks (its
config) and one `<!-- command -->` block. A ```python block with neither marker fails
test_every_python_block_is_marked, with a message saying how to mark it.

Each runnable example is written into a fresh directory and its command is run there by bash,
as shown, with the venv's `deepspeed_c` launcher first on PATH (without GPUs, `--num_gpus 2`
starts 2 CPU ranks on gloo). The run must exit 0 and show what its `check=` asks for (the loss
falls, a file appears). One exception to "as shown": if the launcher reports that its default
rendezvous port is taken (another job on this shared machine), the run is repeated once with
`--master_port` of a free port added after the launcher's name.
"""
from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

from tests.distributed.readme_blocks import Example, ReadmeConventionError, plan

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
VENV_BIN = pathlib.Path(sys.executable).parent  # the venv whose deepspeed_c the suite tests
TIMEOUT_S = 240
_LOSS = re.compile(r"\bloss[\s=:]+(-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)")
_PORT_TAKEN = "(--master_port; rank 0 listens on it"  # the launcher's message (launcher/port_check.py)


def _examples() -> list[Example]:
    try:
        return plan(README.read_text())
    except ReadmeConventionError:
        return []  # test_every_python_block_is_marked reports it


def test_every_python_block_is_marked() -> None:
    examples = plan(README.read_text())  # raises, listing each unmarked block and how to mark it
    assert examples, "README.md has no runnable example: its first example must be marked runnable"


def test_an_unmarked_block_fails_with_instructions() -> None:
    text = "# t\n\n```python\nprint(1)\n```\n"
    with pytest.raises(ReadmeConventionError, match=r"line 3: ```python block without .*not-runnable"):
        plan(text)
    with pytest.raises(ReadmeConventionError, match="no `<!-- command -->` block"):
        plan("<!-- runnable: file=a.py check=loss-falls -->\n```python\nprint(1)\n```\n")
    ok = plan("<!-- runnable: file=a.py check=loss-falls -->\n```python\nx = 1\n```\n<!-- file: c.json -->\n"
              "```json\n{}\n```\n<!-- command -->\n```bash\npython a.py\n```\n\n"
              "<!-- not-runnable: a fragment -->\n```python\nengine.step()\n```\n")
    assert [(e.script, sorted(e.files), e.command) for e in ok] == [("a.py", ["a.py", "c.json"], "python a.py")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _run(command: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}  # a fresh shell's
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(["bash", "-e", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)


def _check(example: Example, output: str, cwd: pathlib.Path) -> None:
    for check in example.checks:
        if check == "loss-falls":
            losses = [float(v) for v in _LOSS.findall(output)]
            assert len(losses) >= 3 and losses[-1] < 0.5 * losses[0], (
                f"README.md line {example.line}: expected at least 3 printed losses, the last below half the "
                f"first; got {losses}\n{output[-3000:]}")
        elif check.startswith("creates:"):
            path = cwd / check.split(":", 1)[1]
            assert path.exists(), f"README.md line {example.line}: the run did not create {path}\n{output[-3000:]}"


@pytest.mark.parametrize("example", _examples(), ids=lambda e: f"{e.script}@line{e.line}")
def test_readme_example_runs_as_written(example: Example, tmp_path: pathlib.Path) -> None:
    assert (VENV_BIN / "deepspeed_c").exists(), f"no deepspeed_c launcher beside {sys.executable}"
    if "--num_gpus" in example.command:
        import torch

        wanted = int(re.search(r"--num_gpus[ =](\d+)", example.command).group(1))
        if 0 < torch.cuda.device_count() < wanted:
            pytest.skip(f"the example asks for {wanted} GPUs, this machine has {torch.cuda.device_count()}")
    for name, content in example.files.items():
        (tmp_path / name).write_text(content)
    proc = _run(example.command, tmp_path)
    if proc.returncode != 0 and _PORT_TAKEN in proc.stdout and example.command.startswith("deepspeed_c "):
        # the default port 29500 is another job's right now: same command on a free port
        proc = _run(example.command.replace("deepspeed_c ", f"deepspeed_c --master_port {_free_port()} ", 1),
                    tmp_path)
    assert proc.returncode == 0, (f"README.md line {example.line}: `{example.command}` exited with "
                                  f"{proc.returncode}\n{proc.stdout[-5000:]}")
    _check(example, proc.stdout, tmp_path)
