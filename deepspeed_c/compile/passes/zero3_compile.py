"""FX passes that place DeepCompile's ZeRO-3 ops (custom_ops.py) in the graphs dynamo and AOT autograd build.

- `sink_gathers` (the graph dynamo hands the backend): the runner gathers every unit at the top of its
  function; each gather, with the views that cut parameters out of it, moves to just before the first
  operation that reads it, so a unit is gathered where it is first used, in forward order.
- `mark_gathers_recomputed` (the joint forward+backward graph, before the partitioner): a gathered unit and
  its views are recomputed in the backward instead of saved between forward and backward; the partitioner
  then places each re-gather just before its first use in the backward (it reorders a graph with
  recomputed nodes the way the autograd engine would run it), and the forward frees the unit after its
  last reader. That is the release after last use, in both directions. The forward's last unit is the
  exception: the backward needs it first, so it is saved (kept) rather than released and re-gathered.
- `schedule_prefetch` (each of the forward and backward graphs after partitioning): every gather starts
  the next gather of the same graph asynchronously (`prefetch` argument), so unit k+1 travels while unit
  k computes; the last one of a backward graph prefetches nothing, the last one of a forward graph the
  unit the backward gathers first (learned from the previous backward; custom_ops.BACKWARD_FIRST). In a
  backward graph `order_reduce_scatters` first ties each gather to the reduce-scatter before it, so no
  unit's gradient reduction drifts to the backward's end."""
from __future__ import annotations

import operator
import torch
from torch.fx import Graph, GraphModule, Node

_VIEW_METHODS = {"narrow", "view", "reshape", "as_strided", "t", "contiguous"}
# keep the forward's last unit for the backward and prefetch the backward's first unit from the forward;
# read when a graph compiles (False: the one-graph-at-a-time schedule, for A/B runs in benchmarks/deepcompile.py)
ACROSS_BOUNDARY = True


def _is_gather(node: Node) -> bool:
    # dynamo's graph names the overload packet, AOT autograd's graphs the default overload
    return node.op == "call_function" and node.target in (torch.ops.dsc.z3_gather, torch.ops.dsc.z3_gather.default,
                                                          torch.ops.dsc.z3_gather_after.default)


def _unit(gather: Node) -> int:
    return int(gather.args[-2])  # both gathers end (..., unit, prefetch)


def gather_nodes(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes if _is_gather(n)]


def _is_view_of(node: Node, movable: set[Node]) -> bool:
    """A view-like operation whose tensor inputs are all graph inputs or already movable."""
    if node.op == "call_method" and node.target in _VIEW_METHODS:
        pass
    elif node.op == "call_function" and node.target in (operator.getitem, torch.narrow, torch.reshape):
        pass
    elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        pass
    else:
        return False
    inputs = [a for a in node.all_input_nodes]
    return bool(inputs) and all(a in movable or a.op in ("placeholder", "get_attr") for a in inputs)


def _movable(graph: Graph) -> set[Node]:
    movable: set[Node] = set()
    for node in graph.nodes:
        if _is_gather(node):
            if all(a in movable or a.op in ("placeholder", "get_attr") for a in node.all_input_nodes):
                movable.add(node)
        elif _is_view_of(node, movable):
            movable.add(node)
    return movable


def sink_gathers(gm: GraphModule) -> int:
    """Moves each gather (with its input slice and output views) to just before the first operation that
    reads it; everything else keeps its order. Returns how many nodes changed place."""
    graph = gm.graph
    movable = _movable(graph)
    if not movable:
        return 0
    order: list[Node] = []
    placed: set[Node] = set()

    def place(node: Node) -> None:
        if node in placed:
            return
        for a in node.all_input_nodes:
            if a in movable:
                place(a)
        placed.add(node)
        order.append(node)

    nodes = list(graph.nodes)
    for node in nodes:
        if node not in movable:
            place(node)
    leftovers = [n for n in nodes if n not in placed]  # movable nodes nobody reads: before the output
    if leftovers:
        out = order.pop()
        for n in leftovers:
            place(n)
        order.append(out)
    moved = sum(1 for a, b in zip(nodes, order) if a is not b)
    prev = order[0]
    for node in order[1:]:
        if prev.next is not node:
            prev.append(node)
        prev = node
    graph.lint()
    gm.recompile()
    return moved


def mark_gathers_recomputed(graph: Graph) -> int:
    """Tags gathers and the views of their outputs MUST_RECOMPUTE for the min-cut partitioner, except the
    forward's last gather, which is saved: the backward starts with that unit (its gradient comes first),
    so re-gathering it would only stall the backward's start on a collective, for no memory back."""
    from torch.utils.checkpoint import CheckpointPolicy

    marked = 0
    gathers = gather_nodes(graph)
    if not gathers:
        return 0
    frontier = list(gathers)
    if ACROSS_BOUNDARY:
        gathers[-1].meta["recompute"] = CheckpointPolicy.MUST_SAVE
        frontier = gathers[:-1] + [u for u in gathers[-1].users if _is_view_node(u)]
    seen: set[Node] = set()
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        marked += 1
        frontier.extend(user for user in node.users if _is_view_node(user))
    return marked


def _is_view_node(node: Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _is_backward(graph: Graph) -> bool:
    """AOT autograd names a backward graph's incoming gradients tangents_*."""
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)


scheduled: list[int] = []  # gathers per graph the schedule saw (forward and backward graphs), for tests


def schedule_prefetch(graph: Graph) -> int:
    """Each gather prefetches the unit of the next gather in this graph; the last one of a backward graph
    none, the last one of a forward graph the unit the backward will gather first (BACKWARD_FIRST, known at
    run time: the backward graph is compiled after this one)."""
    from deepspeed_c.compile.custom_ops import BACKWARD_FIRST

    backward = _is_backward(graph)
    if backward:
        order_reduce_scatters(graph)
    gathers = gather_nodes(graph)
    scheduled.append(len(gathers))
    last = -1 if backward or not ACROSS_BOUNDARY else BACKWARD_FIRST
    for here, nxt in zip(gathers, gathers[1:] + [None]):
        unit = last if nxt is None else _unit(nxt)
        if unit == _unit(here):
            unit = -1
        here.args = (*here.args[:-1], unit)
    return len(gathers)


def order_reduce_scatters(graph: Graph) -> int:
    """In a backward graph, each gather that follows reduce-scatters (in the partitioner's order: the
    autograd engine's) becomes z3_gather_after reading the latest of them, so the scheduler cannot move that
    reduce-scatter, or the gradient assembly it sends, past the gather: each unit's gradient leaves while
    the next units' backward computes. Returns how many gathers it tied."""
    rs_op = torch.ops.dsc.z3_reduce_scatter.default
    plain = torch.ops.dsc.z3_gather.default
    after_op = torch.ops.dsc.z3_gather_after.default
    latest, tied = None, 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is rs_op:
            latest = node
        elif node.target is plain and latest is not None:
            chunk, *rest = node.args
            with graph.inserting_before(node):
                new = graph.call_function(after_op, (chunk, latest, *rest))
            # the fake value and the rest; not the eager inputs inductor recorded for the old op's schema
            new.meta.update({k: v for k, v in node.meta.items() if k != "eager_input_vals"})
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            latest, tied = None, tied + 1
    return tied
