"""A full disk, and what crashes leave behind, in one process.

The writes fail for real: a checkpoint file that is a link to /dev/full (the kernel answers every write
with ENOSPC, through Python's file object and torch's zip writer, which hides it behind
"[enforce fail at inline_container.cc] unexpected pos"), and, where user namespaces allow it, a small
tmpfs filled by saving until no space is left. A save that fails so raises OSError(ENOSPC) naming the
file, removes its staging directory and leaves every earlier tag and `latest` as they were. Temporaries
and staging directories of killed saves are removed by the next save, nothing else is; an empty
`latest` raises naming it, a missing one still warns and returns (None, None) as DeepSpeed's does."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import deepspeed_c
from deepspeed_c.checkpoint import store
from tests.unit.test_checkpoint_faults import make, stamp
from tests.harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_FILE = "mp_rank_00_model_states.pt"
pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks


def loaded_step(save_dir: str, tag: str | None = None, hidden: int = 64) -> int:
    fresh = make(hidden)
    path, _ = fresh.load_checkpoint(save_dir, tag=tag)
    assert path is not None
    for name, p in fresh.module.named_parameters():
        assert torch.all(p == float(fresh.global_steps)), f"{name} does not hold save {fresh.global_steps}'s weights"
    return fresh.global_steps


def full_disk_for(monkeypatch, names: tuple[str, ...]) -> None:
    """The named checkpoint files are written into /dev/full: every write fails with a real ENOSPC."""
    real = store.save_file

    def save_file(obj, path):
        if os.path.basename(path) in names:
            os.symlink("/dev/full", path)
        return real(obj, path)

    monkeypatch.setattr(store, "save_file", save_file)


def test_enospc_names_the_file_and_keeps_what_was_saved(tmp_path, monkeypatch):
    save_dir = str(tmp_path)
    engine = make()
    stamp(engine, 1)
    engine.save_checkpoint(save_dir)
    before = sorted(os.listdir(save_dir))
    full_disk_for(monkeypatch, (MODEL_FILE,))
    stamp(engine, 2)
    with pytest.raises(OSError) as info:
        engine.save_checkpoint(save_dir)
    e = info.value
    assert e.errno == errno.ENOSPC, repr(e)
    assert MODEL_FILE in str(e) and e.filename.endswith(MODEL_FILE), str(e)
    assert "inline_container" not in str(e), str(e)
    # the failed save's staging directory is gone; the earlier tag and `latest` are as they were
    assert sorted(os.listdir(save_dir)) == before, os.listdir(save_dir)
    assert store.read_latest(save_dir) == "global_step1"
    monkeypatch.undo()
    assert loaded_step(save_dir) == 1
    stamp(engine, 3)  # the disk has room again: saving works
    engine.save_checkpoint(save_dir)
    assert loaded_step(save_dir) == 3 and loaded_step(save_dir, "global_step1") == 1


def test_enospc_in_save_16bit_model_names_the_file(tmp_path, monkeypatch):
    engine = make()
    real = store._write_new

    def write_new(path, write, target=None):  # the temporary torch_save_atomic writes is a link to /dev/full
        os.symlink("/dev/full", path)
        return real(path, write, target)

    monkeypatch.setattr(store, "_write_new", write_new)
    with pytest.raises(OSError) as info:
        engine.save_16bit_model(str(tmp_path), "weights.bin")
    assert info.value.errno == errno.ENOSPC and "weights.bin" in str(info.value), str(info.value)
    assert os.listdir(tmp_path) == [], "the failed write's temporary must be removed"


def test_next_save_removes_what_killed_saves_left_and_nothing_else(tmp_path):
    save_dir = str(tmp_path)
    engine = make()
    stamp(engine, 1)
    engine.save_checkpoint(save_dir)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs: a killed saver's
    stale = [f"latest.tmp{dead.pid}", f"latest.tmp{os.getpid()}", f"zero_to_fp32.py.tmp{dead.pid}"]
    for name in stale:
        with open(os.path.join(save_dir, name), "w") as f:
            f.write("global_st")  # torn
    os.makedirs(os.path.join(save_dir, ".global_step7.partial"))
    with open(os.path.join(save_dir, ".global_step7.partial", MODEL_FILE), "wb") as f:
        f.write(b"\0" * 4096)
    # names that are not a killed save's temporaries: the user's files stay
    users = ["latest.tmp", "latest.tmp12x", "notes.tmp1", "latest.backup", ".partial", "my.partial"]
    for name in users:
        with open(os.path.join(save_dir, name), "w") as f:
            f.write("mine")
    os.makedirs(os.path.join(save_dir, ".global_step1.old.keep"))
    stamp(engine, 2)
    engine.save_checkpoint(save_dir)
    left = set(os.listdir(save_dir))
    assert not left & set(stale), f"stale temporaries stayed: {sorted(left & set(stale))}"
    assert ".global_step7.partial" not in left, "a killed save's staging directory stayed"
    assert set(users) <= left and ".global_step1.old.keep" in left, f"a user's file was removed: {sorted(left)}"
    assert loaded_step(save_dir) == 2 and loaded_step(save_dir, "global_step1") == 1


@pytest.mark.parametrize("content", ["", "  \n", "\n"])
def test_empty_latest_raises_naming_it(tmp_path, content):
    engine = make()
    stamp(engine, 1)
    engine.save_checkpoint(str(tmp_path))
    latest = os.path.join(str(tmp_path), "latest")
    with open(latest, "w") as f:
        f.write(content)
    with pytest.raises(ValueError) as info:
        make().load_checkpoint(str(tmp_path))
    assert latest in str(info.value) and "empty" in str(info.value), str(info.value)
    assert "global_step1" in str(info.value), "the message lists the tags there are"
    assert loaded_step(str(tmp_path), "global_step1") == 1  # an explicit tag still loads


def test_missing_latest_warns_and_loads_nothing(tmp_path):
    engine = make()
    engine.save_checkpoint(str(tmp_path), save_latest=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert make().load_checkpoint(str(tmp_path)) == (None, None)


# -- a real full disk: a small tmpfs in a user namespace ---------------------------------------------------
def fill(save_dir: str, hidden: int) -> None:
    """Run inside the namespace: save until the disk is full, then report what a resumed run finds."""
    engine = make(hidden)
    saved, report = [], {}
    for step in range(1, 200):
        stamp(engine, step)
        try:
            engine.save_checkpoint(save_dir)
            saved.append(step)
        except OSError as e:
            report = {"failed": step, "errno": e.errno, "error": str(e), "filename": e.filename}
            break
    latest = store.read_latest(save_dir)
    report.update(saved=saved, latest=latest, listing=sorted(os.listdir(save_dir)),
                  loaded=loaded_step(save_dir, None, hidden),
                  every=[loaded_step(save_dir, f"global_step{s}", hidden) for s in saved])
    for name in os.listdir(save_dir):  # room again: every tag but the one `latest` names goes
        if name.startswith("global_step") and name != latest:
            shutil.rmtree(os.path.join(save_dir, name))
    stamp(engine, 500)
    engine.save_checkpoint(save_dir)
    report["after_freeing"] = loaded_step(save_dir, None, hidden)
    print("REPORT " + json.dumps(report))


def _unshare() -> str | None:
    exe = shutil.which("unshare")
    if exe is None or subprocess.run([exe, "-Urm", "true"], capture_output=True).returncode != 0:
        return None
    return exe


# (model width, disk size, the file the disk fills in): a wide model's fills in its model-states file; a
# narrow one's where its sizes put it (today: the manifest), so None: any file of the save
@pytest.mark.parametrize("hidden, size_kib, in_file", [(256, 2600, MODEL_FILE), (64, 300, None)])
def test_real_full_disk_on_tmpfs(tmp_path, hidden, size_kib, in_file):
    exe = _unshare()
    if exe is None:
        pytest.skip("user namespaces are not available here (unshare -Urm): no tmpfs without root")
    mnt = str(tmp_path / "disk")
    os.makedirs(mnt)
    script = (f"mount -t tmpfs -o size={size_kib}k tmpfs {mnt} && exec {sys.executable} -c "
              f"'from tests.unit.test_checkpoint_disk_full import fill; fill(\"{mnt}\", {hidden})'")
    run = subprocess.run([exe, "-Urm", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": str(free_port())})
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("REPORT ")]
    assert run.returncode == 0 and lines, f"rc {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    report = json.loads(lines[-1][len("REPORT "):])
    assert report.get("errno") == errno.ENOSPC, report
    assert report["filename"] and report["filename"].startswith(mnt) and report["filename"] in report["error"], report
    assert "while writing checkpoint file" in report["error"], report
    assert "inline_container" not in report["error"], report
    assert len(report["saved"]) >= 1, report
    assert in_file is None or report["filename"].endswith(in_file), report
    assert report["latest"] == f"global_step{report['saved'][-1]}", "the failed save moved `latest`"
    assert report["loaded"] == int(report["latest"].removeprefix("global_step")), report
    assert report["every"] == report["saved"], "a tag saved before the disk filled no longer loads"
    leftovers = [n for n in report["listing"] if n.endswith(".partial") or ".tmp" in n]
    assert not leftovers, f"the failed save left {leftovers}"
    assert report["after_freeing"] == 500, report
