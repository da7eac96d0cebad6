"""The nvme_path check run at initialize (runtime/swap_tensor/utils.check_nvme_path): a full
filesystem and a read-only one fail naming the path and the bytes needed (the free space compared
with shutil.disk_usage, the independent figure)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from deepspeed_c.runtime.swap_tensor.utils import check_nvme_path

KEY = "zero_optimization.offload_optimizer.nvme_path"


def test_not_enough_space_names_path_and_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    free = shutil.disk_usage(tmp_path).free
    need = free // 2 + 4096  # fits once, not for two local ranks
    with pytest.raises(OSError, match=rf"{tmp_path}.*need {need} bytes.*x 2 local rank\(s\) = {need * 2} bytes"):
        check_nvme_path(KEY, str(tmp_path), need)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert check_nvme_path(KEY, str(tmp_path), need) == str(tmp_path)


def test_read_only_filesystem(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    try:
        with pytest.raises(PermissionError, match=rf"{KEY}.*{mnt} is not writable.*123 bytes"):
            check_nvme_path(KEY, str(mnt), 123)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_missing_path_is_created_a_file_is_refused(tmp_path):
    # DeepSpeed creates a missing nvme_path (os.makedirs of its swap folder); parents too
    missing = tmp_path / "a" / "b"
    assert check_nvme_path(KEY, missing, 10) == str(missing) and missing.is_dir()
    assert check_nvme_path(KEY, str(missing), 10) == str(missing)  # existing: unchanged
    afile = tmp_path / "f"
    afile.write_text("")
    with pytest.raises(NotADirectoryError, match=rf"{KEY}.*{afile} is not a directory.*10 bytes"):
        check_nvme_path(KEY, str(afile), 10)
    under = afile / "sub"  # cannot be created: a parent is a file
    with pytest.raises(OSError, match=rf"{KEY}.*{under} does not exist and cannot be created.*10 bytes"):
        check_nvme_path(KEY, str(under), 10)
    assert not os.path.exists(under)
