"""Build torch_grnnd._C: CUDA kernels when nvcc and a CUDA build of torch are present, else CPU only.

Install after torch, without build isolation (an isolated build would pull a second torch):
    pip install --no-build-isolation -e .
Environment: GRNND_FORCE_CPU=1 skips the CUDA kernels.
"""
import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

here = os.path.dirname(os.path.abspath(__file__))
with_cuda = torch.version.cuda is not None and CUDA_HOME is not None and not os.environ.get("GRNND_FORCE_CPU")

sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
# No -march flags: the graph loops wait on memory, not arithmetic (prefetching helped, AVX2/
# AVX-512 builds of the distance loops did not measurably), and a baseline build runs anywhere.
extra_compile_args = {"cxx": ["-O3", "-std=c++20"]}
extra_link_args = []
if torch.backends.openmp.is_available():
    # at::parallel_for is a header template that expands to `#pragma omp parallel` in our own
    # translation units: without -fopenmp the CPU kernels silently run on one thread. Linking
    # -fopenmp resolves to the libgomp torch already loaded.
    extra_compile_args["cxx"].append("-fopenmp")
    extra_link_args.append("-fopenmp")
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
            extra_link_args=extra_link_args,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
