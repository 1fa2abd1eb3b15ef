"""A kernel source that stands alone, built with other flags than the library's (the AVX2 build
on a CPU with AVX-512, the baseline ISA's plain loops), for tests of the builds this CPU does not
load. Skips the test where no C compiler is found."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

AVX2 = ["-march=native", "-mno-avx512f"]  # this CPU without AVX-512
PORTABLE: list[str] = []  # the baseline ISA


def build_variant(source: Path, flags: list[str], tmp_path_factory, name: str) -> ctypes.CDLL:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    if "-mno-avx512f" in flags and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("not an x86 CPU")
    target = tmp_path_factory.mktemp(name) / f"{source.stem}.so"
    command = [compiler, "-O2", *flags, "-fopenmp", "-fPIC", "-shared", str(source)]
    subprocess.run([*command, "-o", str(target), "-lm"], check=True)
    return ctypes.CDLL(str(target))
