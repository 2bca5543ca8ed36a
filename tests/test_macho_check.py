"""The darwin link checks (tools/build/macho_check.py) and the Mach-O / .tbd reader under them
(tools/build/macho.py): on small Mach-O files written here byte by byte (every refusal, fast), and on
a tiny dylib cross-built with the darwin toolchain (fast once the toolchain is in the cache, which
`nox -s build-darwin` fills; marked slow otherwise, as it then downloads it)."""

from __future__ import annotations

import re
import struct
import subprocess

import pytest

from tools.build import darwin_toolchain, macho, macho_check

ARM64, X86_64 = 0x0100000C, 0x01000007
DYLIB, OBJECT = 6, 1
METAL = "/System/Library/Frameworks/Metal.framework/Versions/A/Metal"
LIBSYSTEM = "/usr/lib/libSystem.B.dylib"
TORCH = "@rpath/libtorch_cpu.dylib"
ALLOWED = {METAL: {"_MTLCreateSystemDefaultDevice"}, LIBSYSTEM: {"_malloc"}, TORCH: {"__ZN2at3mps19getCurrentMPSStreamEv"}}


def _lc_str(cmd: int, text: str, fixed: bytes = b"") -> bytes:
    """A load command with a string at the end (dylib, rpath), padded to 8 bytes."""
    head = 8 + 4 + len(fixed)
    raw = text.encode() + b"\0"
    size = (head + len(raw) + 7) // 8 * 8
    return struct.pack("<III", cmd, size, head) + fixed + raw.ljust(size - head, b"\0")


def write_macho(path, *, cpu=ARM64, filetype=DYLIB, minos=(26, 0), dylibs=(METAL, LIBSYSTEM), rpaths=("@loader_path",),
                install_name="@rpath/libx.dylib", imports=(("_malloc", 2, False),), exports=("_x_init",), signed=True):
    """A minimal 64-bit Mach-O file: `imports` are (name, library ordinal, weak); ordinal 0xfe is flat lookup."""
    cmds = [struct.pack("<IIIIII", macho.LC_BUILD_VERSION, 24, 1, (minos[0] << 16) | (minos[1] << 8), 27 << 16, 0)]
    dylib_fields = struct.pack("<III", 2, 0x10000, 0x10000)
    if install_name:
        cmds.append(_lc_str(macho.LC_ID_DYLIB, install_name, dylib_fields))
    cmds += [_lc_str(macho.LC_LOAD_DYLIB, d, dylib_fields) for d in dylibs]
    cmds += [_lc_str(macho.LC_RPATH, r) for r in rpaths]
    symbols = [(name, 0x01, (ordinal << 8) | (macho.N_WEAK_REF if weak else 0)) for name, ordinal, weak in imports]
    symbols += [(name, 0x0F, 0) for name in exports]  # N_SECT | N_EXT
    n_cmds = len(cmds) + 1 + (1 if signed else 0)
    sizeofcmds = sum(map(len, cmds)) + 24 + (16 if signed else 0)
    symoff = 32 + sizeofcmds
    strings = b"\0" + b"".join(name.encode() + b"\0" for name, _, _ in symbols)
    stroff = symoff + 16 * len(symbols)
    sigoff = stroff + len(strings)
    cmds.append(struct.pack("<IIIIII", macho.LC_SYMTAB, 24, symoff, len(symbols), stroff, len(strings)))
    if signed:
        cmds.append(struct.pack("<IIII", macho.LC_CODE_SIGNATURE, 16, sigoff, 12))
    table, strx = b"", 1
    for name, ntype, desc in symbols:
        table += struct.pack("<IBBHQ", strx, ntype, 1 if ntype & 0x0E else 0, desc, 0)
        strx += len(name) + 1
    header = struct.pack("<IIIIIIII", macho.MH_MAGIC_64, cpu, 0, filetype, n_cmds, sizeofcmds, 0, 0)
    body = header + b"".join(cmds) + table + strings + (struct.pack(">III", macho.CODESIGN_SUPERBLOB, 12, 0) if signed else b"")
    path.write_bytes(body)
    return path


def problems(path, python_extension=False):
    return macho_check.problems(macho.read(path), ALLOWED, python_extension)


def test_reads_what_it_wrote(tmp_path):
    image = macho.read(write_macho(tmp_path / "libx.dylib", imports=(("_malloc", 2, True), ("_MTLCreateSystemDefaultDevice", 1, False))))
    assert (image.cpu, image.filetype, image.platform, image.minos) == ("arm64", "dylib", "macos", (26, 0, 0))
    assert image.dylibs == [METAL, LIBSYSTEM] and image.rpaths == ["@loader_path"]
    assert image.install_name == "@rpath/libx.dylib" and image.signed
    assert image.imports == [macho.Import("_malloc", LIBSYSTEM, True), macho.Import("_MTLCreateSystemDefaultDevice", METAL, False)]
    assert image.exports == {"_x_init"}
    assert problems(tmp_path / "libx.dylib") == []


@pytest.mark.parametrize(("change", "expected"), [
    ({"cpu": X86_64}, "CPU type x86_64, not arm64"),
    ({"filetype": OBJECT, "install_name": None}, "a Mach-O object, not a dylib or bundle"),
    ({"minos": (27, 0)}, "minimum macOS 27.0.0 is above 26.0"),
    ({"dylibs": (METAL, LIBSYSTEM, "/usr/local/lib/libfoo.dylib"), "imports": (("_foo", 3, False),)},
     "loads /usr/local/lib/libfoo.dylib, which is neither torch's nor one of Apple's it may use"),
    ({"dylibs": (METAL, LIBSYSTEM, "/usr/local/lib/libfoo.dylib"), "imports": (("_foo", 3, False),)},
     "imports _foo from /usr/local/lib/libfoo.dylib"),
    ({"imports": (("_MTLNewThing", 1, False),)}, f"imports _MTLNewThing from {METAL}, which does not export it"),
    ({"imports": (("_PyLong_FromLong", 0xFE, False),)}, "binds 1 symbols by flat lookup (no library says it exports them): _PyLong_FromLong"),
    ({"rpaths": ("/root/.cache/torch/lib",)}, "rpath /root/.cache/torch/lib is not relative to the library (@loader_path)"),
    ({"install_name": "/tmp/libx.dylib"}, "install name /tmp/libx.dylib is not @rpath/<name>"),
    ({"signed": False}, "no code signature (arm64 macOS runs no unsigned code)"),
])
def test_refusals(tmp_path, change, expected):
    assert expected in problems(write_macho(tmp_path / "libx.dylib", **change))


def test_flat_lookup_only_for_the_python_c_api_of_an_extension(tmp_path):
    flat = (("_PyLong_FromLong", 0xFE, False), ("__Py_NoneStruct", 0xFE, False))
    assert problems(write_macho(tmp_path / "a.dylib", imports=flat), python_extension=True) == []
    found = problems(write_macho(tmp_path / "b.dylib", imports=(*flat, ("__ZNSt3__16localeC1Ev", 0xFE, False))), True)
    assert found == ["binds 1 symbols that are not Python's C API by flat lookup (no library says it exports them): "
                     "__ZNSt3__16localeC1Ev"]


def test_check_variant_names_every_file_and_rule(tmp_path):
    write_macho(tmp_path / "_x_metal_1.abi3.so", imports=(("_PyLong_FromLong", 0xFE, False),))
    write_macho(tmp_path / "libggml-kernels-metal.dylib", minos=(27, 0), signed=False)
    with pytest.raises(macho_check.LinkCheckError) as e:
        macho_check.check_variant(tmp_path, ALLOWED)
    assert "_x_metal_1.abi3.so" not in str(e.value)
    assert "libggml-kernels-metal.dylib:\n  minimum macOS 27.0.0 is above 26.0\n  no code signature" in str(e.value)
    (tmp_path / "libggml-kernels-metal.dylib").unlink()
    assert [p.name for p in macho_check.check_variant(tmp_path, ALLOWED)] == ["_x_metal_1.abi3.so"]
    (tmp_path / "_x_metal_1.abi3.so").unlink()
    with pytest.raises(macho_check.LinkCheckError, match="no .so or .dylib to check"):
        macho_check.check_variant(tmp_path, ALLOWED)


@pytest.mark.parametrize(("data", "expected"), [
    (b"\x7fELF" + b"\0" * 60, "not a 64-bit little-endian Mach-O file"),
    (struct.pack(">II", 0xCAFEBABE, 2) + b"\0" * 40, "a universal (fat) file"),
    (b"\xcf\xfa", "too short for a Mach-O header"),
    (struct.pack("<IIIIIIII", macho.MH_MAGIC_64, ARM64, 0, DYLIB, 1, 4, 0, 0) + b"\0" * 8, "load commands run past sizeofcmds"),
], ids=["elf", "fat", "short", "commands"])
def test_what_is_not_a_thin_macho_file_is_a_clear_error(tmp_path, data, expected):
    (tmp_path / "f").write_bytes(data)
    with pytest.raises(macho.MachOError, match=re.escape(expected)):
        macho.read(tmp_path / "f")
    with pytest.raises(macho_check.LinkCheckError, match=re.escape(expected)):
        macho_check.check_file(tmp_path / "f", ALLOWED)


def test_export_trie():
    # root -"_"-> n1; n1 -"foo"-> n2 (terminal), -"bar"-> n3 (terminal, a re-export)
    n2 = bytes([2, 0, 0x10, 0])
    n3 = bytes([1 + 1 + 4 + 1, macho.EXPORT_REEXPORT, 1]) + b"_baz\0" + bytes([0])
    root = bytes([0, 1]) + b"_\0" + bytes([5])
    n1 = bytes([0, 2]) + b"foo\0" + bytes([5 + 12]) + b"bar\0" + bytes([5 + 12 + len(n2)])
    assert len(root) == 5 and len(n1) == 12
    assert macho.export_trie(root + n1 + n2 + n3) == {"_foo", "_bar"}
    with pytest.raises(macho.MachOError, match="bad node offset"):
        macho.export_trie(bytes([0, 1]) + b"_\0" + bytes([99]))


def test_tbd_targets_reexports_and_objc_classes(tmp_path):
    (tmp_path / "lib.tbd").write_text(
        "--- !tapi-tbd\ntbd-version: 4\ntargets: [ x86_64-macos, arm64e-macos ]\ninstall-name: '/usr/lib/libA.dylib'\n"
        "exports:\n  - targets: [ x86_64-macos ]\n    symbols: [ _intel_only ]\n"
        "  - targets: [ x86_64-macos, arm64e-macos ]\n    symbols: [ _a1, '_a2' ]\n    objc-classes: [ NSThing ]\n...\n"
        "--- !tapi-tbd\ntbd-version: 4\ntargets: [ arm64-macos ]\ninstall-name: '/usr/lib/system/libB.dylib'\n"
        "exports:\n  - targets: [ arm64-macos ]\n    symbols: [ _b1,\n      _b2 ]\n...\n")
    name, exports = macho.read_tbd(tmp_path / "lib.tbd")
    assert name == "/usr/lib/libA.dylib"
    assert exports == {"_a1", "_a2", "_OBJC_CLASS_$_NSThing", "_OBJC_METACLASS_$_NSThing", "_b1", "_b2"}
    macho.write_tbd(tmp_path / "ours.tbd", "@rpath/libc10.dylib", {"_z", "_y"})
    assert macho.read_tbd(tmp_path / "ours.tbd") == ("@rpath/libc10.dylib", {"_y", "_z"})
    (tmp_path / "bad.tbd").write_text("install-name: x\n")
    with pytest.raises(macho.MachOError, match="not a TAPI .tbd file"):
        macho.read_tbd(tmp_path / "bad.tbd")


# ---- on binaries the darwin toolchain makes ----

# fast with the toolchain in the cache (nox -s build-darwin fills it); slow when it must be downloaded
needs_toolchain = pytest.mark.skipif(False, reason="cached") if darwin_toolchain.cached() else pytest.mark.slow
TINY = """
#include <stdlib.h>
extern void* MTLCreateSystemDefaultDevice(void);
__attribute__((visibility("default"))) void* tiny(void) { return MTLCreateSystemDefaultDevice() ? malloc(1) : 0; }
"""


@pytest.fixture(scope="module")
def toolchain():
    return darwin_toolchain.toolchain()


def zig(tc, *args, target=darwin_toolchain.TARGET):
    subprocess.run([str(tc.zig), "cc", "-target", target, *map(str, args)], check=True, env={**tc.env(), "PATH": "/usr/bin:/bin"})


@needs_toolchain
def test_a_cross_built_dylib_passes_and_its_wrong_twins_do_not(toolchain, tmp_path):
    tc = toolchain
    allowed = macho_check.libraries(tc, darwin_toolchain.TORCH_VERSIONS[0])
    (tmp_path / "tiny.c").write_text(TINY)
    zig(tc, "-O2", "-c", tmp_path / "tiny.c", "-o", tmp_path / "tiny.o")
    link = ["-shared", tmp_path / "tiny.o", tc.stubs / "Metal.tbd", "-Wl,-install_name,@rpath/libtiny.dylib"]
    zig(tc, *link, "-o", tmp_path / "libtiny.dylib")
    image = macho.read(tmp_path / "libtiny.dylib")
    assert (image.cpu, image.platform, image.minos, image.signed) == ("arm64", "macos", (26, 0, 0), True)
    assert {i.library for i in image.imports if i.name == "_MTLCreateSystemDefaultDevice"} == {METAL}
    macho_check.check_file(tmp_path / "libtiny.dylib", allowed)

    # the same dylib asking for macOS 27 (its LC_BUILD_VERSION's minos rewritten: a zig link for
    # another target first builds compiler-rt for it, half a minute)
    data = bytearray((tmp_path / "libtiny.dylib").read_bytes())
    at = data.index(struct.pack("<III", macho.LC_BUILD_VERSION, 32, 1)) + 12
    assert struct.unpack_from("<I", data, at)[0] == 26 << 16
    struct.pack_into("<I", data, at, 27 << 16)
    (tmp_path / "libtiny27.dylib").write_bytes(data)
    with pytest.raises(macho_check.LinkCheckError, match="minimum macOS 27.0.0 is above 26.0"):
        macho_check.check_file(tmp_path / "libtiny27.dylib", allowed)
    zig(tc, "-c", tmp_path / "tiny.c", "-o", tmp_path / "tiny_x86.o", target="x86_64-macos.26.0")
    assert macho.read(tmp_path / "tiny_x86.o").cpu == "x86_64"
    with pytest.raises(macho_check.LinkCheckError, match="CPU type x86_64, not arm64"):
        macho_check.check_file(tmp_path / "tiny_x86.o", allowed)
    macho.write_tbd(tmp_path / "Metal.tbd", "/usr/local/lib/libmetalish.dylib", {"_MTLCreateSystemDefaultDevice"})
    zig(tc, "-shared", tmp_path / "tiny.o", tmp_path / "Metal.tbd", "-Wl,-install_name,@rpath/libtiny.dylib", "-o", tmp_path / "libother.dylib")
    with pytest.raises(macho_check.LinkCheckError, match="imports _MTLCreateSystemDefaultDevice from /usr/local/lib/libmetalish.dylib"):
        macho_check.check_file(tmp_path / "libother.dylib", allowed)
