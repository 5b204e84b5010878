"""l2_hint on PTX and SASS text (no GPU, no triton import: the functions tested only edit and
read strings): kernels without a marker pass through; a marked kernel's 16-byte cp.async gain
its mode's qualifiers (PREFETCH: the 256-byte L2 prefetch; EVICT_LAST: that, and on the masked
copies the policy, made once after the entry's register declarations); undefined_descriptors
finds the copies whose cache descriptor no instruction sets. tests/unit/test_sm90_builds.py
builds the Gluon kernels with the marks for sm_90 and checks what ptxas makes of them."""

from __future__ import annotations

import pytest

from dsaserve.kernels.triton import l2_hint

PTX = """//
.visible .entry k(
\t.param .u64 k_param_0
)
.reqntid 384
{
\t.reg .pred \t%p<4>;
\t.reg .b32 \t%r<9>;
\t.reg .b64 \t%rd<5>;
\tmov.u32 \t%r1, %tid.x;
MARK
\tcp.async.cg.shared.global [ %r2 + 0 ], [ %rd1 + 0 ], 0x10, %r3;
\tcp.async.cg.shared.global [ %r4 + 0 ], [ %rd2 + 0 ], 0x10, 0x10;
\tcp.async.commit_group;
\tret;
}
"""


def _marked(mode: str) -> str:
    return PTX.replace("MARK", "\t" + l2_hint.mark_asm(mode).replace("$0, $1", "%r5, %r6"))


def _copies(ptx: str) -> list[str]:
    return [line.strip() for line in ptx.splitlines() if "cp.async.cg" in line]


def test_unmarked_kernels_pass_through():
    ptx = PTX.replace("MARK", "")
    assert l2_hint.rewrite_ptx(ptx) is ptx
    assert l2_hint.mark_asm(l2_hint.PLAIN) == ""


def test_prefetch_mode_adds_the_prefetch_size_only():
    out = l2_hint.rewrite_ptx(_marked(l2_hint.PREFETCH))
    assert _copies(out) == [
        "cp.async.cg.shared.global.L2::256B [ %r2 + 0 ], [ %rd1 + 0 ], 0x10, %r3;",
        "cp.async.cg.shared.global.L2::256B [ %r4 + 0 ], [ %rd2 + 0 ], 0x10, 0x10;",
    ]
    assert "createpolicy" not in out and l2_hint.POLICY not in out


def test_evict_last_mode_adds_the_policy():
    out = l2_hint.rewrite_ptx(_marked(l2_hint.EVICT_LAST))
    assert _copies(out) == [  # the masked copy (a gathered row) only: see l2_hint
        f"cp.async.cg.shared.global.L2::cache_hint.L2::256B [ %r2 + 0 ], [ %rd1 + 0 ], 0x10, "
        f"%r3, {l2_hint.POLICY};",
        "cp.async.cg.shared.global.L2::256B [ %r4 + 0 ], [ %rd2 + 0 ], 0x10, 0x10;",
    ]
    lines = [line.strip() for line in out.splitlines()]
    at = lines.index(f".reg .b64 \t{l2_hint.POLICY};")
    assert lines[at - 1].startswith(".reg .b64 \t%rd<5>")  # after the entry's declarations
    assert lines[at + 1] == \
        f"createpolicy.fractional.L2::evict_last.b64 \t{l2_hint.POLICY}, 1.0;"
    assert lines[at + 2].startswith("mov.u32")
    assert "cp.async.commit_group;" in lines


def test_bad_marks_are_errors():
    ptx = _marked(l2_hint.PREFETCH).replace("cp.async.cg", "ld.global")
    with pytest.raises(ValueError, match="cp.async"):
        l2_hint.rewrite_ptx(ptx)
    with pytest.raises(ValueError, match="mode 'evict_first'"):
        l2_hint.rewrite_ptx(PTX.replace("MARK", "// dsaserve.l2_hint.v2:evict_first"))
    with pytest.raises(ValueError, match="mode"):
        l2_hint.mark_asm("L2::256B")


# Two copies as ptxas 12.8 / 13.0 compiles the ping-pong kernel's Q copies under a policy
# (cuobjdump -sass, shortened): no instruction writes UR0 or UR1, so the descriptor is
# garbage and the copy traps. The PREFETCH build reads the descriptor ULDC.64 loaded.
SASS_DROPPED = """
        /*0020*/   ULDC.64 UR32, c[0x0][0x208] ;
        /*6390*/   UMOV UR6, UR30 ;
        /*6460*/   LDGSTS.E.BYPASS.LTC256B.128 [R29+UR0+0x20000], desc[UR1][R12.64] ;
        /*64a0*/   LDGSTS.E.BYPASS.LTC256B.128 [R29+UR0+0x22000], desc[UR1][R12.64+0x80] ;
"""
SASS_KEPT = """
        /*0020*/   ULDC.64 UR32, c[0x0][0x208] ;
        /*00c0*/   @!UP0 UMOV UR4, URZ ;
        /*6400*/   LDGSTS.E.BYPASS.LTC256B.128 [R25+0x20000], desc[UR32][R12.64] ;
        /*6410*/   LDGSTS.E.BYPASS.LTC256B.128 [R7], desc[UR4][R2.64] ;
        /*01b0*/   STG.E desc[UR32][R2.64], R9 ;
"""


def test_undefined_descriptors():
    assert [line.split()[0] for line in l2_hint.undefined_descriptors(SASS_DROPPED)] == \
        ["/*6460*/", "/*64a0*/"]
    assert l2_hint.undefined_descriptors(SASS_KEPT) == []
