"""Packed weights on transparent huge pages, for products that stream them from memory.

Why. A decode step reads every weight once from DRAM, one 4 KiB page after another, and each new
page costs a TLB miss and a page walk, and stops the hardware prefetchers at its edge. On 2 MiB
pages the same stream runs faster: one-row products of 1-25 MB weights took 1.23-1.38x less time
on a 2-core AMD EPYC (zen4), one and two threads, ours and ggml's own op alike (both reading the
same pages; docs/benchmarks.md, "Weights on huge pages"). llama.cpp maps its model file, whose
pages are 4 KiB.

How. `place(tensors)` copies CPU tensors end to end, each start 64-byte aligned, into one private
anonymous mapping advised `MADV_HUGEPAGE` and returns the copies, views of that mapping, which
lives as long as any of them; `move_parameters(params)` does the same to a model's parameters in
place; an `Arena` takes tensors one at a time as they come (a loader's), opening mappings as it
goes. One mapping for many tensors: a mapping per tensor would round each up to 2 MiB. Linux backs such a mapping with huge pages when its transparent huge page setting
(`THP_SETTING`) is `always` or `madvise`, as far as it finds free 2 MiB frames; elsewhere (`never`,
no such file, not Linux) `place` returns the tensors themselves. The copy touches each page once,
so where the kernel finds no huge page it falls back to small ones, never to an error.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

HUGE_PAGE_BYTES = 2 << 20
ALIGN = 64  # each tensor's first byte: a cache line, as torch's allocator aligns them
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available(setting: Path = THP_SETTING) -> bool:
    """Whether this system backs advised anonymous memory with huge pages: the selected (bracketed)
    word of its transparent huge page setting is `always` or `madvise`."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        words = setting.read_text().split()
    except OSError:
        return False
    return "[always]" in words or "[madvise]" in words


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check(tensors: Sequence[torch.Tensor]) -> None:
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"huge_pages takes tensors; item {i} is a {type(t).__name__}")
        if t.device.type != "cpu" or t.layout != torch.strided:
            raise ValueError(f"huge_pages takes dense CPU tensors; item {i} is {t.layout} on {t.device}")


class _Mapping:
    """One mapping of an arena of `size` usable bytes: the mmap object, a uint8 tensor over all of it,
    its first address, where copies start (its first huge page) and end, and the end of what was
    written."""

    __slots__ = ("memory", "whole", "first", "start", "end", "written")

    def __init__(self, size: int):
        # whole huge pages, and one more to start on one: the kernel may place a mapping on any page
        # boundary, and a huge page needs a 2 MiB-aligned range inside the mapping
        length = _aligned(size, HUGE_PAGE_BYTES) + HUGE_PAGE_BYTES
        self.memory = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.memory.madvise(mmap.MADV_HUGEPAGE)
        self.whole = torch.frombuffer(self.memory, dtype=torch.uint8)  # keeps the mapping alive
        self.first = self.whole.data_ptr()
        self.start = self.written = _aligned(self.first, HUGE_PAGE_BYTES)
        self.end = self.start + size

    def contains(self, address: int) -> bool:
        return self.first <= address < self.first + self.whole.numel()

    def view(self, address: int, t: torch.Tensor) -> torch.Tensor:
        """The mapping's bytes from `address` on as a tensor of `t`'s dtype and shape."""
        offset = address - self.first
        return self.whole[offset : offset + _nbytes(t)].view(t.dtype).view(t.shape)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The first and past-the-end address of the bytes `t` reads."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if n > 0)
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _aligned(address: int, to: int = ALIGN) -> int:
    return (address + to - 1) // to * to


class Arena:
    """Copies of tensors laid end to end (each start `ALIGN`-byte aligned) in private anonymous
    mappings advised `MADV_HUGEPAGE`, a new one of at least `chunk_bytes` (starting on a huge page)
    whenever the current one is full. Linux backs a page of anonymous memory only once it is
    written, so a mapping's unused tail costs address space, not memory. A mapping lives as long as
    any copy in it (or the arena).

    A loader's copies that it then converts (reorders, splits) die in the arena. `copy_into_unused`
    puts the converted tensors where they were (they are mostly of the same size) and
    `release_unused` gives back what is still dead."""

    def __init__(self, chunk_bytes: int = 256 << 20):
        self.chunk_bytes = int(chunk_bytes)
        self._maps: list[_Mapping] = []
        self._end = 0  # where the next copy goes in the last mapping (an address)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t`'s memory lies in one of the arena's mappings."""
        return any(m.contains(t.data_ptr()) for m in self._maps)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `t` (a dense CPU tensor) in the arena, after the last one."""
        _check([t])
        nbytes = _nbytes(t)
        start = _aligned(self._end)
        last = self._maps[-1] if self._maps else None
        if last is None or start + nbytes > last.end:
            last = _Mapping(max(self.chunk_bytes, nbytes))
            self._maps.append(last)
            start = last.start
        self._end = last.written = start + nbytes
        return last.view(start, t).copy_(t)

    def _unused(self, keep: Iterable[torch.Tensor]) -> list[list]:
        """[mapping, first, end] of every written range of the arena that no tensor of `keep` reads."""
        extents = sorted(_extent(t) for t in keep if isinstance(t, torch.Tensor) and self.holds(t))
        gaps = []
        for m in self._maps:
            cursor = m.start
            for first, end in [*extents, (m.written, m.written)]:
                if end <= m.start or first > m.written:
                    continue
                if min(first, m.written) > cursor:
                    gaps.append([m, cursor, min(first, m.written)])
                cursor = max(cursor, end)
        return gaps

    def copy_into_unused(self, keep: Iterable[torch.Tensor], tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of `tensors` in the arena, each in written memory that no tensor of `keep` reads
        where one fits (largest first, first fit), else after the last copy. Pass every tensor still
        in use that may lie in the arena."""
        tensors = list(tensors)
        _check(tensors)
        gaps = self._unused(keep)
        copies: dict[int, torch.Tensor] = {}
        for i in sorted(range(len(tensors)), key=lambda i: -_nbytes(tensors[i])):
            t = tensors[i]
            for gap in gaps:
                start = _aligned(gap[1])
                if start + _nbytes(t) <= gap[2]:
                    copies[i] = gap[0].view(start, t).copy_(t)
                    gap[1] = start + _nbytes(t)
                    break
            else:
                copies[i] = self.copy(t)
        return [copies[i] for i in range(len(tensors))]

    def release_unused(self, keep: Iterable[torch.Tensor], granule: int = HUGE_PAGE_BYTES) -> int:
        """Give the system back the written memory of the arena that no tensor of `keep` reads (copies
        that served a moment, such as a loader's before it converted them), in whole `granule`s (a
        multiple of the page size): releasing part of a huge page would split it into small pages,
        for the tensors beside the gap too. Released memory reads as zeros afterwards: pass every
        tensor still in use that may lie in the arena. Returns the bytes given back."""
        released = 0
        for m, first, end in self._unused(keep):
            first, end = _aligned(first, granule), end // granule * granule
            if end > first:
                m.memory.madvise(mmap.MADV_DONTNEED, first - m.first, end - first)
                released += end - first
        return released


def place(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (dense CPU tensors of any dtype, shape and strides; copied contiguous),
    in order, end to end in one mapping on huge pages; the tensors themselves where `available()` is
    False or they hold no bytes."""
    tensors = list(tensors)
    _check(tensors)
    total = sum(_nbytes(t) + ALIGN for t in tensors)
    if not any(_nbytes(t) for t in tensors) or not available():
        return tensors
    arena = Arena(chunk_bytes=total)
    return [arena.copy(t) for t in tensors]


def move_parameters(parameters: Sequence[torch.nn.Parameter]) -> int:
    """Moves each parameter's data (a dense CPU tensor) into one mapping on huge pages, in place
    (`param.data`), one at a time, so that each old storage is freed as soon as it is copied unless
    something else holds it. Pass each parameter once (a tied weight once for all the modules
    holding it). Returns the bytes moved (0 where `available()` is False)."""
    parameters = list(parameters)
    _check(parameters)
    total = sum(_nbytes(p) + ALIGN for p in parameters)
    if not any(_nbytes(p) for p in parameters) or not available():
        return 0
    arena = Arena(chunk_bytes=total)
    with torch.no_grad():
        for param in parameters:
            param.data = arena.copy(param.data)
    return sum(_nbytes(p) for p in parameters)
