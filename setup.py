"""Build torch_grnnd._C: CUDA kernels when nvcc and a CUDA build of torch are present, else CPU only.

Install after torch, without build isolation (an isolated build would pull a second torch):
    pip install --no-build-isolation -e .
Environment: GRNND_FORCE_CPU=1 skips the CUDA kernels.
"""
import glob
import os
import re

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

here = os.path.dirname(os.path.abspath(__file__))
with_cuda = torch.version.cuda is not None and CUDA_HOME is not None and not os.environ.get("GRNND_FORCE_CPU")


def torch_cxx_standard() -> str:
    """The C++ standard torch itself was compiled with, as a -std value ("c++17", "c++20").

    The extension must use the same one. Torch's headers declare some types and inline functions
    differently under C++17 and C++20, and a pip wheel of torch exports the libstdc++ string-stream
    members it was linked with: an extension compiled for another standard than its torch
    (C++20 against the C++17 build of torch 2.11, say) mixes the two definitions and crashes in
    the first error message that formats a number (c10::str). torch >= 2.13 is built as C++20,
    earlier wheels as C++17; torch reports which in its build configuration.
    """
    match = re.search(r"C\+\+ Version: (\d{4})", torch.__config__.show())
    if match is None:
        raise RuntimeError("torch.__config__.show() names no C++ version; cannot tell which -std to compile with")
    year = match.group(1)
    standards = {"2017": "c++17", "2020": "c++20", "2023": "c++23"}
    if year not in standards:
        raise RuntimeError(f"torch was built as C++ {year}, which this setup.py does not know")
    return standards[year]


cxx_std = "-std=" + torch_cxx_standard()
sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
# No -march flags: the graph loops wait on memory, not arithmetic (prefetching helped, AVX2/
# AVX-512 builds of the distance loops did not measurably), and a baseline build runs anywhere.
extra_compile_args = {"cxx": ["-O3", cxx_std]}
extra_link_args = []
if torch.backends.openmp.is_available():
    # at::parallel_for is a header template that expands to `#pragma omp parallel` in our own
    # translation units: without -fopenmp the CPU kernels silently run on one thread. Linking
    # -fopenmp resolves to the libgomp torch already loaded.
    extra_compile_args["cxx"].append("-fopenmp")
    extra_link_args.append("-fopenmp")
# The torch release this build is for (major * 100 + minor): torch_grnnd/__init__.py refuses to
# load the extension under another one instead of crashing later.
major, minor = (int(part) for part in torch.__version__.split(".")[:2])
define_macros = [("GRNND_TORCH_RELEASE", str(major * 100 + minor))]
if with_cuda:
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    define_macros.append(("GRNND_WITH_CUDA", None))
    extra_compile_args["nvcc"] = ["-O3", cxx_std, "--expt-relaxed-constexpr", "-lineinfo"]
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
