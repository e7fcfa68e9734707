"""Build torch_grnnd._C: CUDA kernels when nvcc and a CUDA build of torch are present, else CPU only.

The C++ compiler must link the shared libstdc++ (choose_compilers checks, and falls back to the
system g++ when CXX names one that does not).

Install after torch, without build isolation (an isolated build would pull a second torch):
    pip install --no-build-isolation -e .
Environment: GRNND_FORCE_CPU=1 (any non-empty value) skips the CUDA kernels; TORCH_CUDA_ARCH_LIST
picks the archs (torch's default: those of the GPUs visible at build time).

It says in one line what it builds and why (on stderr; `pip install -v` shows it) and records it
in torch_grnnd/_build.py, which torch_grnnd.info() reports and import torch_grnnd reads to warn
when a machine with a GPU got the CPU kernels only. Importing this file runs no build: the
decisions are functions the tests call.
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
import torch.utils.cpp_extension
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

here = os.path.dirname(os.path.abspath(__file__))


def why_no_cuda(force_cpu: str | None, torch_version: str, torch_cuda: str | None, cuda_home: str | None) -> str | None:
    """None when the CUDA kernels can be built, else why not: the first of GRNND_FORCE_CPU set
    (``force_cpu``, any non-empty value), a torch without CUDA (``torch_cuda``, torch.version.cuda,
    is None), no CUDA toolkit (``cuda_home``, what torch found from CUDA_HOME or CUDA_PATH, nvcc on
    PATH or /usr/local/cuda, is None)."""
    if force_cpu:
        return "GRNND_FORCE_CPU is set"
    if torch_cuda is None:
        return f"torch {torch_version} is a build without CUDA"
    if cuda_home is None:
        return (f"no CUDA toolkit was found (no CUDA_HOME, no nvcc on PATH, no /usr/local/cuda) for torch's CUDA "
                f"{torch_cuda}; install the toolkit of that CUDA release, or set CUDA_HOME to it")
    return None


def archs_of_flags(gencode_flags: list[str]) -> str:
    """The archs nvcc's -gencode flags compile for, spelt as TORCH_CUDA_ARCH_LIST spells them
    ("8.0;9.0+PTX"): an arch with PTX (code=compute_XX) runs on later GPUs too, one without only on
    its own generation."""
    machine_code, ptx = set(), set()
    for flag in gencode_flags:
        match = re.fullmatch(r"-gencode=arch=compute_(\d+)(a?),code=(sm|compute)_\1\2", flag)
        if match is not None:
            number, suffix, kind = match.groups()
            (machine_code if kind == "sm" else ptx).add(f"{number[:-1]}.{number[-1]}{suffix}")
    archs = sorted(machine_code | ptx, key=lambda arch: (int(arch.split(".")[0]), arch))
    return ";".join(arch + ("+PTX" if arch in ptx else "") for arch in archs)


def archs_to_build() -> str:
    """The archs this build's nvcc compiles for, as torch's cpp_extension picks them from
    TORCH_CUDA_ARCH_LIST or else the visible GPUs. That choice is torch's private function; where
    this torch lacks it or it cannot choose (no GPU visible and no list: the build then stops with
    torch's own message), TORCH_CUDA_ARCH_LIST as given."""
    pick = getattr(torch.utils.cpp_extension, "_get_cuda_arch_flags", None)
    given = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if pick is None:
        return given
    try:
        return archs_of_flags(pick()) or given
    except (IndexError, ValueError):
        return given


def build_line(no_cuda_reason: str | None, cuda: str | None, cuda_home: str | None, archs: str | None) -> str:
    """The one line setup.py prints: which kernels it builds and, without the CUDA ones, why."""
    if no_cuda_reason is not None:
        return f"torch_grnnd: building the CPU kernels only, no CUDA kernels: {no_cuda_reason}"
    return (f"torch_grnnd: building the CPU and CUDA kernels (CUDA {cuda} at {cuda_home}, archs "
            f"{archs or 'of the GPUs visible now'})")


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


def record_build(facts: dict) -> None:
    """Write the build's facts to torch_grnnd/_build.py, where torch_grnnd.info() reads them. Before
    setup() runs, so that a wheel packs the record with the extension."""
    with open(os.path.join(here, "torch_grnnd", "_build.py"), "w") as f:
        f.write('"""How this copy of torch_grnnd._C was built (written by setup.py; see torch_grnnd.info())."""\n')
        f.write(f"BUILD = {facts!r}\n")


def extension(with_cuda: bool, cxx_std: str):
    """torch_grnnd._C: the CPU kernels, and the CUDA kernels when ``with_cuda``."""
    sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
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
        sources += sorted(glob.glob("csrc/**/*.cu", recursive=True))
        define_macros.append(("GRNND_WITH_CUDA", None))
        extra_compile_args["nvcc"] = ["-O3", cxx_std, "--expt-relaxed-constexpr", "-lineinfo"]
    return (CUDAExtension if with_cuda else CppExtension)(
        "torch_grnnd._C",
        sources,
        include_dirs=[os.path.join(here, "csrc")],
        define_macros=define_macros,
        extra_compile_args=extra_compile_args,
        extra_link_args=extra_link_args,
    )


def main() -> None:
    no_cuda_reason = why_no_cuda(os.environ.get("GRNND_FORCE_CPU"), torch.__version__, torch.version.cuda, CUDA_HOME)
    with_cuda = no_cuda_reason is None
    choose_compilers()
    cxx_std = "-std=" + torch_cxx_standard()
    archs = archs_to_build() if with_cuda else None
    print(build_line(no_cuda_reason, torch.version.cuda, CUDA_HOME, archs), file=sys.stderr)
    record_build({"torch": torch.__version__, "cuda_kernels": with_cuda, "no_cuda_reason": no_cuda_reason,
                  "cuda": torch.version.cuda if with_cuda else None, "cuda_arch_list": archs,
                  "cuda_home": CUDA_HOME if with_cuda else None,
                  "cxx": os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++",
                  "cxx_standard": cxx_std[len("-std="):]})
    setup(ext_modules=[extension(with_cuda, cxx_std)], cmdclass={"build_ext": BuildExtension})


# pip runs this file as __main__ (setuptools' build backend does too); the tests import it.
if __name__ == "__main__":
    main()
