"""Upstream's Metal kernels (.metal files, the Metal Shading Language) as C++ for the emulated device.

The translation is mechanical and done at build time into the runtime cache (nothing generated is
committed). MSL is C++ with address spaces, attributes and a standard library; common/metal/device/msl.h
gives the library and makes the address spaces vanish, so what is left to rewrite is small:
- function constants (`constant T NAME [[function_constant(I)]];`) become per-thread globals that
  the executor sets before each dispatch (`GK_FUNCTION_CONSTANT`);
- each kernel's parameters are read from its signature: a buffer index (`[[buffer(n)]]`, or the next
  one when unmarked, as Metal assigns them), a threadgroup-memory index or a thread-position builtin;
- each `[[host_name("...")]]` instance, explicit (`template [[host_name(N)]] kernel T f<A>;`) or on
  a kernel definition, and each plain (non-template) kernel under its own name, becomes an entry of
  the emulator's kernel registry that binds those parameters from a dispatch and calls it;
- kernel-scope `threadgroup T x[N];` arrays become references to storage shared by the running
  threadgroup (`gk_threadgroup_local`), not per-thread locals;
- a lane-0 branch (`if (tiisg == 0 ...) { ... }`) that touches threadgroup memory is a convergence
  point of the SIMD group before and after it, as on hardware, where the group's lanes run in
  lock-step and the others wait while lane 0 runs the branch: upstream relies on it
  (fa_vec_common.metal: lane 0 stores the softmax sums over `ss` right after its lanes' P*V reads
  of `ss`, with no barrier between when NE == 1). A branch that only stores a lane's own value to
  device memory (mul_mv's `dst[row] = sum`) orders nothing another lane reads, and stays as it is;
- GNU range initialisers (C only) become fill loops, `1.0h` half literals casts, and every file
  sits in its own unnamed namespace (each .metal file is its own Metal library).
`python -m tools.build.metal_translate <file.metal>` prints one translation.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

# The kernel files the emulated device runs (a kernel of any other file raises "not translated
# yet"). fa_common.metal and fa_vec_common.metal are included by the flash-attention files.
KERNEL_FILES = [
    "argsort.metal", "binbcast.metal", "conv.metal", "gated_delta_net.metal", "misc.metal", "mul_mm.metal",
    "mul_mv.metal", "norm.metal", "pool.metal", "quantize.metal", "reduce.metal", "rope.metal", "softmax.metal",
    "solve_tri.metal", "ssm.metal", "tri.metal", "unary.metal", "upscale.metal", "wkv.metal",
    "fa_aux.metal", "fa_f16.metal", "fa_f32.metal", "fa_q4_0.metal", "fa_q4_1.metal", "fa_q5_0.metal",
    "fa_q5_1.metal", "fa_q8_0.metal", "fa_vec_f16.metal", "fa_vec_f32.metal", "fa_vec_q4_0.metal",
    "fa_vec_q4_1.metal", "fa_vec_q5_0.metal", "fa_vec_q5_1.metal", "fa_vec_q8_0.metal",
]

BUILTINS = {
    "threadgroup_position_in_grid": "kThreadgroupPositionInGrid",
    "thread_position_in_threadgroup": "kThreadPositionInThreadgroup",
    "thread_position_in_grid": "kThreadPositionInGrid",
    "threads_per_threadgroup": "kThreadsPerThreadgroup",
    "threadgroups_per_grid": "kThreadgroupsPerGrid",
    "simdgroup_index_in_threadgroup": "kSimdgroupIndexInThreadgroup",
    "thread_index_in_simdgroup": "kThreadIndexInSimdgroup",
    "simdgroups_per_threadgroup": "kSimdgroupsPerThreadgroup",
    "thread_index_in_threadgroup": "kThreadIndexInThreadgroup",
    "threads_per_simdgroup": "kThreadsPerSimdgroup",
}

_FUNCTION_CONSTANT = re.compile(r"^(\s*)constant\s+([\w:]+)\s+(\w+)\s*\[\[\s*function_constant\((.*?)\)\s*\]\]\s*;", re.M)
# `template [[host_name("N")]] kernel T f<A>;`, or with the whole signature: `kernel void f<A>(...);`
_INSTANCE = re.compile(
    r"template\s*\[\[\s*host_name\(\s*\"([^\"]+)\"\s*\)\s*\]\]\s*kernel\s+[\w:]+\s+(\w+)\s*<([^;{}()]*?)>\s*(?:\([^;{}]*\))?\s*;"
)
_KERNEL = re.compile(r"(\[\[\s*host_name\(\s*\"([^\"]+)\"\s*\)\s*\]\]\s*)?\bkernel\s+void\s+(\w+)\s*\(")
_ATTRIBUTES = re.compile(r"\[\[\s*\w+\s*(?:\([^\]\[]*\))?\s*\]\]")
_ATTRIBUTE = re.compile(r"\[\[\s*(\w+)\s*(?:\(\s*(\d+)\s*\))?\s*\]\]\s*$")


@dataclass
class Kernel:
    function: str
    params: list[tuple[str, int | str]]  # ("Buffer" | "Threadgroup", index) or ("Builtin", enum name)


def _matching_paren(text: str, open_at: int, pair: str = "()") -> int:
    depth = 0
    for i in range(open_at, len(text)):
        depth += {pair[0]: 1, pair[1]: -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced {pair} in a kernel")


_LANE_ZERO_BRANCH = re.compile(r"\bif\s*\(\s*(?=tiisg\s*==\s*0\b)")


_THREADGROUP_NAME = re.compile(
    r"\bthreadgroup\s+(?:const\s+)?[\w:]+(?:\s*<[^<>]*>)?\s*(?:\*\s*(?:const\s+)?(\w+)|(\w+)\s*\[)")


def threadgroup_names(text: str) -> set[str]:
    """The identifiers `text` declares in the threadgroup address space: pointers (kernel
    parameters, `threadgroup T * p = ...`) and arrays (`threadgroup T x[N]`)."""
    return {a or b for a, b in _THREADGROUP_NAME.findall(text)}


def converge_around_lane_zero_branches(text: str) -> str:
    """`if (tiisg == 0 ...) { ... }` -> `if (gk_simd_converge(), tiisg == 0 ...) { ... }
    gk_simd_converge();` when the branch names threadgroup memory: the SIMD group meets before lane
    0 takes its branch and after it, so lane 0's accesses are ordered after its lanes' earlier ones
    and before their later ones, whatever order the emulator runs the lanes in. (Every such branch
    upstream is a braced block without else; one that is not raises here.)"""
    shared = threadgroup_names(text)
    out, pos = [], 0
    for m in _LANE_ZERO_BRANCH.finditer(text):
        close = _matching_paren(text, text.index("(", m.start()))
        brace = close + 1 + (len(text[close + 1 :]) - len(text[close + 1 :].lstrip()))
        if text[brace] != "{":
            raise ValueError(f"a lane-0 branch that is not a braced block: {text[m.start() : close + 1]}")
        end = _matching_paren(text, brace, "{}")
        if re.match(r"\s*else\b", text[end + 1 :]):
            raise ValueError(f"a lane-0 branch with an else: {text[m.start() : close + 1]}")
        if shared.isdisjoint(re.findall(r"\w+", text[m.start() : end + 1])):
            continue
        out.append(text[pos : m.end()] + "gk_simd_converge(), " + text[m.end() : end + 1] + " gk_simd_converge();")
        pos = end + 1
    out.append(text[pos:])
    return "".join(out)


def _split_params(params: str) -> list[str]:
    out, depth, start = [], 0, 0
    for i, c in enumerate(params):
        depth += {"(": 1, "<": 1, "[": 1, ")": -1, ">": -1, "]": -1}.get(c, 0)
        if c == "," and depth == 0:
            out.append(params[start:i])
            start = i + 1
    out.append(params[start:])
    return [p.strip() for p in out if p.strip()]


def _param_kinds(params: list[str], where: str) -> list[tuple[str, int | str]]:
    kinds, next_buffer = [], 0
    for p in params:
        m = _ATTRIBUTE.search(p)
        if m is None or m.group(1) == "buffer":
            index = int(m.group(2)) if m else next_buffer
            kinds.append(("Buffer", index))
            next_buffer = index + 1
        elif m.group(1) == "threadgroup":
            kinds.append(("Threadgroup", int(m.group(2) or 0)))
        elif m.group(1) in BUILTINS:
            kinds.append(("Builtin", BUILTINS[m.group(1)]))
        else:
            raise ValueError(f"{where}: parameter {p!r} has an attribute the emulator does not know")
    return kinds


_THREADGROUP_ARRAY = re.compile(r"^(\s*)threadgroup\s+([\w:]+)\s+(\w+)\s*((?:\[[^\]]+\])+)\s*;", re.M)
_HALF_LITERAL = re.compile(r"(?<![\w.])(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?h\b")


_RANGE_INIT = re.compile(r"([\w:]+)\s+(\w+)\s*\[([^\]]+)\]\s*=\s*\{\s*\[\s*0\s*\.\.\.[^\]]+\]\s*=\s*([^}]+?)\s*\}\s*;")
_QUOTE_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


def inline_includes(source: str, folders: list[Path], seen: set[str] | None = None) -> str:
    """`#include "x"` replaced by x's text (found in `folders`), each file once, so that the rewrites
    below reach the kernels' shared headers too (dequantize.h, quantize.h, common.h, ggml-metal-impl.h)."""
    seen = set() if seen is None else seen

    def one(m: re.Match) -> str:
        header = m.group(1)
        if header in seen:
            return ""
        path = next((f / header for f in folders if (f / header).exists()), None)
        if path is None:
            return m.group(0)
        seen.add(header)
        return inline_includes(path.read_text(), folders, seen)

    return _QUOTE_INCLUDE.sub(one, source)


def _after_template_header(before: str) -> bool:
    """Whether a kernel definition preceded by `before` is a template (`template <...>`, maybe with a
    line comment after it)."""
    tail = re.sub(r"//[^\n]*", "", before[-400:]).rstrip()
    return tail.endswith(">")


def prune_literal_conditionals(source: str) -> str:
    """Drop the dead branch of `#if 0` / `#if 1` blocks (upstream keeps alternative kernels there), so
    that the kernel signatures read below are the compiled ones. Other conditionals stay."""
    out, stack = [], []  # stack: (literal or None, in_else)
    for line in source.splitlines(keepends=True):
        stripped = line.strip()
        m = re.match(r"#\s*if\s+([01])\s*(//.*)?$", stripped)
        if m or re.match(r"#\s*if(n?def)?\b", stripped):
            stack.append([int(m.group(1)) if m else None, False])
            if m:
                continue
        elif re.match(r"#\s*else\b", stripped) and stack:
            stack[-1][1] = True
            if stack[-1][0] is not None:
                continue
        elif re.match(r"#\s*endif\b", stripped) and stack:
            literal = stack.pop()[0]
            if literal is not None:
                continue
        live = all(lit is None or (lit == 1) != in_else for lit, in_else in stack)
        if live:
            out.append(line)
    return "".join(out)


def translate(source: str, name: str) -> str:
    """One .metal file (its quoted includes inlined) as a C++ translation unit for the emulator."""
    source = prune_literal_conditionals(source)
    # GNU range initialisers (`float s[N] = { [0 ... N-1] = v };`, C only): a fill loop
    source = _RANGE_INIT.sub(lambda m: f"{m.group(1)} {m.group(2)}[{m.group(3)}]; for (auto& gk_e : {m.group(2)}) gk_e = {m.group(4)};", source)
    # kernel-scope `threadgroup T x[N];`: the threadgroup's one shared array, not a per-thread local
    counter = iter(range(1 << 30))
    source = _THREADGROUP_ARRAY.sub(
        lambda m: f"{m.group(1)}{m.group(2)} (&{m.group(3)}){m.group(4)} = gk_threadgroup_local<{m.group(2)}{m.group(4)}>({next(counter)});",
        source)
    # `constant` is `const` on the CPU (msl.h): `const constant T` would say it twice
    source = re.sub(r"\bconst[ \t]+constant\b|\bconstant[ \t]+const\b", "constant", source)
    source = _HALF_LITERAL.sub(lambda m: f"((half) {m.group(1)}{m.group(2) or ''}f)" if "." in m.group(1) or m.group(2)
                               else f"((half) {m.group(1)}.0f)", source)
    source = converge_around_lane_zero_branches(source)
    text = _FUNCTION_CONSTANT.sub(lambda m: f"{m.group(1)}GK_FUNCTION_CONSTANT({m.group(2)}, {m.group(3)}, {m.group(4)})", source)
    # an explicit instance becomes a pointer to it, defined where the instance stood: its template
    # arguments may use macros the file #undefs further down (fa_*.metal's FA_TYPES)
    instances: list[tuple[str, str, str]] = []

    def instance_pointer(m: re.Match) -> str:
        pointer = f"gk_instance_{len(instances)}"
        instances.append((m.group(1), m.group(2), pointer))
        return f"constexpr auto {pointer} = &{m.group(2)}<{m.group(3)}>;"

    text = _INSTANCE.sub(instance_pointer, text)
    kernels: dict[str, Kernel] = {}
    out, pos = [], 0
    for m in _KERNEL.finditer(text):
        close = _matching_paren(text, m.end() - 1)
        function = m.group(3)
        kernels[function] = Kernel(function, _param_kinds(_split_params(text[m.end() : close]), f"{name}: {function}"))
        if m.group(2):
            instances.append((m.group(2), function, f"&{function}"))
        elif not _after_template_header(text[: m.start()]):  # a plain kernel: its name is its host name
            instances.append((function, function, f"&{function}"))
        # the signature without its attributes (read above; some name address spaces)
        out.append(text[pos : m.start()] + "void " + function + "(" + re.sub(r"\[\[.*?\]\]", "", text[m.end() : close]))
        pos = close
    out.append(text[pos:])
    # attributes left elsewhere (kernel function typedefs): read nowhere, and some name address spaces
    body = _ATTRIBUTES.sub("", "".join(out))
    # each file is its own Metal library: in one unnamed namespace, its globals clash with no other's
    return _prelude(name) + "namespace {\n" + body + _registry(name, kernels, instances) + "}  // namespace\n"


def _prelude(name: str) -> str:
    return (
        f"// {name}, translated for the emulated Metal device by tools/build/metal_translate.py.\n"
        "// a Metal 3.2 device with bfloat (emu props: has_bfloat)\n#define __METAL_VERSION__ 320\n#define GGML_METAL_HAS_BF16 1\n#include <cstddef>\n#include <cstdint>\n#include \"msl.h\"\n"
    )


def _registry(name: str, kernels: dict[str, Kernel], instances: list[tuple[str, str, str]]) -> str:
    lines = ["", "namespace {", "namespace gk_emu = ggml_kernels::metal::emu;"]
    for k in kernels.values():
        entries = ", ".join(f"{{gk_emu::Param::Kind::{kind}, " + (f"gk_emu::{v}" if kind == "Builtin" else str(v)) + "}"
                            for kind, v in k.params)
        lines.append(f"const gk_emu::Param gk_params_{k.function}[] = {{{entries}}};")
    for i, (host_name, function, pointer) in enumerate(instances):
        if function not in kernels:
            raise ValueError(f"{name}: [[host_name(\"{host_name}\")]] names {function}, which is not a kernel of this file")
        lines.append(f"void gk_entry_{i}(const gk_emu::ThreadContext& c) {{ gk_emu::invoke({pointer}, c, gk_params_{function}); }}")
        lines.append(f"gk_emu::KernelRegistrar gk_registrar_{i}(\"{host_name}\", &gk_entry_{i}, \"{name}\");")
    lines.append("}  // namespace")
    return "\n".join(lines) + "\n"


def kernel_names(text: str) -> list[str]:
    """The names a Metal library built from this file would hold: its [[host_name]]s and plain kernels."""
    names = [m.group(1) for m in _INSTANCE.finditer(text)]
    for m in _KERNEL.finditer(text):
        if m.group(2):
            names.append(m.group(2))
        elif not _after_template_header(text[: m.start()]):
            names.append(m.group(3))
    return names


def translate_file(path: Path) -> str:
    """A kernel file of upstream's kernels/ folder, its includes from there, ggml-metal/ and ggml/src/."""
    return translate(inline_includes(path.read_text(), [path.parent, path.parent.parent, path.parent.parent.parent]), path.name)


if __name__ == "__main__":
    sys.stdout.write(translate_file(Path(sys.argv[1])))
