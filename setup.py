"""Build torch_grnnd._C: CUDA kernels when nvcc and a CUDA build of torch are present, else CPU only.

Install after torch, without build isolation (an isolated build would pull a second torch):
    pip install --no-build-isolation -e .
Environment: GRNND_FORCE_CPU=1 skips the CUDA kernels; GRNND_PORTABLE=1 drops -march=native.
"""
import glob
import os
import platform

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

here = os.path.dirname(os.path.abspath(__file__))
with_cuda = torch.version.cuda is not None and CUDA_HOME is not None and not os.environ.get("GRNND_FORCE_CPU")

sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
cxx_flags = ["-O3", "-std=c++20"]
if platform.machine() in ("x86_64", "AMD64") and not os.environ.get("GRNND_PORTABLE"):
    cxx_flags.append("-march=native")  # the package is compiled where it is installed
extra_compile_args = {"cxx": cxx_flags}
define_macros = []
if with_cuda:
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    define_macros.append(("GRNND_WITH_CUDA", None))
    extra_compile_args["nvcc"] = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]
Extension = CUDAExtension if with_cuda else CppExtension

setup(
    ext_modules=[
        Extension(
            "torch_grnnd._C",
            sources,
            include_dirs=[os.path.join(here, "csrc")],
            define_macros=define_macros,
            extra_compile_args=extra_compile_args,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
