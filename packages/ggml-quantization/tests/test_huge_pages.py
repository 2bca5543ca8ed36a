"""huge_pages: packed weights copied (or parameters moved) into one mapping on transparent huge pages.

Whether Linux grants huge pages depends on its free memory, so the tests check what `place` controls:
the copies' contents, layout and alignment, the mapping's eligibility for huge pages (smaps'
THPeligible), products on the copies equal to products on the originals, and the fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .test_ops import make_weights


def _mapping_of(address: int) -> dict[str, str]:
    """/proc/self/smaps' fields of the mapping holding `address`."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.parametrize(("text", "expected"), [("[always] madvise never", True), ("always [madvise] never", True),
                                                ("always madvise [never]", False), ("", False)])
def test_available_reads_the_selected_setting(gq, tmp_path, text, expected):
    setting = tmp_path / "enabled"
    setting.write_text(text + "\n")
    assert gq.huge_pages.available(setting) is expected
    assert gq.huge_pages.available(tmp_path / "missing") is False


def test_place_copies_end_to_end_on_one_advised_mapping(gq):
    if not gq.huge_pages.available():
        pytest.skip("this system offers no transparent huge pages")
    blocks, cols = make_weights(gq, gq.GGMLType.Q4_K, rows=64)
    others = [torch.arange(10, dtype=torch.float32), torch.ones(3, 5, dtype=torch.bfloat16).t(), torch.empty(0)]
    placed = gq.huge_pages.place([blocks, *others])
    for original, copy in zip([blocks, *others], placed, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape and copy.is_contiguous()
        assert torch.equal(copy, original) and copy.data_ptr() % gq.huge_pages.ALIGN == 0
    assert placed[1].data_ptr() - placed[0].data_ptr() == blocks.numel()  # 64-byte aligned already
    assert placed[0].untyped_storage().data_ptr() == placed[1].untyped_storage().data_ptr()
    assert placed[0].data_ptr() % gq.huge_pages.HUGE_PAGE_BYTES == 0
    assert _mapping_of(placed[0].data_ptr()).get("THPeligible") == "1"
    x = torch.randn(3, cols)
    assert torch.equal(gq.mul_mat_vec(placed[0], x, gq.GGMLType.Q4_K, 64),
                       gq.mul_mat_vec(blocks, x, gq.GGMLType.Q4_K, 64))


def test_move_parameters_in_place_once_each(gq):
    linear = torch.nn.Linear(64, 32)
    tied = torch.nn.Sequential(linear, torch.nn.Linear(64, 32))
    tied[1].weight = linear.weight
    params = list(tied.parameters())  # the tied weight once
    before = [p.detach().clone() for p in params]
    moved = gq.huge_pages.move_parameters(params)
    assert all(p is q for p, q in zip(params, tied.parameters(), strict=True)) and tied[1].weight is linear.weight
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    if gq.huge_pages.available():
        assert moved == sum(p.numel() * 4 for p in params)
        assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    else:
        assert moved == 0


def test_without_huge_pages_the_tensors_stay(gq, monkeypatch):
    monkeypatch.setattr(gq.huge_pages, "available", lambda *args: False)
    tensors = [torch.ones(4), torch.zeros(2, 2)]
    assert all(a is b for a, b in zip(gq.huge_pages.place(tensors), tensors, strict=True))
    param = torch.nn.Parameter(torch.ones(4))
    data = param.data
    assert gq.huge_pages.move_parameters([param]) == 0 and param.data.data_ptr() == data.data_ptr()


def test_bad_input_is_refused(gq):
    with pytest.raises(TypeError, match="item 1 is a list"):
        gq.huge_pages.place([torch.ones(2), [1, 2]])
    with pytest.raises(ValueError, match="item 0 is torch.strided on meta"):
        gq.huge_pages.place([torch.empty(4, device="meta")])
    with pytest.raises(ValueError, match="sparse"):
        gq.huge_pages.move_parameters([torch.eye(3).to_sparse()])


def test_arena_opens_mappings_as_it_fills(gq):
    arena = gq.huge_pages.Arena(chunk_bytes=1 << 20)
    tensors = [torch.randint(0, 255, (600_000,), dtype=torch.uint8) for _ in range(3)]
    copies = [arena.copy(t) for t in tensors]
    assert all(torch.equal(c, t) and arena.holds(c) and not arena.holds(t) for c, t in zip(copies, tensors, strict=True))
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 3  # 1.2 MB does not fit one 1 MiB mapping
    big = arena.copy(torch.ones(3 << 20, dtype=torch.uint8))  # larger than a chunk: a mapping of its own size
    assert big.sum().item() == 3 << 20 and big.data_ptr() % gq.huge_pages.HUGE_PAGE_BYTES == 0


def test_release_unused_gives_back_only_what_no_kept_tensor_reads(gq):
    arena = gq.huge_pages.Arena()
    a, b, c = (arena.copy(torch.full((1 << 16,), v, dtype=torch.uint8)) for v in (1, 2, 3))
    assert arena.release_unused([a, c]) == 0  # b lies within a huge page that a and c read
    released = arena.release_unused([a, c, torch.ones(3)], granule=4096)  # a tensor elsewhere is ignored
    assert released >= (1 << 16) - 2 * 4096 and released <= 1 << 16
    assert (a == 1).all() and (c == 3).all()
    assert (b == 0).sum().item() == released  # given-back pages read as zeros
    d = arena.copy(torch.full((10,), 4, dtype=torch.uint8))  # the arena goes on after a release
    assert (d == 4).all() and (c == 3).all()
    arena.copy(torch.full((6 << 20,), 5, dtype=torch.uint8))
    e = arena.copy(torch.full((10,), 6, dtype=torch.uint8))
    assert arena.release_unused([a, c, d, e]) >= 4 << 20  # at least two whole huge pages inside big
    assert (e == 6).all() and (d == 4).all()


def test_copy_into_unused_takes_the_room_of_dead_copies(gq):
    arena = gq.huge_pages.Arena()
    a, dead, c = (arena.copy(torch.full((1 << 16,), v, dtype=torch.uint8)) for v in (1, 2, 3))
    converted = torch.full((1 << 15,), 7, dtype=torch.uint8)  # smaller than the dead copy it came from
    too_big = torch.full((1 << 17,), 8, dtype=torch.uint8)
    first, second = arena.copy_into_unused([a, c], [too_big, converted])
    assert first.data_ptr() > c.data_ptr() and dead.data_ptr() <= second.data_ptr() < c.data_ptr()
    assert (second == 7).all() and (first == 8).all() and (a == 1).all() and (c == 3).all()
    assert arena.holds(first) and arena.holds(second)
