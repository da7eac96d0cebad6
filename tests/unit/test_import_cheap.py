"""`import deepspeed_c` builds nothing, starts no subprocess, and initialises neither CUDA nor
torch.distributed; even touching the lazy public names does not."""
import json
import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import json, os, subprocess, sys
    spawned = []
    real_init = subprocess.Popen.__init__
    def spy(self, *a, **k):
        spawned.append(repr(a[0] if a else k.get("args")))
        return real_init(self, *a, **k)
    subprocess.Popen.__init__ = spy
    real_fork = os.fork
    def fork_spy():
        spawned.append("fork")
        return real_fork()
    os.fork = fork_spy
    import deepspeed_c
    import deepspeed_c.utils
    deepspeed_c.utils.logger.info
    import torch, torch.distributed as dist
    report = {
        "spawned": spawned,
        "cuda_initialized": torch.cuda.is_initialized(),
        "dist_initialized": dist.is_available() and dist.is_initialized(),
        "cache_entries": os.listdir(os.environ["DSC_CACHE_DIR"]) if os.path.isdir(os.environ["DSC_CACHE_DIR"]) else [],
        "ops_loaded": [m for m in sys.modules if m.startswith("_dsc_")],
    }
    print(json.dumps(report))
""")


def test_import_is_cheap(tmp_path):
    env = dict(os.environ, DSC_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, stdout=subprocess.PIPE, text=True, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"spawned": [], "cuda_initialized": False, "dist_initialized": False,
                      "cache_entries": [], "ops_loaded": []}


def test_import_does_not_import_torch_distributed_or_op_builders():
    code = "import sys, deepspeed_c; print(sorted(m for m in sys.modules if m.startswith(('deepspeed_c', 'op_builder'))))"
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, check=True).stdout
    loaded = eval(out)
    assert "deepspeed_c.ops.op_builder" not in loaded and "deepspeed_c._C" not in loaded
