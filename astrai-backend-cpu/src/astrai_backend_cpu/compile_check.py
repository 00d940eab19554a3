"""Compile the CPU kernels for an instruction set this machine may lack: AVX512-BF16 by default.

Usage: ``python -m astrai_backend_cpu.compile_check [--march sapphirerapids] [-j N] [--syntax-only] [SOURCE ...]``

The kernels' AVX512-BF16 code (the prefill kernel, the bf16 GEMM and quantized linears, the bf16
paths of paged decode) sits behind ``#if defined(__AVX512BF16__)``: the just-in-time build
(``build.py``, ``-march=native``) compiles it only on a CPU that has the instructions. Here each
source (default: every source of the build) is compiled, not linked, with ``build.py``'s flags and
``-march=<target>`` in place of ``-march=native``, against torch's headers, as that build would on
such a CPU: a change to that code is at least compiled on any machine. Nothing runs. Exit status 0
when every source compiles, 1 on a failure, 2 when the compiler does not know the target or the
target lacks AVX512-BF16. ``--syntax-only`` stops after the compiler's semantic checks (``-fsyntax-only``):
the code's types and the target's intrinsics are checked as in the build, in a fraction of the time;
what code generation alone reports (an intrinsic inlined into a function of another target) is not.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from astrai_backend_cpu.build import CXX_FLAGS, EXTENSION_NAME, SOURCES

#: A target with AVX512-BF16 (and AMX) that GCC >= 11 and Clang >= 12 know.
DEFAULT_MARCH = "sapphirerapids"


def compiler() -> str:
    """The C++ compiler ``build.py``'s build uses (``$CXX``, else ``c++``)."""
    return os.environ.get("CXX", "c++")


def target_macros(march: str) -> set[str] | None:
    """The macros the compiler predefines for ``-march=march``; None when it does not know the target."""
    proc = subprocess.run(
        [compiler(), f"-march={march}", "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True
    )
    if proc.returncode:
        return None
    return {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("#define ")}


def avx512_sources() -> list[Path]:
    """The sources with code for AVX-512 targets only (``#if defined(__AVX512...``)."""
    return [src for src in SOURCES if "__AVX512" in src.read_text()]


def compile_command(source: Path, march: str, output: Path, syntax_only: bool = False) -> list[str]:
    """The compile of one source as ``build.py``'s JIT build runs it, for ``-march=march``
    (``syntax_only``: its checks only, no code)."""
    from torch.utils.cpp_extension import include_paths

    flags = [f"-march={march}" if f == "-march=native" else f for f in CXX_FLAGS]
    if syntax_only:
        flags = [*flags, "-fsyntax-only"]
    system = [*include_paths(), sysconfig.get_paths()["include"]]
    return [
        compiler(),
        f"-DTORCH_EXTENSION_NAME={EXTENSION_NAME}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(f for d in system for f in ("-isystem", d)),
        "-fPIC",
        "-std=c++20",  # as torch.utils.cpp_extension's build of this torch
        *flags,
        "-c",
        str(source),
        *(() if syntax_only else ("-o", str(output))),
    ]


def _run(name: str, cmd: list[str]) -> tuple[str, bool, str, float]:
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return name, proc.returncode == 0, (proc.stdout + proc.stderr).strip(), time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    """Compile, print one line per source (and the compiler's output of a failure); returns the exit status."""
    ap = argparse.ArgumentParser(
        prog="python -m astrai_backend_cpu.compile_check", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--march", default=DEFAULT_MARCH, help=f"target CPU (default {DEFAULT_MARCH})")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    ap.add_argument("--syntax-only", action="store_true", help="the compiler's checks only, no code")
    ap.add_argument("sources", nargs="*", help="source file names (default: every source of the build)")
    args = ap.parse_args(argv)
    macros = target_macros(args.march)
    if macros is None:
        print(f"compile_check: {compiler()} does not know -march={args.march}", file=sys.stderr)
        return 2
    if "__AVX512BF16__" not in macros:
        print(f"compile_check: -march={args.march} has no AVX512-BF16", file=sys.stderr)
        return 2
    by_name = {src.name: src for src in SOURCES}
    unknown = [name for name in args.sources if name not in by_name]
    if unknown:
        ap.error(f"not a source of the build: {', '.join(unknown)} (sources: {', '.join(by_name)})")
    sources = [by_name[name] for name in args.sources] or SOURCES
    with tempfile.TemporaryDirectory(prefix="astrai-cpu-compile-check-") as tmp:
        jobs = [
            (
                f"{src.name} (-march={args.march})",
                compile_command(src, args.march, Path(tmp) / f"{src.stem}.o", args.syntax_only),
            )
            for src in sources
        ]
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results = list(pool.map(lambda job: _run(*job), jobs))
    for name, ok, text, seconds in results:
        print(f"{'ok  ' if ok else 'FAIL'} {name} [{seconds:.1f}s]")
        if text:
            print(text)
    return 0 if all(ok for _, ok, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
