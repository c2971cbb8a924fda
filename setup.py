"""Build: setuptools' build_ext drives CMake (Ninja), which builds orca_ext._C against the installed
torch. Use `pip install --no-build-isolation .` so the build sees *your* torch (CPU or CUDA).

Environment knobs: ORCA_CUDA=0/1 (default: use nvcc when found), ORCA_CPU_ARCH (-march for the
CPU kernels), ORCA_BUILD_DIR (CMake build folder, default build/cmake-<python tag>), MAX_JOBS.
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
        import torch  # the build needs the torch it will run with (hence --no-build-isolation)

        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        tag = sysconfig.get_config_var("SOABI") or f"py{sys.version_info.major}{sys.version_info.minor}"
        build_dir = Path(os.environ.get("ORCA_BUILD_DIR", ROOT / "build" / f"cmake-{tag}")).resolve()
        build_dir.mkdir(parents=True, exist_ok=True)

        cuda = {"0": "OFF", "1": "ON"}.get(os.environ.get("ORCA_CUDA", ""), "AUTO")
        torch_cuda = torch.version.cuda is not None and cuda != "OFF"
        # Match torch's pybind11 ABI tags so our module shares type casters with torch._C.
        pybind_defines = ";".join(
            f'{name}="{getattr(torch._C, "_" + name)}"'
            for name in ("PYBIND11_COMPILER_TYPE", "PYBIND11_STDLIB", "PYBIND11_BUILD_ABI")
            if getattr(torch._C, "_" + name, None) is not None
        )
        args = [
            "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={'Debug' if self.debug else 'Release'}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DORCA_OUTPUT_DIR={out_dir}",
            f"-DORCA_CUDA={cuda}",
            f"-DORCA_TORCH_CUDA={'ON' if torch_cuda else 'OFF'}",
            f"-DORCA_PYBIND11_DEFINES={pybind_defines}",
        ]
        if os.environ.get("ORCA_CPU_ARCH"):
            args.append(f"-DORCA_CPU_ARCH={os.environ['ORCA_CPU_ARCH']}")
        if (nvcc := os.environ.get("CUDACXX")) is None and Path("/usr/local/cuda/bin/nvcc").exists():
            nvcc = "/usr/local/cuda/bin/nvcc"
        if nvcc and cuda != "OFF":
            args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
        subprocess.run(["cmake", str(ROOT), *args], cwd=build_dir, check=True)
        subprocess.run(["cmake", "--build", ".", "-j", jobs], cwd=build_dir, check=True)


setup(ext_modules=[CMakeExtension("orca_ext._C")], cmdclass={"build_ext": CMakeBuild})
