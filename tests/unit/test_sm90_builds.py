"""The Hopper kernels as the GPU builds them, checked on the CPU: no spills, shared memory
within an SM's, and no ptxas performance note. A wgmma pipeline that ptxas serializes is
reported as an "info" line, not an error, and cost the Gluon sparse MLA kernel 1.3x before it
was seen; this keeps it from coming back unseen. The Triton and Gluon kernels are built by
Triton's own ptxas (benchmarks/sm90_resources.py --check, in a subprocess: importing triton
here, outside its interpreter, would make tests/unit/test_triton_interpret.py skip itself), the
CUDA ones by nvcc from the [test] extra's wheels (benchmarks/cuda_resources.py --check), which
also catches a .cu change that no longer compiles."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The parts whose every build is clean (the plain Triton sparse MLA and indexer kernels have
# configurations that spill by design; docs/kernels.md lists them; so does the residency kernel
# at MTP sizes, docs/hisparse.md).
PARTS = ("sparse_mla_gluon,sparse_mla_pingpong,indexer_gluon,row_topk,writers,residency,fetch,moe,"
         "w8a8,sampling")
CUDA_RESOURCES = ROOT / "benchmarks" / "cuda_resources.py"


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    return env


def _cuda_resources():
    """benchmarks/cuda_resources.py as a module (registered first: its dataclass needs it)."""
    if "cuda_resources" not in sys.modules:
        spec = importlib.util.spec_from_file_location("cuda_resources", CUDA_RESOURCES)
        module = importlib.util.module_from_spec(spec)
        sys.modules["cuda_resources"] = module
        spec.loader.exec_module(module)
    return sys.modules["cuda_resources"]


# Not imported here (see above): only looked for.
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="needs triton (its ptxas builds for sm_90)")
def test_hopper_builds_are_clean():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sm90_resources.py"), "--only", PARTS,
         "--check"], capture_output=True, text=True, env=_env(), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("| sparse MLA Gluon") == 5  # the FP8 one also with l2_hint
    assert out.stdout.count("| sparse MLA ping-pong") == 2  # with and without l2_hint


EVICT_LAST_BUILDS = """
import sys
from benchmarks import sm90_resources
from dsaserve.kernels.triton import l2_hint
(build,) = sm90_resources.sparse_mla_pingpong_builds((l2_hint.EVICT_LAST,))
if sys.argv[1] == "everywhere":  # the policy on the Q copies too, as first written
    rewrite = l2_hint.rewrite_ptx
    l2_hint.rewrite_ptx = lambda ptx: rewrite(ptx).replace(
        ", 0x10, 0x10;", f", 0x10, 0x10, {l2_hint.POLICY};").replace(
        "global.L2::256B", "global.L2::cache_hint.L2::256B")
try:
    print("BUILT", sm90_resources.resources(build)["warnings"])
except RuntimeError as e:
    print("REFUSED", e)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="needs triton (its ptxas builds for sm_90)")
def test_evict_last_copies_never_build_a_trapping_kernel(tmp_path):
    """The ping-pong kernel with evict_last copies builds with every cache descriptor set.
    With the policy on its Q copies too, ptxas (12.8, Triton's) drops it there and the copies
    would trap (l2_hint's docstring): l2_hint refuses that cubin with an error that names the
    prefetch mode. (A ptxas without the bug builds it clean, which passes too.)"""
    out = {}
    for policy in ("gathered", "everywhere"):  # each with its own Triton cache (same source)
        env = {**_env(), "TRITON_CACHE_DIR": str(tmp_path / policy)}
        run = subprocess.run([sys.executable, "-c", EVICT_LAST_BUILDS, policy],
                             capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        out[policy] = run.stdout
    assert out["gathered"].startswith("BUILT []"), out["gathered"]
    refused = out["everywhere"].startswith("REFUSED") and "'prefetch'" in out["everywhere"]
    assert refused or out["everywhere"].startswith("BUILT []"), out["everywhere"]
    print(out["everywhere"][:200])


def test_cuda_builds_are_clean():
    if _cuda_resources().find_nvcc(None) is None:
        pytest.skip("needs nvcc (the [test] extra's CUDA wheels, or one on PATH)")
    out = subprocess.run([sys.executable, str(CUDA_RESOURCES), "--check"], capture_output=True,
                         text=True, env=_env(), timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # Every instance the launchers dispatch to: 5 launch shapes × 2 index types; 2 head counts ×
    # the 7 block shapes (indexer_logits.SHAPES).
    assert out.stdout.count("| topk_rows.cu |") == 10
    assert out.stdout.count("| indexer_logits.cu |") == 14


def test_ptxas_report_parsing():
    """The resource lines and a serialization note are attributed to their kernels."""
    report = """\
ptxas info    : Compiling entry function '_Z1av' for 'sm_90a'
ptxas info    : Function properties for _Z1av
    16 bytes stack frame, 12 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 16 bytes cumulative stack size
ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are \
serialized due to non wgmma instructions defining accumulator registers of a wgmma between \
start and end of the pipeline stage in the function '_Z1bv'
ptxas info    : Compiling entry function '_Z1bv' for 'sm_90a'
ptxas info    : Function properties for _Z1bv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
"""
    a, b = _cuda_resources().parse("x.cu", report)
    assert (a.mangled, a.registers, a.stack, a.spill_stores, a.spill_loads, a.notes) == \
        ("_Z1av", 64, 16, 12, 20, [])
    assert (b.mangled, b.registers, b.spill_stores) == ("_Z1bv", 168, 0)
    assert len(b.notes) == 1 and b.notes[0].startswith("(C7515)")


def test_mma_loop_parsing():
    """The shortest loop that holds wgmma instructions, by its backward branch."""
    sass = """\
        Function : _Z1kv
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT ;
        /*0020*/                   FFMA R2, |R24|, R3, R2 ;
        /*0030*/                   FMNMX R4, R24, RZ, !PT ;
        /*0040*/              @!P0 BRA 0x10 ;
        /*0050*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0060*/              @!P1 BRA 0x0 ;
        /*0070*/                   EXIT ;
        Function : _Z1nv
        /*0000*/                   FADD R1, R1, R2 ;
        /*0010*/              @!P0 BRA 0x0 ;
"""
    (loop,) = _cuda_resources().mma_loops(sass)
    assert (loop.mangled, loop.instructions, loop.mma) == ("_Z1kv", 4, 1)
    assert loop.opcodes == {"QGMMA": 1, "FFMA": 1, "FMNMX": 1, "BRA": 1}
