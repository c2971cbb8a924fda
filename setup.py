"""Build: setuptools' build_ext drives CMake (Ninja), which builds orca_ext._C against the installed
torch. Use `pip install --no-build-isolation .` so the build sees *your* torch (CPU or CUDA).

Environment knobs: ORCA_CUDA=0/1 (default: use nvcc when found), ORCA_CUDA_ARCHS (CUDA
architectures, default "90a;80"), ORCA_CPU_ARCH (-march for the CPU kernels), ORCA_BUILD_DIR (CMake
build folder, default build/cmake-<python tag>), ORCA_BUILD_BENCHMARKS=0 (build only the module,
not the microbenchmarks), MAX_JOBS.

CMakeLists.txt asks this interpreter for everything it needs from torch; the module target is built
first, so a microbenchmark that fails to build never costs the module.
"""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import torch  # noqa: F401  # the build needs the torch it will run with (--no-build-isolation)

        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        tag = sysconfig.get_config_var("SOABI") or f"py{sys.version_info.major}{sys.version_info.minor}"
        build_dir = Path(os.environ.get("ORCA_BUILD_DIR", ROOT / "build" / f"cmake-{tag}")).resolve()
        build_dir.mkdir(parents=True, exist_ok=True)

        cuda = {"0": "OFF", "1": "ON"}.get(os.environ.get("ORCA_CUDA", ""), "AUTO")
        args = [
            "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={'Debug' if self.debug else 'Release'}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DORCA_OUTPUT_DIR={out_dir}",
            f"-DORCA_CUDA={cuda}",
        ]
        for knob in ("ORCA_CPU_ARCH", "ORCA_CUDA_ARCHS"):
            if os.environ.get(knob):
                args.append(f"-D{knob}={os.environ[knob]}")
        if (nvcc := os.environ.get("CUDACXX")) is None and Path("/usr/local/cuda/bin/nvcc").exists():
            nvcc = "/usr/local/cuda/bin/nvcc"
        if nvcc and cuda != "OFF":
            args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
        subprocess.run(["cmake", str(ROOT), *args], cwd=build_dir, check=True)
        subprocess.run(["cmake", "--build", ".", "--target", "_C", "-j", jobs], cwd=build_dir, check=True)
        if os.environ.get("ORCA_BUILD_BENCHMARKS", "1") != "0":
            subprocess.run(["cmake", "--build", ".", "-j", jobs], cwd=build_dir, check=True)


setup(ext_modules=[CMakeExtension("orca_ext._C")], cmdclass={"build_ext": CMakeBuild})
