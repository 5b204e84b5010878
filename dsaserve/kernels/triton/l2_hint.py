"""cp.async with a 256-byte L2 prefetch, and optionally an L2 evict_last policy, for Gluon kernels
that ask.

FlashMLA's sparse prefill gathers its KV rows with `cp.async … .L2::cache_hint.L2::256B` under
an evict_last policy: neighbouring query rows select mostly the same cache rows, so keeping them
in L2 raises its hit rate, and a 1,152-byte row comes in fewer DRAM requests. Triton 3.6 drops
`eviction_policy` on Gluon's `async_copy_global_to_shared` (its PTX is a plain
`cp.async.cg.shared.global`), and Gluon has no way to say either qualifier.

So this module rewrites the PTX between Triton's "ptx" and "cubin" stages (Triton's
`knobs.runtime.add_stages_inspection_hook`), for kernels that carry one of its markers in their
PTX (`mark_asm(mode)`: an identity inline asm whose comment is the marker). Every 16-byte
`cp.async.cg.shared.global` of such a kernel gets `.L2::256B`, and with EVICT_LAST the masked
ones (a register src-size: the gathered cache rows, zero-filled where the index is −1) also
`.L2::cache_hint` under one policy register, made once at the kernel's entry by
`createpolicy.fractional.L2::evict_last`.

Why only the masked copies: the unmasked ones are the kernels' Q tiles, read once, and the
ptxas of Triton 3.6 (12.8) and of CUDA 13.0 miscompiles them under a policy. Those copies
address shared memory as a uniform base plus a per-thread offset, and ptxas drops the policy
there: the copies read an unset uniform register as their cache descriptor and trap at run
time (illegal instruction; the known ptxas miscompile of fractional policies on cp.async,
fixed in ptxas 13.4). benchmarks/sm90_resources.py --check finds such builds
(`undefined_descriptors` on their SASS; CI runs it), and the rewrite refuses them when it
compiles one (`check_cubin`: a RuntimeError naming PREFETCH instead of a trap).

The marker also makes a marked kernel's source, hence its Triton cache key, differ from the
same kernel without it, and it names this rewrite's version, so that a changed rewrite is not
served from an old cache. Other kernels pass through untouched. `install()` chains any hook set
before; sparse_mla_gluon.py calls it once, when it is imported.
"""

from __future__ import annotations

import re

PLAIN, PREFETCH, EVICT_LAST = "plain", "prefetch", "evict_last"
MODES = (PLAIN, PREFETCH, EVICT_LAST)
_MARKER = "dsaserve.l2_hint.v2:"
POLICY = "%dsaserve_l2_policy"

_CP_ASYNC = re.compile(
    r"cp\.async\.cg\.shared\.global\s+(\[[^\]]*\]),\s*(\[[^\]]*\]),\s*(0x10|16),\s*([^;,]+);")
_ENTRY = re.compile(r"\.entry\s+\w+\s*\(.*?\)[^{]*\{\n((?:\s*\.reg [^\n]*\n)*)", re.S)
_MARKED = re.compile(re.escape(_MARKER) + r"(\w+)")


def marker(mode: str) -> str:
    """The text a kernel's PTX carries to have its copies rewritten in `mode`."""
    if mode not in (PREFETCH, EVICT_LAST):
        raise ValueError(f"l2_hint: mode {mode!r} is not one of {PREFETCH!r}, {EVICT_LAST!r}")
    return _MARKER + mode


def mark_asm(mode: str) -> str:
    """The inline asm (`=r,r`, an identity move) that puts marker(mode) into a kernel's PTX;
    "" for PLAIN (nothing to mark)."""
    return "" if mode == PLAIN else f"mov.b32 $0, $1; // {marker(mode)}"


def rewrite_ptx(ptx: str) -> str:
    """The PTX with its mode's qualifiers on its 16-byte cp.async, if it carries a marker
    (else unchanged). Raises ValueError for an unknown mode, or if a marked PTX has no such
    copy or (EVICT_LAST) no entry whose register declarations the policy can join."""
    found = _MARKED.search(ptx)
    if found is None:
        return ptx
    mode = found[1]
    marker(mode)  # a known mode
    policy = mode == EVICT_LAST

    def qualified(m: re.Match) -> str:
        src_size = m[4].strip()
        if policy and src_size.startswith("%"):  # masked: a gathered row
            return (f"cp.async.cg.shared.global.L2::cache_hint.L2::256B {m[1]}, {m[2]}, "
                    f"{m[3]}, {src_size}, {POLICY};")
        return f"cp.async.cg.shared.global.L2::256B {m[1]}, {m[2]}, {m[3]}, {src_size};"

    rewritten, copies = _CP_ASYNC.subn(qualified, ptx)
    entry = _ENTRY.search(rewritten)
    if copies == 0 or (policy and entry is None):
        raise ValueError(f"l2_hint: a kernel marked {marker(mode)} has {copies} 16-byte "
                         f"cp.async and {'an' if entry else 'no'} entry to declare a policy in")
    if not policy:
        return rewritten
    at = entry.end(1)
    made = (f"\t.reg .b64 \t{POLICY};\n"
            f"\tcreatepolicy.fractional.L2::evict_last.b64 \t{POLICY}, 1.0;\n")
    return rewritten[:at] + made + rewritten[at:]


_DESCRIPTOR = re.compile(r"desc\[UR(\d+)\]")
# An instruction whose first operand is a uniform register writes it (SASS puts the
# destination first; stores and copies start with a bracketed address instead).
_UNIFORM_DEST = re.compile(r"^\s*(?:@!?\w+\s+)?[A-Z][A-Z0-9_.]*\s+UR(\d+)\b")


def undefined_descriptors(sass: str) -> list[str]:
    """The SASS lines (cuobjdump -sass of one kernel) whose memory descriptor `desc[URn]` is a
    uniform register no instruction of the kernel writes: the ptxas miscompile described above.
    A 64-bit descriptor is the pair URn, URn+1, so either written counts."""
    written: set[int] = set()
    for line in sass.splitlines():
        body = line.split("*/", 1)[-1] if "*/" in line else line
        dest = _UNIFORM_DEST.match(body)
        if dest:
            first = int(dest[1])
            written.update((first, first + 1))  # .64 forms write a pair
    return [line.strip() for line in sass.splitlines()
            if any(int(n) not in written for n in _DESCRIPTOR.findall(line))]


def check_cubin(ptx: str, cubin: bytes) -> bytes:
    """cubin, if its PTX carries no EVICT_LAST marker or ptxas kept every copy's policy; else a
    RuntimeError (the kernel would trap at its first launch and take the CUDA context with it)."""
    if marker(EVICT_LAST) not in ptx:
        return cubin
    import subprocess
    import tempfile

    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    bad = undefined_descriptors(sass)
    if bad:
        raise RuntimeError(f"l2_hint: ptxas miscompiled the {EVICT_LAST!r} copies of this kernel "
                           f"({len(bad)} read an unset cache descriptor, e.g. {bad[0]!r}); "
                           f"use {PREFETCH!r}")
    return cubin


def _stages_hook(previous):
    def hook(backend, stages, options, language, capability):
        if previous is not None:
            previous(backend, stages, options, language, capability)
        make_ptx, make_cubin = stages.get("ptx"), stages.get("cubin")
        if make_ptx is not None:
            stages["ptx"] = lambda src, metadata: rewrite_ptx(make_ptx(src, metadata))
        if make_cubin is not None:
            stages["cubin"] = lambda src, metadata: check_cubin(src, make_cubin(src, metadata))
    hook.dsaserve_l2_hint = True
    return hook


def install() -> None:
    """Puts the rewrite into Triton's compile pipeline (once; idempotent)."""
    from triton import knobs

    current = knobs.runtime.add_stages_inspection_hook
    if not getattr(current, "dsaserve_l2_hint", False):
        knobs.runtime.add_stages_inspection_hook = _stages_hook(current)
