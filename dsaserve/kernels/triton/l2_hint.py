"""cp.async with an L2 eviction policy and a 256-byte L2 prefetch, for Gluon kernels that ask.

FlashMLA's sparse prefill gathers its KV rows with `cp.async … .L2::cache_hint` under an
evict_last policy and a 256-byte L2 prefetch: neighbouring query rows select mostly the same
cache rows, so keeping them in L2 raises its hit rate, and a 1,152-byte row comes in fewer DRAM
requests. Triton 3.6 drops `eviction_policy` on Gluon's `async_copy_global_to_shared` (its PTX
is a plain `cp.async.cg.shared.global`), and Gluon has no way to say either qualifier.

So this module rewrites the PTX between Triton's "ptx" and "cubin" stages (Triton's
`knobs.runtime.add_stages_inspection_hook`), for kernels that carry MARKER in their PTX (`mark`,
an identity inline-asm on an integer tensor whose comment is the marker): every 16-byte
`cp.async.cg.shared.global` of such a kernel gets `.L2::cache_hint.L2::256B` and one policy
register, made once at the kernel's entry by `createpolicy.fractional.L2::evict_last`. The
marker also makes such a kernel's source, hence its Triton cache key, differ from the same kernel
without it. Other kernels pass through untouched. `install()` chains any hook set before;
sparse_mla_gluon.py calls it once, when it is imported.
"""

from __future__ import annotations

import re

MARKER = "dsaserve.l2_evict_last"
POLICY = "%dsaserve_l2_policy"

_CP_ASYNC = re.compile(
    r"cp\.async\.cg\.shared\.global\s+(\[[^\]]*\]),\s*(\[[^\]]*\]),\s*(0x10|16),\s*([^;,]+);")
_ENTRY = re.compile(r"\.entry\s+\w+\s*\(.*?\)[^{]*\{\n((?:\s*\.reg [^\n]*\n)*)", re.S)


def rewrite_ptx(ptx: str) -> str:
    """The PTX with the L2 policy and prefetch size on every 16-byte cp.async, if it carries
    MARKER (else unchanged). Raises ValueError if a marked PTX has no such copy or no entry
    whose register declarations the policy can join."""
    if MARKER not in ptx:
        return ptx
    rewritten, copies = _CP_ASYNC.subn(
        lambda m: (f"cp.async.cg.shared.global.L2::cache_hint.L2::256B {m[1]}, {m[2]}, {m[3]}, "
                   f"{m[4].strip()}, {POLICY};"), ptx)
    entry = _ENTRY.search(rewritten)
    if copies == 0 or entry is None:
        raise ValueError(f"l2_hint: a kernel marked {MARKER} has {copies} 16-byte cp.async and "
                         f"{'an' if entry else 'no'} entry to declare the policy in")
    at = entry.end(1)
    policy = (f"\t.reg .b64 \t{POLICY};\n"
              f"\tcreatepolicy.fractional.L2::evict_last.b64 \t{POLICY}, 1.0;\n")
    return rewritten[:at] + policy + rewritten[at:]


def _stages_hook(previous):
    def hook(backend, stages, options, language, capability):
        if previous is not None:
            previous(backend, stages, options, language, capability)
        make_ptx = stages.get("ptx")
        if make_ptx is not None:
            stages["ptx"] = lambda src, metadata: rewrite_ptx(make_ptx(src, metadata))
    hook.dsaserve_l2_hint = True
    return hook


def install() -> None:
    """Puts the rewrite into Triton's compile pipeline (once; idempotent)."""
    from triton import knobs

    current = knobs.runtime.add_stages_inspection_hook
    if not getattr(current, "dsaserve_l2_hint", False):
        knobs.runtime.add_stages_inspection_hook = _stages_hook(current)
