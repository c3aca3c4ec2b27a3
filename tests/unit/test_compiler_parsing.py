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
