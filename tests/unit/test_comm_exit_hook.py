"""A gloo process group is destroyed at interpreter exit also when the caller built it (the Hugging Face
Trainer and accelerate initialise torch.distributed before deepspeed_c sees it): gloo's worker threads
freeing finished work while the interpreter is torn down abort a finished run (SIGABRT, "terminate called
without an active exception"; seen in launched 2-rank Trainer runs). Checked in a fresh interpreter: an
atexit handler registered before deepspeed_c (so it runs after deepspeed_c's) finds the group gone, and
cyclic garbage that still held the group object (a finished script's engine: destroy_process_group only
unregisters a group, its threads live while the object does) freed, also when the caller had destroyed
the group itself (accelerate's end_training).

The abort (a gloo worker freeing a finished collective's tensors takes the GIL during finalisation) is what
the two-rank case provokes: torch.distributed.nn.functional imported after the group exists (torch's FSDP
imports it; accelerate imports FSDP while saving state) binds the world group as default arguments, which
kept the destroyed group and its workers alive into finalisation (aborted 5 of 10 launched runs here)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import atexit, gc, json, sys, weakref
    import torch.distributed as dist

    out, who = sys.argv[1], sys.argv[2]

    class Holder:  # stands for a finished script's engine: cyclic garbage that still holds the group
        pass

    def report():  # registered first, so it runs after every handler registered later
        with open(out, "w") as f:
            json.dump({"initialized_at_exit": dist.is_initialized(), "holder_freed": held() is None}, f)

    atexit.register(report)
    if who.startswith("caller"):  # the group exists before deepspeed_c is asked for it
        dist.init_process_group("gloo", init_method="file://" + out + ".store", rank=0, world_size=1)
    import deepspeed_c
    deepspeed_c.init_distributed(dist_backend="gloo", init_method="file://" + out + ".store2", rank=0, world_size=1)
    assert dist.is_initialized()
    gc.disable()  # only an explicit collection frees the holder
    h = Holder()
    h.me, h.group = h, dist.group.WORLD
    held = weakref.ref(h)
    del h
    if who == "caller-destroys":  # accelerate's end_training destroys the group itself
        dist.destroy_process_group()
""")


def _run(tmp_path, who: str) -> dict:
    out = str(tmp_path / f"{who}.json")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    done = subprocess.run([sys.executable, "-c", SCRIPT, out, who], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


def test_group_built_by_the_caller_is_destroyed_at_exit(tmp_path):
    assert _run(tmp_path, "caller") == {"initialized_at_exit": False, "holder_freed": True}


def test_group_built_by_deepspeed_c_is_destroyed_at_exit(tmp_path):
    assert _run(tmp_path, "deepspeed_c") == {"initialized_at_exit": False, "holder_freed": True}


def test_garbage_holding_a_group_the_caller_destroyed_is_freed_at_exit(tmp_path):
    assert _run(tmp_path, "caller-destroys") == {"initialized_at_exit": False, "holder_freed": True}


TWO_RANKS = textwrap.dedent("""
    import atexit, json, sys
    out, store, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def report():  # registered first, so it runs after deepspeed_c's handler
        from deepspeed_c.comm import exit_hook
        with open(out, "w") as f:
            json.dump({"gloo_workers_at_exit": len(exit_hook.gloo_worker_threads())}, f)

    atexit.register(report)
    import torch, torch.distributed as dist
    import deepspeed_c
    assert "torch.distributed.nn.functional" not in sys.modules  # else it bound no group and this proves nothing
    deepspeed_c.init_distributed(dist_backend="gloo", init_method="file://" + store, rank=rank, world_size=2)
    import torch.distributed.nn.functional  # binds dist.group.WORLD as a default argument, as FSDP's import does
    assert torch.distributed.nn.functional.all_reduce.__defaults__[-1] is dist.group.WORLD
    for _ in range(200):  # tensors the caller drops while gloo's worker still holds them
        t = torch.ones(4096)
        dist.all_reduce(t, async_op=True).wait()
        del t
""")


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def test_two_ranks_exit_cleanly_when_a_module_default_holds_the_group(tmp_path):
    for attempt in range(2):
        store = str(tmp_path / f"store{attempt}")
        outs = [str(tmp_path / f"r{attempt}_{r}.json") for r in range(2)]
        procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, outs[r], store, str(r)], env=_env(),
                                  stderr=subprocess.PIPE, text=True) for r in range(2)]
        errs = [p.communicate(timeout=180)[1] for p in procs]
        for r, p in enumerate(procs):
            assert p.returncode == 0, f"rank {r} exit code {p.returncode}: {errs[r][-3000:]}"
            with open(outs[r]) as f:
                assert json.load(f) == {"gloo_workers_at_exit": 0}


def test_idle_wait_returns_once_workers_sleep(tmp_path):
    """The wait for a group the script still holds: its workers idle, the wait ends within a few polls."""
    script = textwrap.dedent("""
        import sys, time, torch, torch.distributed as dist
        from deepspeed_c.comm import exit_hook
        dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
        dist.all_reduce(torch.ones(8))
        named_by = time.monotonic() + 10  # a worker names itself once it runs
        while not exit_hook.gloo_worker_threads() and time.monotonic() < named_by:
            time.sleep(0.01)
        assert exit_hook.gloo_worker_threads()
        t0 = time.monotonic()
        assert exit_hook.wait_for_idle_gloo_workers(5.0)
        assert time.monotonic() - t0 < 2.0
        dist.destroy_process_group()
    """)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "s")], env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
