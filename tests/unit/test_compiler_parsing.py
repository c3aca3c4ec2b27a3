"""Parsing ptxas -v logs and cuobjdump listings: no compiler needed."""

from __future__ import annotations

import pytest

from fagen.compiler.resources import parse_ptxas_log, performance_warnings
from fagen.compiler.sass import families_in, sass_problems

LOG = """\
ptxas info    : 77 bytes gmem
ptxas info    : Compiling entry function 'kern' for 'sm_80'
ptxas info    : Function properties for kern
ptxas         .     16 bytes stack frame, 12 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 528 bytes cmem[0]
ptxas info    : Compile time = 489.762 ms
"""


def test_ptxas_log_resources():
    r = parse_ptxas_log(LOG, "kern")
    assert (r.registers, r.spill_store_bytes, r.spill_load_bytes, r.stack_bytes, r.static_smem) == (
        255, 12, 20, 16, 1024)
    assert r.spill_bytes == 32


def test_ptxas_log_without_the_entry_is_an_error():
    with pytest.raises(ValueError, match="other"):
        parse_ptxas_log(LOG, "other")


def test_performance_warning_is_found():
    log = LOG + ("ptxas info    : (C7517) warpgroup.wait is injected in between wgmma.wait_group "
                 "and the first use of its registers\n")
    assert len(performance_warnings(log)) == 1
    assert performance_warnings(LOG) == []


def test_sass_families_strip_modifiers_and_predicates():
    listing = """
        /*0080*/                   LDG.E.U16 R0, [R6.64] ;                /* 0x0000000406007981 */
        /*0090*/              @!P0 HMMA.16816.F32.BF16 R4, R8, R12, R4 ;  /* 0x0 */
        /*00a0*/               @UP1 LDSM.16.M88.4 R8, [R2] ;             /* 0x0 */
        /*00b0*/                   EXIT ;                                 /* 0x0 */
    """
    assert families_in(listing) == {"LDG", "HMMA", "LDSM", "EXIT"}


def test_sass_problems_name_missing_families_and_local_memory():
    problems = sass_problems({"HMMA", "STL"}, ("HMMA", "LDSM"))
    assert any("LDSM" in p for p in problems)
    assert any("STL" in p for p in problems)
    assert sass_problems({"HMMA", "LDSM"}, ("HMMA", "LDSM")) == []


# ---- many cubins in one nvdisasm (fagen.compiler.sass.sass_families_of) ----

def _elf(sections: list[tuple[int, bytes]]) -> bytes:
    """A minimal ELF64 image: the given (sh_flags, bytes) sections after a null section."""
    import struct

    body = b"".join(data for _, data in sections)
    shoff = 64 + len(body)
    header = bytearray(64)
    header[:7] = b"\x7fELF\x02\x01\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, len(sections) + 1, 0)
    table, offset = bytearray(64), 64  # the null section first
    for flags, data in sections:
        table += struct.pack("<IIQQQQIIQQ", 0, 1, flags, 0, offset, len(data), 0, 0, 128, 0)
        offset += len(data)
    return bytes(header) + body + bytes(table)


EXEC, ALLOC = 0x6, 0x2


def test_code_sections_are_the_executable_ones():
    from fagen.compiler.sass import code_sections

    cubin = _elf([(ALLOC, b"c" * 8), (EXEC, b"a" * 32), (EXEC, b"b" * 16)])
    assert code_sections(cubin) == [b"a" * 32, b"b" * 16]
    with pytest.raises(ValueError):
        code_sections(b"not an elf")
    with pytest.raises(ValueError):
        code_sections(_elf([(EXEC, b"x" * 20)]))  # not whole instructions


def test_nvdisasm_target_names():
    from fagen.compiler.sass import nvdisasm_target

    assert [nvdisasm_target(a) for a in ("sm_80", "sm_90a", "sm_100f", "sm_120")] == [
        "SM80", "SM90a", "SM100f", "SM120"]
    with pytest.raises(ValueError):
        nvdisasm_target("compute_90a")


def _fake_nvdisasm(monkeypatch, listing: str, returncode: int = 0):
    import types

    from fagen.compiler import sass

    calls = []

    def run(args, **kwargs):
        calls.append(args)
        return types.SimpleNamespace(returncode=returncode, stdout=listing, stderr="")

    monkeypatch.setattr(sass, "nvdisasm_path", lambda: sass.Path("/fake/nvdisasm"))
    monkeypatch.setattr(sass.subprocess, "run", run)
    monkeypatch.setattr(sass, "sass_families", lambda cubin: frozenset({"FALLBACK"}))
    return calls


def _line(offset: int, text: str) -> str:
    return f"        /*{offset:04x}*/                   {text} ;\n"


def test_one_nvdisasm_reads_many_cubins(monkeypatch):
    from fagen.compiler.sass import sass_families_of

    # Kernel 0: two code sections of 2 and 1 instructions; kernel 1: one of 2.
    cubins = [_elf([(EXEC, b"\0" * 32), (EXEC, b"\0" * 16)]), _elf([(EXEC, b"\0" * 32)])]
    listing = ('\t.headerflags\t@"EF_CUDA_SM90"\n' + _line(0x00, "HGMMA.64x128x16.F32 R0, gdesc[UR4]")
               + _line(0x10, "@!P0 EXIT") + _line(0x20, "BRA 0x20") + _line(0x30, "@UP1 LDSM.16.M88.4 R8, [R2]")
               + _line(0x40, "STL [R1], R0"))
    calls = _fake_nvdisasm(monkeypatch, listing)
    assert sass_families_of(cubins, "sm_90a") == [{"HGMMA", "EXIT", "BRA"}, {"LDSM", "STL"}]
    assert len(calls) == 1 and calls[0][1:3] == ["-b", "SM90a"]


@pytest.mark.parametrize("listing, returncode", [
    (_line(0x00, "EXIT") + _line(0x20, "EXIT"), 0),  # a gap
    (_line(0x00, "EXIT"), 0),  # fewer instructions than the code holds
    (_line(0x00, "EXIT") + _line(0x10, "EXIT"), 1),  # nvdisasm failed
])
def test_a_listing_that_misses_code_falls_back_to_cuobjdump(monkeypatch, listing, returncode):
    from fagen.compiler.sass import sass_families_of

    _fake_nvdisasm(monkeypatch, listing, returncode)
    assert sass_families_of([_elf([(EXEC, b"\0" * 32)])], "sm_80") == [{"FALLBACK"}]
