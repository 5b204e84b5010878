"""Registers, spills and ptxas notes of the CUDA kernels, built for sm_90a on any machine.

    python benchmarks/cuda_resources.py [--check] [--sass] [--nvcc PATH]

Compiles each source of dsaserve/kernels/cuda as the GPU build does (cuda/build.py: the same
sources and Hopper arch flag, torch's nvcc flags) with ptxas's resource report (-Xptxas -v), no
GPU needed, and prints one row per kernel instance: registers per thread, stack frame and spill
bytes, and any ptxas performance note. docs/kernels.md quotes these.

nvcc: --nvcc, else $NVCC, else the one the PyPI wheels install (nvidia-cuda-nvcc, -crt,
-runtime, -cccl and nvidia-nvvm, in the [test] extra, pinned to the GPU machine's CUDA 13.0),
else nvcc on PATH.

--sass also disassembles each build (cuobjdump, Triton's copy) and prints, per kernel instance
with tensor-core instructions, its MMA loop: the shortest loop (a backward branch) holding
wgmma instructions, as SASS instructions per iteration and per MMA group of four (a page of
the indexer logits), and the most frequent opcodes: the counts docs/kernels.md quotes.

--check exits with status 1 if an instance spills more than ALLOWED_SPILL grants it, or ptxas
notes a serialized wgmma pipeline (C7514 / C7515: an "info" line, not a warning, which made
every wgmma of a kernel wait for the previous one before it was seen); the CPU test suite runs
it (tests/unit/test_sm90_builds.py), so a change to a .cu file that breaks the build, spills
or serializes the tensor cores fails CI without a GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

from torch.utils import cpp_extension

from dsaserve.kernels.cuda import build

# Spill bytes an instance may have (a mangled-name fragment → bytes); any other spill fails
# --check. topk_rows_kernel<1024, 1, Index>: one 1,024-thread block per row, 64 registers, the
# instance with the most code (docs/kernels.md, static analysis).
ALLOWED_SPILL = {"topk_rows_kernelILi1024ELi1E": 16}
PERF_NOTE = re.compile(r"\(C751[45]\)")


@dataclasses.dataclass
class Instance:
    source: str
    mangled: str
    registers: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)

    def allowed_spill(self) -> int:
        return max((b for k, b in ALLOWED_SPILL.items() if k in self.mangled), default=0)


def find_nvcc(given: str | None) -> str | None:
    """nvcc from --nvcc, $NVCC, the PyPI wheels (site-packages/nvidia/cu13/bin) or PATH."""
    if given or os.environ.get("NVCC"):
        return given or os.environ["NVCC"]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        nvcc = pathlib.Path(root) / "cu13" / "bin" / "nvcc"
        if nvcc.is_file():
            return str(nvcc)
    return shutil.which("nvcc")


def nvcc_command(nvcc: str, source: pathlib.Path, out: pathlib.Path,
                 stub: pathlib.Path) -> list[str]:
    cuda = pathlib.Path(nvcc).resolve().parents[1]  # …/cu13 of the wheels, or a CUDA_HOME
    includes = [*cpp_extension.include_paths(), str(stub), str(cuda / "include"),
                str(cuda / "include" / "cccl")]
    return [nvcc, "-std=c++20", "-O3", build.arch_flag(9, 0), *cpp_extension.COMMON_NVCC_FLAGS,
            *(f"-I{i}" for i in includes), "-Xptxas", "-v", "-c", str(source), "-o", str(out)]


def parse(source: str, report: str) -> list[Instance]:
    """ptxas's -v lines → one Instance per compiled kernel."""
    found: dict[str, Instance] = {}
    current: Instance | None = None
    for line in report.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            current = found.setdefault(m.group(1), Instance(source, m.group(1)))
        elif m := re.search(r"Function properties for (\w+)", line):
            current = found.setdefault(m.group(1), Instance(source, m.group(1)))
        elif current is not None and (m := re.search(
                r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                line)):
            current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif current is not None and (m := re.search(r"Used (\d+) registers", line)):
            current.registers = int(m.group(1))
        if PERF_NOTE.search(line):  # it names its kernel, which may not have been compiled yet
            m = re.search(r"function '(\w+)'", line)
            owner = found.setdefault(m.group(1), Instance(source, m.group(1))) if m else \
                current or found.setdefault("?", Instance(source, "?"))
            owner.notes.append(line.split("info    :")[-1].strip())
    return list(found.values())


def demangle(names: list[str]) -> list[str]:
    """Readable kernel names (c++filt where there is one), without their parameter lists."""
    if shutil.which("c++filt") is None:
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return [re.sub(r"^void |\(anonymous namespace\)::|\(.*$", "", n) for n in out]


@dataclasses.dataclass
class MmaLoop:
    mangled: str
    instructions: int  # per iteration
    mma: int  # wgmma (QGMMA / HGMMA) instructions per iteration
    opcodes: dict[str, int]


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*;")


def mma_loops(sass: str) -> list[MmaLoop]:
    """cuobjdump -sass text → per function, its shortest loop holding wgmma (Q/HGMMA)
    instructions: a backward BRA's target up to the branch."""
    found = []
    for part in re.split(r"(?:^|\n)\s*Function : ", sass)[1:]:
        mangled = part.split()[0]
        code = [(int(m[1], 16), m[2], m[0]) for m in _SASS_LINE.finditer(part)]
        best = None
        for addr, op, text in code:
            target = re.search(r"BRA\s+(?:`\(\.L_\w+\)\s*)?0x([0-9a-f]+)", text) \
                if op == "BRA" else None
            if target is None or int(target[1], 16) >= addr:
                continue
            body = [o for a, o, _ in code if int(target[1], 16) <= a <= addr]
            mma = sum(o in ("QGMMA", "HGMMA") for o in body)
            if mma and (best is None or len(body) < best.instructions):
                counts: dict[str, int] = {}
                for o in body:
                    counts[o] = counts.get(o, 0) + 1
                best = MmaLoop(mangled, len(body), mma, counts)
        if best is not None:
            found.append(best)
    return found


def disassemble(obj: pathlib.Path) -> str:
    """cuobjdump -sass of a built object, with the cuobjdump Triton ships."""
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        raise SystemExit("--sass needs triton (its cuobjdump)")
    cuobjdump = pathlib.Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(cuobjdump), "-sass", str(obj)], capture_output=True, text=True,
                          check=True).stdout


def compile_one(nvcc: str, source: pathlib.Path, tmp: pathlib.Path) -> list[Instance]:
    cmd = nvcc_command(nvcc, source, tmp / f"{source.stem}.o", tmp)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{source.name} did not build:\n{done.stderr[-4000:]}")
    return parse(source.name, done.stdout + done.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 on a spill beyond ALLOWED_SPILL or a ptxas note")
    parser.add_argument("--sass", action="store_true",
                        help="also print each instance's MMA loop (SASS instructions per "
                             "iteration; needs triton's cuobjdump)")
    parser.add_argument("--nvcc", default=None, help="the nvcc to use")
    args = parser.parse_args()
    nvcc = find_nvcc(args.nvcc)
    if nvcc is None:
        print("nvcc not found (pip install the [test] extra, or pass --nvcc)")
        return 2
    with tempfile.TemporaryDirectory() as d:
        tmp = pathlib.Path(d)
        # CPU builds of torch leave out this generated header, which c10/cuda includes.
        (tmp / "c10" / "cuda" / "impl").mkdir(parents=True)
        (tmp / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text("#pragma once\n")
        with concurrent.futures.ThreadPoolExecutor(len(build.SOURCES)) as pool:
            per_source = list(pool.map(lambda s: compile_one(nvcc, s, tmp), build.SOURCES))
        loops = [loop for source in build.SOURCES
                 for loop in mma_loops(disassemble(tmp / f"{source.stem}.o"))] \
            if args.sass else []
    instances = [i for found in per_source for i in found]
    names = demangle([i.mangled for i in instances])
    print(f"nvcc: {nvcc}\n")
    print("| source | kernel | registers | stack (B) | spill stores / loads (B) | notes |")
    print("|---|---|---:|---:|---:|---|")
    failures = []
    for inst, name in zip(instances, names, strict=True):
        print(f"| {inst.source} | {name} | {inst.registers} | {inst.stack} | "
              f"{inst.spill_stores} / {inst.spill_loads} | {'; '.join(inst.notes)} |")
        if inst.spill_stores > inst.allowed_spill() or inst.notes:
            failures.append(name)
    if loops:
        print("\n| kernel | MMA loop: SASS instructions per iteration | wgmma | per 4 wgmma "
              "| most frequent |\n|---|---:|---:|---:|---|")
        for loop, name in zip(loops, demangle([loop.mangled for loop in loops]), strict=True):
            top = sorted(loop.opcodes.items(), key=lambda kv: -kv[1])[:6]
            print(f"| {name} | {loop.instructions} | {loop.mma} | "
                  f"{loop.instructions * 4 / loop.mma:.0f} | "
                  f"{', '.join(f'{op} {n}' for op, n in top)} |")
    if args.check and failures:
        print(f"\nnot clean: {', '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
