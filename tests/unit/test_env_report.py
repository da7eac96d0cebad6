import os
import subprocess
import sys

from deepspeed_c.ops.op_builder import ALL_OPS


def test_env_report_lists_every_op_and_the_toolchain(tmp_path):
    env = dict(os.environ, DSC_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "deepspeed_c.env_report", "--no_color"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True).stdout
    for name in ALL_OPS:
        line = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
        assert "[OKAY]" in line or "[NO]" in line
        if "[OKAY]" in line:
            assert str(tmp_path) in line  # the cache path is reported
    for key in ("torch version", "nvcc", "C compiler", "python version", "CPU SIMD (detected)",
                "DLPack exchange API", "op cache dir"):
        assert key in out
    assert not any(tmp_path.iterdir())  # reporting builds nothing
