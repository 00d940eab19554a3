"""Compile every kernel with nvcc for the CI architectures, warnings (and spills) as errors.

Usage: ``python -m astrai_backend_cuda.compile_check [--arch 80 --arch 90] [--no-bindings] [-j N]``

Each ``.cu`` file is compiled standalone (no torch header) for every architecture with
torch's own defines plus ``-Werror`` for the host compiler, nvcc and ptxas, which also
rejects register spills and local memory. ``bindings.cpp`` gets a syntax check with the
host compiler against torch's and CUDA's headers (a CPU-only torch wheel ships the
``c10/cuda`` headers but not the generated ``cuda_cmake_macros.h``, which is stubbed).
No GPU is needed. Exit status 0 when everything compiles cleanly, 1 on any failure,
2 when nvcc is not found.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from astrai_backend_cuda import _sources


def nvcc_command(source: Path, archs: list[str], output: Path) -> list[str]:
    """The strict nvcc command line for one kernel file."""
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    return [
        "nvcc",
        "-c",
        *_sources.NVCC_FLAGS,
        *_sources.NVCC_STRICT_FLAGS,
        *gencode,
        str(source),
        "-o",
        str(output),
    ]


def _cuda_includes() -> list[str]:
    """The include dirs nvcc itself uses (from its dry run: works for wrapper scripts too)."""
    proc = subprocess.run(["nvcc", "--dryrun", "-c", "x.cu"], capture_output=True, text=True)
    dirs = []
    for line in proc.stderr.splitlines():
        if "INCLUDES=" in line:
            dirs += re.findall(r'(?:-I|"-isystem" )"?([^"\s]+)"?', line.split("=", 1)[1])
    return dirs


def bindings_command(stub_dir: Path) -> list[str]:
    """A host-compiler syntax check of bindings.cpp against torch's headers (torch's include dirs as
    system dirs)."""
    from torch.utils.cpp_extension import include_paths

    system = [str(stub_dir), *include_paths(), *_cuda_includes(), sysconfig.get_paths()["include"]]
    return [
        os.environ.get("CXX", "g++"),
        "-fsyntax-only",
        "-std=c++20",
        "-Wall",
        "-Wextra",
        "-Werror",
        *(f for d in system for f in ("-isystem", d)),
        str(_sources.CSRC / _sources.BINDINGS),
    ]


def _stub_cmake_macros(stub_dir: Path) -> None:
    header = stub_dir / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    header.parent.mkdir(parents=True, exist_ok=True)
    header.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")


def _run(name: str, cmd: list[str]) -> tuple[str, bool, str, float]:
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    text = (proc.stdout + proc.stderr).strip()
    return name, proc.returncode == 0 and not text, text, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    """Run the checks, print one line per compile (and any compiler output); returns the exit status."""
    ap = argparse.ArgumentParser(
        prog="python -m astrai_backend_cuda.compile_check", description=__doc__.split("\n")[0]
    )
    ap.add_argument(
        "--arch", action="append", help="SM architecture, e.g. 90 (repeatable; default 80 and 90)"
    )
    ap.add_argument("--no-bindings", action="store_true", help="skip the bindings.cpp syntax check")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    args = ap.parse_args(argv)
    if shutil.which("nvcc") is None:
        print("compile_check: nvcc not found on PATH", file=sys.stderr)
        return 2
    archs = args.arch or list(_sources.CI_ARCHS)
    with tempfile.TemporaryDirectory(prefix="astrai-compile-check-") as tmp:
        out = Path(tmp)
        jobs = [
            (f"{src.name} (sm_{', sm_'.join(archs)})", nvcc_command(src, archs, out / f"{src.stem}.o"))
            for src in _sources.kernel_paths()
        ]
        if not args.no_bindings:
            _stub_cmake_macros(out / "stub")
            jobs.append((f"{_sources.BINDINGS} (syntax, torch headers)", bindings_command(out / "stub")))
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results = list(pool.map(lambda job: _run(*job), jobs))
    for name, ok, text, seconds in results:
        print(f"{'ok  ' if ok else 'FAIL'} {name} [{seconds:.1f}s]")
        if text:
            print(text)
    return 0 if all(ok for _, ok, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
