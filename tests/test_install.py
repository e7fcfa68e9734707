"""How the extension was built: properties that decide whether it can live in torch's process, what
it reports (info, the warning, the CUDA stubs of a CPU-only build), and setup.py's decisions."""
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import types
import warnings

import pytest
import setuptools
import torch

import torch_grnnd as grnnd

SETUP_PY = pathlib.Path(__file__).resolve().parents[1] / "setup.py"


def test_extension_uses_the_shared_libstdcxx():
    # A static libstdc++ inside the extension is a second C++ runtime next to torch's, and the first
    # error message that formats a number crashes in it (setup.py, choose_compilers).
    if shutil.which("readelf") is None:
        pytest.skip("needs readelf")
    needed = subprocess.run(["readelf", "-d", grnnd._C.__file__], check=True, capture_output=True, text=True).stdout
    assert "libstdc++.so" in needed


def test_extension_was_built_for_this_torch():
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    assert grnnd._C.torch_release == major * 100 + minor


def test_formatted_error_message_reaches_python():
    # The message formats two numbers and a shape through c10::str, the path that crashed.
    with pytest.raises(ValueError, match=r"data: expected a 2-D tensor \[n, dim\], got 1-D with shape \[7\]"):
        grnnd.build(torch.randn(7))


def test_info_says_what_was_built():
    facts = grnnd.info()
    assert set(facts) == {"cuda_kernels", "no_cuda_reason", "cuda", "cuda_arch_list", "cuda_home", "torch_built",
                          "torch_running", "cxx", "cxx_standard", "gpu_visible", "mismatch"}
    assert facts["cuda_kernels"] == bool(grnnd._C.with_cuda)
    assert facts["torch_running"] == torch.__version__
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    assert facts["torch_built"].startswith(f"{major}.{minor}")
    assert isinstance(facts["gpu_visible"], bool)
    assert facts["mismatch"] is None or isinstance(facts["mismatch"], str)
    if facts["cuda_kernels"]:
        assert facts["no_cuda_reason"] is None and facts["cuda"] == torch.version.cuda
        assert isinstance(facts["cuda_arch_list"], str)
    else:  # setup.py's reason: GRNND_FORCE_CPU, a torch without CUDA, or no toolkit
        assert isinstance(facts["no_cuda_reason"], str) and facts["no_cuda_reason"]
        assert facts["cuda"] is None and facts["cuda_arch_list"] is None


def with_record(monkeypatch, record):
    """info() reading `record` as torch_grnnd/_build.py's BUILD (None: no _build.py at all)."""
    module = None if record is None else types.SimpleNamespace(BUILD=record)
    monkeypatch.setitem(sys.modules, "torch_grnnd._build", module)


def this_build(**changes) -> dict:
    release = f"{grnnd._C.torch_release // 100}.{grnnd._C.torch_release % 100}"
    with_cuda = bool(grnnd._C.with_cuda)
    return {"torch": release + ".0", "cuda_kernels": with_cuda,
            "no_cuda_reason": None if with_cuda else "GRNND_FORCE_CPU is set", "cuda": "12.8" if with_cuda else None,
            "cuda_arch_list": "9.0+PTX" if with_cuda else None, "cuda_home": "/usr/local/cuda" if with_cuda else None,
            "cxx": "g++", "cxx_standard": "c++20", **changes}


def test_info_reports_the_record(monkeypatch):
    with_record(monkeypatch, this_build())
    facts = grnnd.info()
    assert facts["mismatch"] is None and facts["torch_built"] == this_build()["torch"]
    assert {key: facts[key] for key in ("no_cuda_reason", "cuda", "cuda_arch_list", "cuda_home", "cxx")} == {
        key: this_build()[key] for key in ("no_cuda_reason", "cuda", "cuda_arch_list", "cuda_home", "cxx")}


def test_info_reads_an_older_record_with_fewer_keys(monkeypatch):
    # Prebuilt extensions travel with the _build.py of their day: a key it lacks reads as None.
    with_record(monkeypatch, {"torch": this_build()["torch"], "cuda_kernels": bool(grnnd._C.with_cuda)})
    facts = grnnd.info()
    assert facts["mismatch"] is None and facts["torch_built"] == this_build()["torch"]
    assert facts["cuda_arch_list"] is None and facts["cxx"] is None and facts["cxx_standard"] is None
    assert facts["no_cuda_reason"] is None if facts["cuda_kernels"] else facts["no_cuda_reason"].startswith("unknown")


def test_info_without_a_record(monkeypatch):
    with_record(monkeypatch, None)
    facts = grnnd.info()
    release = f"{grnnd._C.torch_release // 100}.{grnnd._C.torch_release % 100}"
    assert facts["torch_built"] == release and facts["mismatch"] is None and facts["cxx"] is None
    assert facts["cuda_kernels"] == bool(grnnd._C.with_cuda)


def test_info_flags_a_record_of_another_build(monkeypatch):
    with_record(monkeypatch, this_build(torch="1.13.1", cuda_kernels=not grnnd._C.with_cuda, cxx="clang++"))
    facts = grnnd.info()
    assert "CUDA kernels" in facts["mismatch"] and "torch release: 1.13 in the record" in facts["mismatch"]
    # Another build's facts are not reported as this one's.
    assert facts["cxx"] is None and facts["torch_built"] == f"{grnnd._C.torch_release // 100}.{grnnd._C.torch_release % 100}"
    assert facts["no_cuda_reason"] is None if facts["cuda_kernels"] else facts["no_cuda_reason"].startswith("unknown")


def test_every_device_op_has_a_cuda_kernel():
    # The real one, or without CUDA kernels the stub that says why (csrc/grnnd.cpp): no op falls
    # to the dispatcher's generic message. Composite ops (knn_graph) run on their parts' kernels.
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("grnnd::")]
    device_ops = [n for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, "CPU")]
    assert {"grnnd::search", "grnnd::knn_segments", "grnnd::segment_edges"} <= set(device_ops)
    assert all(torch._C._dispatch_has_kernel_for_dispatch_key(n, "CUDA") for n in device_ops)
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("grnnd::knn_graph", "CUDA")


def warnings_of(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(warning.message) for warning in caught]


def test_a_gpu_machine_with_cpu_kernels_only_is_warned(monkeypatch):
    monkeypatch.setattr(grnnd._C, "with_cuda", 0)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with_record(monkeypatch, this_build(cuda_kernels=False, no_cuda_reason="no CUDA toolkit was found"))
    [message] = warnings_of(grnnd._warn_without_cuda_kernels)
    assert "built without its CUDA kernels (no CUDA toolkit was found), and this machine has a GPU" in message
    assert "pip install --no-build-isolation -e ." in message
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert warnings_of(grnnd._warn_without_cuda_kernels) == []  # no GPU: nothing to say
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(grnnd._C, "with_cuda", 1)
    assert warnings_of(grnnd._warn_without_cuda_kernels) == []  # the CUDA kernels are there


IMPORT_AND_COUNT = """
import json, sys, warnings
import torch
if sys.argv[1] == "gpu":  # what a CUDA torch on a machine with a GPU answers
    torch.version.cuda = torch.version.cuda or "12.8"
    torch.cuda.is_available = lambda: True
else:
    torch.cuda.is_available = lambda: False
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch_grnnd
    import torch_grnnd.nn, torch_grnnd.ops  # later imports of the package say nothing again
    torch_grnnd.info()
print(json.dumps({"warnings": [str(w.message) for w in caught if "CUDA kernels" in str(w.message)],
                  "cuda_initialized": torch.cuda.is_initialized()}))
"""


@pytest.mark.parametrize("machine", ["gpu", "cpu"])
def test_import_warns_once_on_a_gpu_machine_without_the_cuda_kernels(machine):
    # A fresh process, since the warning is the import's own. Its GPU is a patched answer of
    # torch.cuda.is_available, so the test runs anywhere; CUDA is never initialised by the import.
    package_root = str(pathlib.Path(grnnd.__file__).resolve().parents[1])  # the torch_grnnd this process tests
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", IMPORT_AND_COUNT, machine], check=False, capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    expected = 1 if machine == "gpu" and not grnnd._C.with_cuda else 0
    assert len(seen["warnings"]) == expected, seen["warnings"]
    assert not seen["cuda_initialized"]


def load_setup_py(monkeypatch):
    """setup.py as a module, with setuptools.setup replaced by a call that fails: importing it must
    build nothing."""
    if not SETUP_PY.exists():
        pytest.skip("needs the source tree's setup.py")

    def no_build(**_):
        raise AssertionError("importing setup.py ran setup()")

    monkeypatch.setattr(setuptools, "setup", no_build)
    spec = importlib.util.spec_from_file_location("grnnd_setup", SETUP_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_setup_py_says_why_it_builds_no_cuda_kernels(monkeypatch):
    why_no_cuda = load_setup_py(monkeypatch).why_no_cuda
    assert why_no_cuda(None, "2.11.0+cu130", "13.0", "/usr/local/cuda") is None
    assert why_no_cuda("", "2.11.0+cu130", "13.0", "/usr/local/cuda") is None  # set but empty: not forced
    assert why_no_cuda("1", "2.11.0+cu130", "13.0", "/usr/local/cuda") == "GRNND_FORCE_CPU is set"
    assert why_no_cuda("1", "2.13.0+cpu", None, None) == "GRNND_FORCE_CPU is set"  # the first reason wins
    assert why_no_cuda(None, "2.13.0+cpu", None, None) == "torch 2.13.0+cpu is a build without CUDA"
    assert why_no_cuda(None, "2.13.0+cpu", None, "/usr/local/cuda") == "torch 2.13.0+cpu is a build without CUDA"
    reason = why_no_cuda(None, "2.11.0+cu130", "13.0", None)
    assert reason.startswith("no CUDA toolkit was found (no CUDA_HOME, no nvcc on PATH, no /usr/local/cuda) for "
                             "torch's CUDA 13.0; install the toolkit of that CUDA release, or set CUDA_HOME to it")


def test_setup_py_prints_one_line_for_each_outcome(monkeypatch):
    build_line = load_setup_py(monkeypatch).build_line
    line = build_line("torch 2.13.0+cpu is a build without CUDA", None, None, None)
    assert line == "torch_grnnd: building the CPU kernels only, no CUDA kernels: torch 2.13.0+cpu is a build without CUDA"
    line = build_line(None, "13.0", "/usr/local/cuda", "9.0+PTX")
    assert line == "torch_grnnd: building the CPU and CUDA kernels (CUDA 13.0 at /usr/local/cuda, archs 9.0+PTX)"
    assert "\n" not in build_line(None, "13.0", "/usr/local/cuda", "")


def test_setup_py_records_the_archs_torch_compiles_for(monkeypatch):
    setup_py = load_setup_py(monkeypatch)
    flags = ["-gencode=arch=compute_100,code=sm_100", "-gencode=arch=compute_80,code=sm_80",
             "-gencode=arch=compute_90,code=compute_90", "-gencode=arch=compute_90,code=sm_90",
             "-gencode=arch=compute_90a,code=sm_90a"]
    assert setup_py.archs_of_flags(flags) == "8.0;9.0+PTX;9.0a;10.0"
    # Read back from torch's own choice, which the build uses.
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "10.0 8.0;9.0+PTX")
    assert setup_py.archs_to_build() == "8.0;9.0+PTX;10.0"
