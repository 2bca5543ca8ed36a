"""The compiled decode step's graph, rewritten before inductor lowers it: sibling products as one call.

`projection_groups` makes the packed linears of a layer that read the same activations (q/k/v,
gate/up, Qwen3.5's in_proj_qkv/z/b/a) one `mul_mat_group` call in eager decode steps, by keeping the
siblings' outputs between module calls. That state cannot be traced, so under torch.compile it steps
aside and a compiled step called one `mul_mat_vec` per linear: 211 calls per SmolLM2 step instead of
121, 7.3 ms of products instead of 6.0 (2 threads, AMD EPYC zen4). `SiblingProducts` does the same
grouping on the graph: every set of ggml-quantization `mul_mat_vec` nodes reading one activation
becomes one `mul_mat_group` node, placed where the first of them was, each old node's users reading
its part. `mul_mat_group` is bit-identical to the separate calls, so nothing else changes.

It runs as inductor's `post_grad_custom_post_pass` (`inductor_options`): on the functional aten graph,
after inductor's own passes, before lowering. Its `uuid` keys inductor's on-disk graph cache, and so
also carries the vector instructions inductor writes its C++ for (`vector_isa`), which that key
leaves out (torch 2.13 and 2.15): a graph generated for AVX-512 was served from the cache to a
process that generates for AVX2 (ATEN_CPU_CAPABILITY=avx2, or one cache folder shared by two CPUs),
which compiled the AVX-512 code with AVX2's vector width: the tiny llama's compiled decode steps
came out 37-49 % off the eager ones; the other way round, the process died of heap corruption.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import os
import platform
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import compat

compat.needs(
    ("torch._inductor.custom_graph_pass", "CustomGraphPass", None),
    ("torch._inductor.config", "post_grad_custom_post_pass", None),
    ("torch._inductor.config", "size_asserts", None),
    ("torch._inductor.cpu_vec_isa", "pick_vec_isa", ()),
)

# views that leave the activation's values as they are: siblings may each get their own view of it
_SAME_VALUES = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def _activation_key(x: torch.fx.Node):
    """What identifies the activation a product reads: the node, or (its view's source, shape)."""
    if x.op == "call_function" and x.target in _SAME_VALUES:
        return x.args[0], tuple(x.args[1])
    return x


class SiblingProducts(CustomGraphPass):
    """Every set of `mul_mat_vec(blocks, x, ggml_type, out_features)` nodes on one activation, as one
    `mul_mat_group` node (ggml-quantization's ops `mul_mat_vec` and `mul_mat_group`, of one build)."""

    def __init__(self, mul_mat_vec, mul_mat_group):
        self.mul_mat_vec = mul_mat_vec
        self.mul_mat_group = mul_mat_group
        self.groups_made = 0  # in the last graph rewritten

    def __call__(self, graph: torch.fx.Graph) -> None:
        order = {node: i for i, node in enumerate(graph.nodes)}
        siblings: dict = {}
        for node in graph.nodes:
            if self._is_product(node):
                siblings.setdefault(_activation_key(node.args[1]), []).append(node)
        self.groups_made = 0
        for nodes in siblings.values():
            first = nodes[0]
            # the group runs where the first sibling ran: every weight must already be there
            if len(nodes) > 1 and all(order[n.args[0]] < order[first] for n in nodes):
                self._group(graph, nodes)
                self.groups_made += 1

    def _is_product(self, node: torch.fx.Node) -> bool:
        return (
            node.op == "call_function"
            and node.target is self.mul_mat_vec
            and len(node.args) == 4
            and not node.kwargs
            and all(isinstance(a, torch.fx.Node) for a in node.args[:2])
            and all(isinstance(a, int) for a in node.args[2:])
        )

    def _group(self, graph: torch.fx.Graph, nodes: list) -> None:
        blocks, types, out_features = ([n.args[i] for n in nodes] for i in (0, 2, 3))
        with graph.inserting_before(nodes[0]):
            group = graph.call_function(self.mul_mat_group, (blocks, nodes[0].args[1], types, out_features))
            group.meta["val"] = [n.meta.get("val") for n in nodes]
            for i, node in enumerate(nodes):
                part = graph.call_function(operator.getitem, (group, i))
                part.meta.update(node.meta)
                node.replace_all_uses_with(part)
        for node in nodes:
            graph.erase_node(node)

    def uuid(self) -> str:
        source = Path(__file__).read_bytes()
        return hashlib.sha256(source + f"{self.mul_mat_vec}|{self.mul_mat_group}|{vector_isa()}".encode()).hexdigest()


@functools.cache
def vector_isa() -> str:
    """The vector instructions inductor generates C++ for in this process: the CPU's best, or
    ATEN_CPU_CAPABILITY's: "avx512 avx512_vnni" on the zen4 CPU, "avx512 avx512_vnni amx_tile" on the
    Intel Xeon, "avx2", "INVALID_VEC_ISA" for none. On x86 read as inductor's `pick_vec_isa` reads
    them (the CPU's flags, then ATEN_CPU_CAPABILITY) without its check that the compiler builds and
    loads each instruction set, a Python subprocess importing torch per set: 1.5 s on the first step
    of every process (Intel Xeon). Elsewhere, or where inductor's helpers differ, `pick_vec_isa`."""
    from torch._inductor import config, cpu_vec_isa

    try:
        if config.cpp.simdlen is None and platform.machine() in ("x86_64", "AMD64"):
            flags = cpu_vec_isa.x86_isa_checker()
            able = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
            if not able:
                return str(cpu_vec_isa.invalid_vec_isa)
            capability = os.getenv("ATEN_CPU_CAPABILITY")
            return str(cpu_vec_isa.get_isa_from_cpu_capability(capability, able, cpu_vec_isa.invalid_vec_isa))
    except (AttributeError, TypeError):  # inductor's helpers moved or changed: its own pick
        pass
    return str(cpu_vec_isa.pick_vec_isa())


def inductor_options(quant) -> dict:
    """inductor's options for a decode step on `quant` (the ggml-quantization kernel module): the
    sibling products grouped, and no size assert on each op's output (one Python call per output, ~340
    a SmolLM2 step; our ops' fake implementations give the shapes and strides they return)."""
    ops = quant.ops
    return {
        "post_grad_custom_post_pass": SiblingProducts(ops.mul_mat_vec.default, ops.mul_mat_group.default),
        "size_asserts": False,
    }
