"""Build torch_grnnd._C: CUDA kernels when nvcc and a CUDA build of torch are present, else CPU only.

The C++ compiler must link the shared libstdc++ (choose_compilers checks, and falls back to the
system g++ when CXX names one that does not).

Install after torch, without build isolation (an isolated build would pull a second torch):
    pip install --no-build-isolation -e .
Environment: GRNND_FORCE_CPU=1 skips the CUDA kernels.

It says what it builds and why (on stderr; `pip install -v` shows it) and records it in
torch_grnnd/_build.py, which torch_grnnd.info() reports and import torch_grnnd reads to warn when
a machine with a GPU got the CPU kernels only.
"""
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

here = os.path.dirname(os.path.abspath(__file__))


def why_no_cuda():
    """None when the CUDA kernels can be built here, else the reason they are not."""
    if os.environ.get("GRNND_FORCE_CPU"):
        return "GRNND_FORCE_CPU is set"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA"
    if CUDA_HOME is None:
        return (f"no CUDA toolkit was found (nvcc on PATH or CUDA_HOME) for torch's CUDA {torch.version.cuda}; "
                "install the toolkit of that CUDA release, or set CUDA_HOME to it")
    return None


no_cuda_reason = why_no_cuda()
with_cuda = no_cuda_reason is None


def torch_cxx_standard() -> str:
    """The C++ standard torch itself was compiled with, as a -std value ("c++17", "c++20"):
    torch 2.13 reports C++20 and torch 2.11 C++17 in its build configuration, which is read here. Compiling the extension for the same standard keeps its view of torch's inline
    code and types the one torch has (torch's own cpp_extension default does the same)."""
    match = re.search(r"C\+\+ Version: (\d{4})", torch.__config__.show())
    if match is None:
        raise RuntimeError("torch.__config__.show() names no C++ version; cannot tell which -std to compile with")
    standards = {"2017": "c++17", "2020": "c++20", "2023": "c++23"}
    if match.group(1) not in standards:
        raise RuntimeError(f"torch was built as C++ {match.group(1)}, which this setup.py does not know")
    return standards[match.group(1)]


def links_shared_libstdcxx(cxx: str) -> bool:
    """Whether `cxx` links a shared library against the shared libstdc++ (libstdc++.so.6 in its
    DT_NEEDED), judged from a two-line library it links in a temporary folder."""
    with tempfile.TemporaryDirectory() as tmp:
        source, library = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(source, "w") as f:
            f.write("#include <sstream>\nint probe(int x) { std::ostringstream s; s << x; return s.str().size(); }\n")
        try:
            subprocess.run([*shlex.split(cxx), "-shared", "-fPIC", source, "-o", library], check=True,
                           capture_output=True)
            needed = subprocess.run(["readelf", "-d", library], check=True, capture_output=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return True  # no verdict without a working compiler and readelf: let the build itself speak
    return "libstdc++.so" in needed


def choose_compilers() -> None:
    """Refuse a C++ compiler that links libstdc++ statically, falling back to the system's g++.

    The extension exchanges C++ objects (strings, streams, exceptions) with torch, which uses the
    process's shared libstdc++. Linked with a compiler that puts a static libstdc++ inside the
    extension (a GCC built into /opt with CXX pointing at it, say), the extension carries a second
    copy of the C++ runtime whose locale registry the first never initialised: every error message
    that formats a number (c10::str, TORCH_CHECK) then crashes the process. Seen on Ubuntu 24.04
    with torch 2.11 from pip and CXX=/opt/gcc/bin/g++.
    """
    cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    if links_shared_libstdcxx(cxx):
        return
    for cc, fallback in (("gcc", "g++"), ("cc", "c++")):
        path = shutil.which(fallback)
        if path and links_shared_libstdcxx(path) and shutil.which(cc):
            print(f"setup.py: {cxx} links libstdc++ statically, which crashes torch extensions; "
                  f"building with {path} instead", file=sys.stderr)
            os.environ["CXX"], os.environ["CC"] = path, shutil.which(cc)
            return
    raise RuntimeError(f"{cxx} links libstdc++ statically into shared libraries, and no g++ or c++ on PATH links "
                       "it dynamically. A torch extension must share torch's libstdc++; set CXX and CC to a "
                       "compiler that links the shared libstdc++ (the system g++ does).")


choose_compilers()
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


def record_build() -> None:
    """Say what is built, and write it to torch_grnnd/_build.py for torch_grnnd.info()."""
    cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    facts = {"torch": torch.__version__, "cuda_kernels": with_cuda, "no_cuda_reason": no_cuda_reason,
             "cuda": torch.version.cuda if with_cuda else None,
             # Empty: torch's cpp_extension default, the archs of the GPUs visible at build time.
             "cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST", "") if with_cuda else None,
             "cuda_home": CUDA_HOME if with_cuda else None, "cxx": cxx, "cxx_standard": cxx_std[len("-std="):]}
    if with_cuda:
        print(f"setup.py: building the CPU and CUDA kernels (CUDA {torch.version.cuda} at {CUDA_HOME}, archs "
              f"{facts['cuda_arch_list'] or 'of the visible GPUs'})", file=sys.stderr)
    else:
        print(f"setup.py: building the CPU kernels only: {no_cuda_reason}", file=sys.stderr)
    with open(os.path.join(here, "torch_grnnd", "_build.py"), "w") as f:
        f.write('"""How this copy of torch_grnnd._C was built (written by setup.py; see torch_grnnd.info())."""\n')
        f.write(f"BUILD = {facts!r}\n")


record_build()

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
