"""deepspeed_c's collectives go through deepspeed_c.comm (one transport: the comms logger counts them, its
fallbacks and prebuilt calls apply). An AST walk over deepspeed_c/**.py (deepspeed_c/comm itself excepted)
finds each call of a torch.distributed collective: `torch.distributed.X(...)`, `<alias of torch.distributed>.X(...)`
or a collective imported by name from torch.distributed. The files below still make such calls; the list
only shrinks: a file routed through deepspeed_c.comm leaves it, and no other file may join it."""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "deepspeed_c"

COLLECTIVES = {
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced", "all_reduce",
    "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv", "gather",
    "gather_object", "scatter", "scatter_object_list", "barrier", "monitored_barrier", "reduce",
}

# Direct callers still to be routed through deepspeed_c.comm (debt, not a licence: shrink only).
STILL_DIRECT = {
    "autotuning/metrics.py", "checkpoint/zero_exchange.py", "compression/parallel_layer.py",
    "module_inject/hybrid_inference.py", "module_inject/hybrid_tp.py", "ops/sparse_attention/sparse_self_attention.py",
    "runtime/checkpointing/collective_guard.py", "runtime/checkpointing/engine.py", "runtime/checkpointing/nodes.py",
    "runtime/checkpointing/pipeline.py", "runtime/checkpointing/zero.py",
    "runtime/data_pipeline/data_sampling/data_analyzer.py", "runtime/data_pipeline/data_sampling/data_sampler.py",
    "runtime/model_parallel/mpu_protocol.py", "runtime/pipe/engine.py", "runtime/pipe/executor.py",
    "runtime/pipe/loss_aggregation.py", "runtime/pipe/module.py", "runtime/pipe/p2p.py",
    "runtime/tensor_parallel/autotp_setup.py", "runtime/utils.py", "runtime/zero/mics.py",
    "runtime/zero/partition_parameters.py",
}


def _is_torch_distributed(node: ast.AST, aliases: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in aliases
    return (isinstance(node, ast.Attribute) and node.attr == "distributed" and isinstance(node.value, ast.Name)
            and node.value.id == "torch")


def direct_calls(source: str) -> list[tuple[int, str]]:
    """(line, collective) of every torch.distributed collective called in `source`."""
    tree = ast.parse(source)
    aliases: set[str] = set()  # names bound to the torch.distributed module
    names: dict[str, str] = {}  # local name -> the collective imported under it
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names if a.name == "torch.distributed" and a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases.update(a.asname or a.name for a in node.names if a.name == "distributed")
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch.distributed",
                                                                  "torch.distributed.distributed_c10d"):
            names.update({a.asname or a.name: a.name for a in node.names if a.name in COLLECTIVES})
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES and _is_torch_distributed(f.value, aliases):
            calls.append((node.lineno, f.attr))
        elif isinstance(f, ast.Name) and f.id in names:
            calls.append((node.lineno, names[f.id]))
    return sorted(calls)


def test_scan_finds_each_spelling() -> None:
    src = ("import torch\nimport torch.distributed as tdist\nfrom torch import distributed\n"
           "from torch.distributed import all_reduce as ar\nimport deepspeed_c.comm as dist\n"
           "torch.distributed.broadcast(t, 0)\ntdist.all_gather(o, t)\ndistributed.barrier()\nar(t)\n"
           "dist.all_reduce(t)\ntdist.get_rank()\n")
    assert direct_calls(src) == [(6, "broadcast"), (7, "all_gather"), (8, "barrier"), (9, "all_reduce")]


def test_collectives_go_through_deepspeed_c_comm() -> None:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("comm/"):
            continue
        source = path.read_text()
        calls = direct_calls(source) if "distributed" in source else []  # every spelling names the module
        if calls:
            found[rel] = calls
    new = {rel: calls for rel, calls in found.items() if rel not in STILL_DIRECT}
    assert not new, f"torch.distributed collectives called directly (use deepspeed_c.comm): {new}"
    routed = STILL_DIRECT - set(found)
    assert not routed, f"these files no longer call torch.distributed directly: remove them from STILL_DIRECT: {routed}"
