"""l2_hint.rewrite_ptx on PTX text (no GPU, no triton import: the module only edits strings):
kernels without the marker pass through; a marked kernel's 16-byte cp.async gain the L2 policy
and the 256-byte prefetch, with the policy made once after the entry's register declarations.
tests/unit/test_sm90_builds.py builds the ping-pong kernel both ways for sm_90 and checks that
ptxas takes the result."""

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


def test_unmarked_kernels_pass_through():
    ptx = PTX.replace("MARK", "")
    assert l2_hint.rewrite_ptx(ptx) is ptx


def test_marked_kernel_copies_get_the_policy():
    out = l2_hint.rewrite_ptx(PTX.replace("MARK", f"\t// {l2_hint.MARKER}"))
    hinted = [line.strip() for line in out.splitlines() if "cp.async.cg" in line]
    assert hinted == [
        f"cp.async.cg.shared.global.L2::cache_hint.L2::256B [ %r2 + 0 ], [ %rd1 + 0 ], 0x10, "
        f"%r3, {l2_hint.POLICY};",
        f"cp.async.cg.shared.global.L2::cache_hint.L2::256B [ %r4 + 0 ], [ %rd2 + 0 ], 0x10, "
        f"0x10, {l2_hint.POLICY};",
    ]
    lines = [line.strip() for line in out.splitlines()]
    at = lines.index(f".reg .b64 \t{l2_hint.POLICY};")
    assert lines[at - 1].startswith(".reg .b64 \t%rd<5>")  # after the entry's declarations
    assert lines[at + 1] == \
        f"createpolicy.fractional.L2::evict_last.b64 \t{l2_hint.POLICY}, 1.0;"
    assert lines[at + 2].startswith("mov.u32")
    assert "cp.async.commit_group;" in lines


def test_marked_kernel_without_copies_is_an_error():
    ptx = PTX.replace("MARK", f"// {l2_hint.MARKER}").replace("cp.async.cg", "ld.global")
    with pytest.raises(ValueError, match="cp.async"):
        l2_hint.rewrite_ptx(ptx)
