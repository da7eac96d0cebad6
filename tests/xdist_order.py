"""The order in which `pytest -n N --dist loadfile` hands test files to its workers (tests/conftest.py installs
it): the longest files first, then the rest as xdist orders them (most tests first).

Under loadfile a file runs whole on one worker, so the suite's wall time is at least its longest file, and a
long file handed out last runs while the other worker idles. xdist's own order (most tests first) hands out
last exactly the files of few long tests (the CUDA build, HF launches, autotuning). Longest first (the LPT
rule) keeps both workers busy to the end. FILE_SECONDS: each file's time in a suite run on 2 loaded cores
(session 4, the top durations summed per file; files trimmed since: that time scaled by the file's own
before/after ratio, old and new copies run interleaved on one machine state); only the order matters, a file not
listed counts as short."""
from __future__ import annotations

from typing import Iterable

import pytest

FILE_SECONDS = {
    "tests/unit/test_cuda_build.py": 150,  # nvcc compiles every CUDA op (cold op cache): 78 s on 2 idle cores
    "tests/distributed/test_deepcompile.py": 202,  # one launch (f3e325e): 190.6/161.9 -> 58.2/46.4 s
    "tests/distributed/test_deepcompile_inductor.py": 138,  # one launch (f3e325e): 214.7/185.2 -> 103.9/92.6 s
    "tests/distributed/test_checkpoint_zero3.py": 95,  # its 16 runs in one launch: 27.0 -> 14.2 s standalone
    "tests/distributed/test_zenflow.py": 129,  # one launch for its 3 groups: 44.3 -> 40.7 s
    "tests/distributed/test_hf_zero3.py": 93,  # loads + ZeRO-3 Trainer in one launch: 38.9 -> 27.9 s
    "tests/unit/test_packaging.py": 130,
    "tests/distributed/test_autotuning.py": 120,
    "tests/distributed/test_checkpoint_zero_memory.py": 115,
    "tests/distributed/test_client_accelerate.py": 105,
    "tests/distributed/test_hf_trainer.py": 105,
    "tests/distributed/test_checkpoint_async_writer.py": 84,  # one launch for 7: 24.2 -> 20.3 s
    "tests/distributed/test_moe_parity.py": 33,  # both worlds in one launch (08fbad3): 50.8/56.4 -> 19.5/18.1 s
    "tests/distributed/test_pipe_checkpoint_crash.py": 80,
    "tests/unit/test_evoformer_attn.py": 75,
    "tests/distributed/test_nvme_offload.py": 55,  # 12 parity steps, one launch less: 36.6 -> 28.7 s
    "tests/distributed/test_client_lightning.py": 57,
    "tests/distributed/test_zero3_parity.py": 51,  # 3 worlds in one launch: 29.5 -> 27.6 s
    "tests/distributed/test_checkpoint_async_kill.py": 55,
    "tests/distributed/test_client_peft_trl.py": 53,
    "tests/distributed/test_zero3_dist.py": 43,  # 5 runs in one launch: 26.1 -> 22.4 s
    "tests/distributed/test_rlhf_example.py": 45,
}


def longest_first(nodeids: Iterable[str]) -> list[str]:
    """nodeids reordered file by file: the listed files longest first, then the others by their number of
    tests, most first (xdist's own rule); a file's tests keep their order."""
    by_file: dict[str, list[str]] = {}
    for nodeid in nodeids:
        by_file.setdefault(nodeid.split("::", 1)[0], []).append(nodeid)
    files = sorted(by_file, key=lambda f: (-FILE_SECONDS.get(f, 0), -len(by_file[f])))
    return [nodeid for f in files for nodeid in by_file[f]]


DIST_KEY = "dsc_dist"  # the controller's --dist, in each worker's workerinput


# The hooks below are imported into tests/conftest.py by name (pytest registers them there).
def pytest_collection_modifyitems(config, items: list) -> None:  # type: ignore[no-untyped-def]
    """Under --dist loadfile every worker's collection is put in longest_first's order, so the scheduler hands
    out the files in that order.

    The order is made where the tests are collected, not in the scheduler: xdist's scheduler tells a worker which
    tests to run by their positions in that worker's own collection, so a scheduler that reordered its copy of
    the collection sent positions the worker read in its own order: each "file" a worker was handed was a slice
    of the collection straddling files, a module's tests ran on both workers, and its shared launch (a module
    fixture) ran twice (in the last CI log test_deepcompile's 45 s launch, test_checkpoint_zero_memory's, ...)."""
    # a worker's own --dist is "no": the controller's comes in the worker's input (pytest_configure_node)
    if getattr(config, "workerinput", {}).get(DIST_KEY, config.getoption("dist", "no")) != "loadfile":
        return
    position = {nodeid: i for i, nodeid in enumerate(longest_first(item.nodeid for item in items))}
    items.sort(key=lambda item: position[item.nodeid])


@pytest.hookimpl(optionalhook=True)  # an xdist hook, in the controller
def pytest_configure_node(node) -> None:  # type: ignore[no-untyped-def]
    """Each worker learns the controller's --dist (its own reads "no")."""
    node.workerinput[DIST_KEY] = node.config.getoption("dist", "no")


@pytest.hookimpl(optionalhook=True)  # an xdist hook: plain pytest (no xdist installed) passes it over
def pytest_xdist_make_scheduler(config, log):  # type: ignore[no-untyped-def]
    """xdist's loadfile scheduler handing the files out in collection order (pytest_collection_modifyitems's),
    not re-sorted by their number of tests (None: xdist's own for other --dist modes)."""
    if config.getoption("dist", "no") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False
    return LoadFileScheduling(config, log)
