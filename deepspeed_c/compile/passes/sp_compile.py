"""AutoSP (DeepSpeed's deepspeed.compile.passes.sp_compile): Ulysses sequence parallelism as passes over the
graph dynamo captures.

The user tags the batch with prepare_autosp_inputs (the sequence dimension becomes symbolic, so one graph
serves every length). On the captured graph, per rank r of a sequence-parallel group of P:
- shard_inputs: the tagged input ids, labels and position ids are narrowed to this rank's chunk
  [r*S/P, (r+1)*S/P) of the sequence, and every node downstream of them that used the symbolic length S
  uses S/P (a reshape to (B, S, ...) becomes (B, S/P, ...));
- wrap_attention: each scaled_dot_product_attention gets an all-to-all on q, k, v (scatter heads, gather the
  sequence: each rank attends over the whole sequence for its heads) and the reverse on its output;
- aggregate_losses: a mean cross entropy against the labels becomes the mean over the whole sequence
  (sp_ops.aggregate_loss), so every rank returns the loss of the unsharded batch.
Model code must call torch.nn.functional.scaled_dot_product_attention without attn_mask (is_causal is kept:
each rank sees the whole sequence), compute positions from the tagged position ids (an internal
arange(S) would give each rank the first chunk's positions), take labels aligned with the logits (shift
before tagging), and run in one graph."""
from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

# dynamo copies only a tensor's `tag` attribute into its placeholder's meta["tensor_dict"] (DeepSpeed tags the
# same attribute): prepare_autosp_inputs sets it to ("autosp_<role>", seq_dim)
_TAG = "tag"
_PREFIX = "autosp_"
ROLES = ("input_id", "label_id", "position_id")


def prepare_autosp_inputs(input_id: torch.Tensor, label_id: torch.Tensor, position_id: Optional[torch.Tensor] = None,
                          attention_mask: Optional[torch.Tensor] = None, seq_dim: int = 1) -> tuple:
    """Marks the sequence dimension dynamic and tags the tensors for the AutoSP passes; call it on every
    batch before the forward. Returns (input_id, label_id, position_id, attention_mask)."""
    from deepspeed_c.compile import sp_ops

    for name, t in (("input_id", input_id), ("label_id", label_id)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"prepare_autosp_inputs: '{name}' is required (a tensor), got {type(t).__name__}")
    if not isinstance(seq_dim, int) or not 0 <= seq_dim < input_id.ndim:
        raise ValueError(f"prepare_autosp_inputs: 'seq_dim' {seq_dim!r} is not a dimension of input_id "
                         f"{tuple(input_id.shape)}")
    seq = input_id.shape[seq_dim]
    for name, t in (("label_id", label_id), ("position_id", position_id), ("attention_mask", attention_mask)):
        if t is not None and (seq_dim >= t.ndim or t.shape[seq_dim] != seq):
            raise ValueError(f"prepare_autosp_inputs: '{name}' {tuple(t.shape)} does not have input_id's sequence "
                             f"length {seq} in dimension seq_dim={seq_dim}")
    group = sp_ops.current_group()
    if group is not None and seq % group.size != 0:
        raise ValueError(f"prepare_autosp_inputs: the sequence length {seq} of 'input_id' is not divisible by "
                         f"'sequence_parallel_size' {group.size} (pad the batch)")
    if seq < 2:
        raise ValueError(f"prepare_autosp_inputs: 'input_id' has sequence length {seq}; torch.compile "
                         "specialises lengths 0 and 1, so AutoSP needs at least 2")
    for t in (input_id, label_id, position_id, attention_mask):
        if t is not None:
            torch._dynamo.mark_dynamic(t, seq_dim)
    for role, t in zip(ROLES, (input_id, label_id, position_id)):
        if t is not None:
            setattr(t, _TAG, (_PREFIX + role, seq_dim))
    return input_id, label_id, position_id, attention_mask


def _example(node: Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def tagged_inputs(gm: GraphModule) -> dict[str, tuple[Node, int]]:
    """role -> (placeholder, sequence dimension) of the tensors prepare_autosp_inputs tagged."""
    found: dict[str, tuple[Node, int]] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        tag = (node.meta.get("tensor_dict") or {}).get(_TAG)
        if isinstance(tag, tuple) and len(tag) == 2 and str(tag[0]).startswith(_PREFIX):
            found[tag[0][len(_PREFIX):]] = (node, tag[1])
    return found


def sdpa_nodes(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.scaled_dot_product_attention]


def _reach(starts: list[Node], neighbours: Callable[[Node], Any]) -> set[Node]:
    seen: set[Node] = set()
    work = list(starts)
    while work:
        node = work.pop()
        if node not in seen:
            seen.add(node)
            work.extend(neighbours(node))
    return seen


def _downstream(starts: list[Node]) -> set[Node]:
    return _reach(starts, lambda n: n.users)


def shard_inputs(gm: GraphModule, tagged: dict[str, tuple[Node, int]], size: int, rank: int,
                 whole: frozenset = frozenset()) -> tuple[dict[str, Node], Node, Node]:
    """Narrows the tagged inputs (but the roles in `whole`) to this rank's chunk; S becomes S/P in their
    consumers. Returns (role -> local chunk, the chunk's start node, its length node)."""
    graph = gm.graph
    ids, dim = tagged["input_id"]
    seq = _example(ids).shape[dim]
    if not isinstance(seq, torch.SymInt):
        raise RuntimeError("AutoSP: the sequence dimension of the input ids was captured as a constant "
                           f"({seq}); call prepare_autosp_inputs on the batch before every forward")
    # dynamo lifts one SymInt placeholder per input size; every one that is the sequence length counts
    seq_nodes = [n for n in graph.find_nodes(op="placeholder")
                 if isinstance(_example(n), torch.SymInt) and str(_example(n)) == str(seq)]
    if not seq_nodes:
        raise RuntimeError(f"AutoSP: no graph input carries the symbolic sequence length {seq}")
    consumers = _downstream([node for role, (node, _) in tagged.items() if role not in whole])
    last_placeholder = list(graph.find_nodes(op="placeholder"))[-1]
    with graph.inserting_after(last_placeholder):
        local = graph.call_function(operator.floordiv, (seq_nodes[0], size))
    with graph.inserting_after(local):
        start = graph.call_function(operator.mul, (local, rank))
    for node in consumers:
        for s in seq_nodes:
            if s in node.all_input_nodes:
                node.replace_input_with(s, local)
    out: dict[str, Node] = {}
    anchor = start
    for role, (node, d) in tagged.items():
        if role in whole:
            out[role] = node
            continue
        with graph.inserting_after(anchor):
            part = graph.call_function(torch.narrow, (node, d, start, local))
        node.replace_all_uses_with(part, delete_user_cb=lambda user: user is not part)
        out[role] = anchor = part
    return out, start, local


def wrap_attention(gm: GraphModule, size: int) -> int:
    """all-to-all around every SDPA; returns how many."""
    from deepspeed_c.compile import sp_ops  # noqa: F401 (registers torch.ops.dsc_autosp)

    a2a = torch.ops.dsc_autosp.all_to_all.default
    nodes = sdpa_nodes(gm)
    if not nodes:
        raise RuntimeError("AutoSP (config 'compile.passes' ['autosp']): no torch.nn.functional."
                           "scaled_dot_product_attention in the captured graph; AutoSP shards attention only "
                           "through SDPA (HF models: attn_implementation='sdpa')")
    for attn in nodes:
        if attn.kwargs.get("attn_mask") is not None or (len(attn.args) > 3 and attn.args[3] is not None):
            raise NotImplementedError("AutoSP: scaled_dot_product_attention with an attn_mask is not built (each "
                                      "rank would need the whole mask); use is_causal=True without a mask")
        names = ("query", "key", "value")
        qkv = [attn.kwargs[k] if k in attn.kwargs else attn.args[i] for i, k in enumerate(names)]
        for name, node in zip(names, qkv):
            val = _example(node)
            if val is None or val.ndim != 4:
                raise RuntimeError(f"AutoSP: the SDPA {name} must be a 4-d [batch, heads, seq, head_dim] tensor")
            heads = val.shape[1]
            if isinstance(heads, int) and heads % size != 0:
                raise ValueError(f"AutoSP: the SDPA {name} has {heads} heads, not divisible by "
                                 f"'sequence_parallel_size' {size}")
        for i, (name, node) in enumerate(zip(names, qkv)):
            with gm.graph.inserting_before(attn):
                full = gm.graph.call_function(a2a, (node, 1, 2))
            if name in attn.kwargs:
                attn.update_kwarg(name, full)
            else:
                attn.update_arg(i, full)
        with gm.graph.inserting_after(attn):
            back = gm.graph.call_function(a2a, (attn, 2, 1))
        attn.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
    return len(nodes)


def _arg(node: Node, index: int, name: str, default: Any) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


_LAYOUT_ONLY = {"view", "reshape", "flatten", "contiguous", "long", "to"}  # methods that keep the token order
_LAYOUT_FUNCS = {torch.reshape, torch.flatten}


def _is_layout(node: Node) -> bool:
    return (node.op == "call_method" and node.target in _LAYOUT_ONLY) or \
        (node.op == "call_function" and node.target in _LAYOUT_FUNCS)


def _label_targets(gm: GraphModule, labels: Node) -> list[Node]:
    """The targets of the cross entropies computed from the labels."""
    from_labels = _downstream([labels])
    return [t for n in gm.graph.nodes if n.op == "call_function" and n.target is F.cross_entropy
            if (t := _arg(n, 1, "target", None)) in from_labels]


def _shifted(targets: list[Node], labels: Node) -> bool:
    """Some target reaches the labels through more than views and reshapes (a shift inside the model)."""
    for node in targets:
        while node is not labels:
            if not _is_layout(node) or not node.args or not isinstance(node.args[0], Node):
                return True
            node = node.args[0]
    return False


def narrow_shifted_labels(gm: GraphModule, targets: list[Node], labels: Node, dim: int, start: Node,
                          local: Node) -> None:
    """Labels shifted inside the model (Hugging Face's pad-and-slice) are shifted on the whole sequence, and this
    rank's chunk is cut after the shift: on a chunk the shift would lose the label across each chunk boundary."""
    full = _example(labels)
    for target in targets:
        node = target
        while _is_layout(node) and isinstance(node.args[0], Node) and _example(node).ndim != full.ndim:
            node = node.args[0]  # back through the flattening views to the [batch, seq] labels
        val = _example(node)
        if val is None or val.ndim != full.ndim or str(val.shape[dim]) != str(full.shape[dim]):
            raise NotImplementedError(
                f"AutoSP: the labels reach the cross entropy through {node.op} "
                f"{getattr(node.target, '__name__', node.target)!r} with a sequence of "
                f"{None if val is None else tuple(val.shape)} where the labels have {tuple(full.shape)}; AutoSP "
                "cuts a shifted label sequence only when the shift keeps its length (pad and slice, as Hugging Face "
                "does). Shift the labels before prepare_autosp_inputs and have the model use them as given")
        toward_loss = _reach([target], lambda n: n.all_input_nodes)  # only the path to this cross entropy
        with gm.graph.inserting_after(node):
            part = gm.graph.call_function(torch.narrow, (node, dim, start, local))
        node.replace_all_uses_with(part, delete_user_cb=lambda user: user is not part and user in toward_loss)


def aggregate_losses(gm: GraphModule, labels: Node) -> int:
    """Each mean cross entropy whose target comes from the labels becomes the whole sequence's mean."""
    from deepspeed_c.compile import sp_ops  # noqa: F401

    from_labels = _downstream([labels])
    done = 0
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.cross_entropy]:
        target = _arg(node, 1, "target", None)
        if target not in from_labels:
            continue
        if _arg(node, 2, "weight", None) is not None or _arg(node, 6, "reduction", "mean") != "mean":
            raise NotImplementedError("AutoSP: a label cross entropy must be reduction='mean' without class "
                                      "weights (its mean over the sequence is aggregated over the group)")
        ignore = _arg(node, 4, "ignore_index", -100)
        with gm.graph.inserting_after(node):
            valid = gm.graph.call_function(operator.ne, (target, ignore))
        with gm.graph.inserting_after(valid):
            count = gm.graph.call_method("sum", (valid,))
        with gm.graph.inserting_after(count):
            pair = gm.graph.call_function(torch.ops.dsc_autosp.aggregate_loss.default, (node, count))
        with gm.graph.inserting_after(pair):
            total = gm.graph.call_function(operator.getitem, (pair, 0))
        node.replace_all_uses_with(total, delete_user_cb=lambda user: user is not pair)
        done += 1
    return done


def apply_autosp(gm: GraphModule, size: int, rank: int) -> dict[str, int]:
    """All AutoSP passes on one dynamo graph, in place. Returns what was done (for logs and tests)."""
    tagged = tagged_inputs(gm)
    if "input_id" not in tagged:
        raise RuntimeError("AutoSP (config 'compile.passes' ['autosp']): the compiled graph does not take the "
                           "tagged input ids. Either prepare_autosp_inputs was not called on the batch, or the "
                           "forward has a graph break (AutoSP needs the whole forward in one graph: "
                           "torch._dynamo.explain(model)(...) lists the breaks)")
    if "label_id" not in tagged:
        raise RuntimeError("AutoSP (config 'compile.passes' ['autosp']): the compiled graph takes the input ids but "
                           "not the labels tagged by prepare_autosp_inputs. Pass them to the model's forward, and keep "
                           "the forward in one graph: a graph break before the loss splits it (torch._dynamo."
                           "explain(model)(...) lists the breaks)")
    labels, label_dim = tagged["label_id"]
    targets = _label_targets(gm, labels)
    shifted = _shifted(targets, labels)
    local, start, length = shard_inputs(gm, tagged, size, rank, frozenset({"label_id"}) if shifted else frozenset())
    if shifted:
        narrow_shifted_labels(gm, targets, labels, label_dim, start, length)
    attentions = wrap_attention(gm, size)
    losses = aggregate_losses(gm, local["label_id"])
    if losses == 0:  # each rank's local mean would be summed over the group: a gradient P times too large
        raise NotImplementedError("AutoSP (config 'compile.passes' ['autosp']): no torch.nn.functional.cross_entropy "
                                  "against the tagged labels (reduction='mean') in the compiled forward, so the loss "
                                  "cannot be made the whole sequence's mean over the sequence-parallel group; compute "
                                  "the loss as F.cross_entropy(logits, labels) inside the model's forward")
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return {"attention": attentions, "losses": losses}
