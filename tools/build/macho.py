"""A small reader of Mach-O files and `.tbd` text stubs: what the darwin link checks need, nothing more.

Mach-O (64-bit, little-endian, thin; a fat file is refused): the header's CPU type and file type,
the load commands (dylibs loaded, rpaths, install name, LC_BUILD_VERSION, code signature), the
undefined symbols of the symbol table with the library each one binds to (two-level namespace:
the ordinal in n_desc), and the exported symbols (the export trie, else the symbol table).

`.tbd` (text-based dylib stubs, TAPI v4 as Apple's SDK and zig ship them): install name and
exported symbols per target.

    python -m tools.build.macho FILE     # prints what was read
"""

from __future__ import annotations

import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

MH_MAGIC_64 = 0xFEEDFACF
FAT_MAGICS = (0xCAFEBABE, 0xBEBAFECA, 0xCAFEBABF, 0xBFBAFECA)
CPU_TYPES = {0x0100000C: "arm64", 0x01000007: "x86_64", 0x0000000C: "arm", 0x00000007: "i386"}
FILE_TYPES = {1: "object", 2: "execute", 6: "dylib", 8: "bundle", 9: "dylib_stub"}
PLATFORMS = {1: "macos", 2: "ios", 3: "tvos", 4: "watchos", 6: "maccatalyst", 7: "iossimulator", 11: "visionos"}

LC_REQ_DYLD = 0x80000000
LC_SYMTAB = 0x2
LC_LOAD_DYLIB = 0xC
LC_ID_DYLIB = 0xD
LC_CODE_SIGNATURE = 0x1D
LC_LAZY_LOAD_DYLIB = 0x20
LC_DYLD_INFO = 0x22
LC_VERSION_MIN_MACOSX = 0x24
LC_BUILD_VERSION = 0x32
LC_LOAD_WEAK_DYLIB = 0x18 | LC_REQ_DYLD
LC_RPATH = 0x1C | LC_REQ_DYLD
LC_REEXPORT_DYLIB = 0x1F | LC_REQ_DYLD
LC_DYLD_INFO_ONLY = 0x22 | LC_REQ_DYLD
LC_LOAD_UPWARD_DYLIB = 0x23 | LC_REQ_DYLD
LC_DYLD_EXPORTS_TRIE = 0x33 | LC_REQ_DYLD
DYLIB_LOADS = (LC_LOAD_DYLIB, LC_LOAD_WEAK_DYLIB, LC_REEXPORT_DYLIB, LC_LAZY_LOAD_DYLIB, LC_LOAD_UPWARD_DYLIB)

N_STAB, N_TYPE, N_EXT = 0xE0, 0x0E, 0x01
N_UNDF, N_SECT, N_INDR = 0x0, 0xE, 0xA
N_WEAK_REF = 0x40
SELF_LIBRARY_ORDINAL, DYNAMIC_LOOKUP_ORDINAL, EXECUTABLE_ORDINAL = 0, 0xFE, 0xFF
EXPORT_REEXPORT = 0x08
EXPORT_STUB_AND_RESOLVER = 0x10
CODESIGN_SUPERBLOB = 0xFADE0CC0


class MachOError(ValueError):
    """The file is not a Mach-O file this reader understands."""


@dataclass(frozen=True)
class Import:
    name: str
    library: str | None  # install name; None: flat (dynamic) lookup, or an object file's undefined symbol
    weak: bool


@dataclass
class MachO:
    path: Path
    cpu: str
    filetype: str
    dylibs: list[str] = field(default_factory=list)  # in load order: ordinal i+1 is dylibs[i]
    rpaths: list[str] = field(default_factory=list)
    install_name: str | None = None
    platform: str | None = None
    minos: tuple[int, int, int] | None = None
    sdk: tuple[int, int, int] | None = None
    signed: bool = False  # an LC_CODE_SIGNATURE pointing at a code-signing superblob
    imports: list[Import] = field(default_factory=list)
    exports: set[str] = field(default_factory=set)


def _version(v: int) -> tuple[int, int, int]:
    return (v >> 16, (v >> 8) & 0xFF, v & 0xFF)


def _cstring(data: bytes, start: int) -> str:
    end = data.index(b"\0", start)
    return data[start:end].decode("utf-8", "replace")


def _uleb(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise MachOError("export trie: truncated ULEB128")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def export_trie(trie: bytes) -> set[str]:
    """Every symbol name a dyld export trie holds (re-exports included)."""
    names: set[str] = set()
    stack, seen = [(0, "")], set()
    while stack:
        offset, prefix = stack.pop()
        if offset in seen or offset >= len(trie):
            raise MachOError(f"export trie: bad node offset {offset}")
        seen.add(offset)
        size, pos = _uleb(trie, offset)
        if size:
            names.add(prefix)
        pos += size
        count = trie[pos]
        pos += 1
        for _ in range(count):
            end = trie.index(b"\0", pos)
            edge = trie[pos:end].decode("utf-8", "replace")
            child, pos = _uleb(trie, end + 1)
            stack.append((child, prefix + edge))
    return names


def read(path: str | Path) -> MachO:
    """The parts of a Mach-O file listed in MachO; MachOError for anything else."""
    return parse(Path(path).read_bytes(), Path(path))


def parse(data: bytes, path: Path) -> MachO:
    """read() of a file's bytes (`path` names it in messages)."""
    if len(data) < 32:
        raise MachOError(f"{path}: too short for a Mach-O header")
    (magic,) = struct.unpack_from("<I", data, 0)
    if magic in FAT_MAGICS or struct.unpack_from(">I", data, 0)[0] in FAT_MAGICS:
        raise MachOError(f"{path}: a universal (fat) file; the darwin builds are thin arm64")
    if magic != MH_MAGIC_64:
        raise MachOError(f"{path}: not a 64-bit little-endian Mach-O file (magic {magic:#x})")
    _, cputype, _, filetype, ncmds, sizeofcmds, _, _ = struct.unpack_from("<IiiIIIII", data, 0)
    m = MachO(path, CPU_TYPES.get(cputype & 0xFFFFFFFF, f"cpu {cputype:#x}"), FILE_TYPES.get(filetype, f"type {filetype}"))
    pos, end = 32, 32 + sizeofcmds
    symtab = trie = None
    for _ in range(ncmds):
        if pos + 8 > end:
            raise MachOError(f"{path}: load commands run past sizeofcmds")
        cmd, size = struct.unpack_from("<II", data, pos)
        if size < 8 or pos + size > end:
            raise MachOError(f"{path}: load command {cmd:#x} has a bad size {size}")
        body = data[pos : pos + size]
        if cmd in DYLIB_LOADS:
            m.dylibs.append(_cstring(body, struct.unpack_from("<I", body, 8)[0]))
        elif cmd == LC_ID_DYLIB:
            m.install_name = _cstring(body, struct.unpack_from("<I", body, 8)[0])
        elif cmd == LC_RPATH:
            m.rpaths.append(_cstring(body, struct.unpack_from("<I", body, 8)[0]))
        elif cmd == LC_BUILD_VERSION:
            platform, minos, sdk = struct.unpack_from("<III", body, 8)
            m.platform, m.minos, m.sdk = PLATFORMS.get(platform, f"platform {platform}"), _version(minos), _version(sdk)
        elif cmd == LC_VERSION_MIN_MACOSX and m.platform is None:
            minos, sdk = struct.unpack_from("<II", body, 8)
            m.platform, m.minos, m.sdk = "macos", _version(minos), _version(sdk)
        elif cmd == LC_SYMTAB:
            symtab = struct.unpack_from("<IIII", body, 8)
        elif cmd == LC_DYLD_EXPORTS_TRIE:
            off, n = struct.unpack_from("<II", body, 8)
            trie = data[off : off + n]
        elif cmd in (LC_DYLD_INFO, LC_DYLD_INFO_ONLY):
            off, n = struct.unpack_from("<II", body, 40)
            if n:
                trie = data[off : off + n]
        elif cmd == LC_CODE_SIGNATURE:
            off, _ = struct.unpack_from("<II", body, 8)
            m.signed = off + 4 <= len(data) and struct.unpack_from(">I", data, off)[0] == CODESIGN_SUPERBLOB
        pos += size
    if symtab:
        _read_symbols(m, data, *symtab)
    if trie is not None:
        m.exports = export_trie(trie)
    return m


def _read_symbols(m: MachO, data: bytes, symoff: int, nsyms: int, stroff: int, strsize: int) -> None:
    if symoff + 16 * nsyms > len(data) or stroff + strsize > len(data):
        raise MachOError(f"{m.path}: the symbol table runs past the end of the file")
    two_level = m.filetype != "object"
    for i in range(nsyms):
        strx, ntype, _, desc, _ = struct.unpack_from("<IBBHQ", data, symoff + 16 * i)
        if ntype & N_STAB or not ntype & N_EXT:
            continue
        name = _cstring(data, stroff + strx)
        kind = ntype & N_TYPE
        if kind == N_UNDF:
            ordinal = (desc >> 8) & 0xFF
            library = None
            if two_level and ordinal not in (SELF_LIBRARY_ORDINAL, DYNAMIC_LOOKUP_ORDINAL, EXECUTABLE_ORDINAL):
                if ordinal > len(m.dylibs):
                    raise MachOError(f"{m.path}: {name} binds to library ordinal {ordinal}, but {len(m.dylibs)} are loaded")
                library = m.dylibs[ordinal - 1]
            elif two_level and ordinal == EXECUTABLE_ORDINAL:
                library = "<executable>"
            m.imports.append(Import(name, library, bool(desc & N_WEAK_REF)))
        elif kind in (N_SECT, N_INDR):
            m.exports.add(name)


# ---- .tbd text stubs ----

_TBD_LISTS = re.compile(r"(symbols|weak-symbols|thread-local-symbols|objc-classes|objc-eh-types|objc-ivars):\s*\[(.*?)\]", re.S)
_OBJC_PREFIX = {"objc-classes": ("_OBJC_CLASS_$_", "_OBJC_METACLASS_$_"), "objc-eh-types": ("_OBJC_EHTYPE_$_",),
                "objc-ivars": ("_OBJC_IVAR_$_",)}


def _tbd_list(text: str) -> list[str]:
    return [s.strip().strip("'\"") for s in text.split(",") if s.strip()]


def _tbd_field(doc: str, key: str) -> str | None:
    found = re.search(rf"^{key}:\s*'?([^'\n]+?)'?\s*$", doc, re.M)
    return found.group(1) if found else None


def read_tbd(path: str | Path, target: str = "arm64-macos") -> tuple[str, set[str]]:
    """(install name, exported symbols for `target`) of a .tbd file: its first document's install
    name, and the exports of every document in it (the libraries it re-exports, as libSystem's)."""
    path = Path(path)
    text = path.read_text()
    arch, _, os_name = target.partition("-")
    accepted = {target, f"{arch}e-{os_name}"}  # arm64e stubs serve arm64 (as ld64 and zig read them)
    docs = [d for d in re.split(r"^--- !tapi-tbd[^\n]*\n", text, flags=re.M) if d.strip()]
    if not docs or not text.lstrip().startswith("--- !tapi-tbd"):
        raise MachOError(f"{path}: not a TAPI .tbd file (no '--- !tapi-tbd' document)")
    install = _tbd_field(docs[0], "install-name")
    if not install:
        raise MachOError(f"{path}: no install-name")
    exports: set[str] = set()
    for doc in docs:
        # each list entry starts with `- targets: [...]`; its symbol lists follow up to the next one
        entries = list(re.finditer(r"-\s+targets:\s*\[(.*?)\]", doc, re.S))
        for i, entry in enumerate(entries):
            if not accepted & set(_tbd_list(entry.group(1))):
                continue
            body = doc[entry.end() : entries[i + 1].start() if i + 1 < len(entries) else len(doc)]
            for key, names in _TBD_LISTS.findall(body):
                for name in _tbd_list(names):
                    exports.update(p + name for p in _OBJC_PREFIX.get(key, ("",)))
    return install, exports


def write_tbd(path: Path, install_name: str, symbols: set[str] | list[str], current_version: str = "1") -> None:
    """A one-document TAPI v4 stub exporting `symbols` for arm64 macOS (rewritten only when it changed)."""
    quoted = ", ".join(f"'{s}'" for s in sorted(symbols))
    text = ("--- !tapi-tbd\ntbd-version:     4\ntargets:         [ arm64-macos ]\n"
            f"install-name:    '{install_name}'\ncurrent-version: {current_version}\n"
            f"exports:\n  - targets:         [ arm64-macos ]\n    symbols:         [ {quoted} ]\n...\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        if arg.endswith(".tbd"):
            name, syms = read_tbd(arg)
            print(f"{arg}: {name}, {len(syms)} exports")
            continue
        m = read(arg)
        print(f"{arg}: {m.cpu} {m.filetype}, {m.platform} minos {m.minos} sdk {m.sdk}, signed={m.signed}")
        print(f"  install name {m.install_name}; rpaths {m.rpaths}")
        for d in m.dylibs:
            print(f"  loads {d}: {sum(1 for i in m.imports if i.library == d)} imports")
        print(f"  {len(m.imports)} imports, {len(m.exports)} exports")
