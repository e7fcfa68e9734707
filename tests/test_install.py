"""How the extension was built: properties that decide whether it can live in torch's process, and
what it reports (info, the warning, the CUDA stubs of a CPU-only build)."""
import shutil
import subprocess

import pytest
import torch

import torch_grnnd as grnnd


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
    assert facts["cuda_kernels"] == bool(grnnd._C.with_cuda)
    assert facts["torch_running"] == torch.__version__
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    assert facts["torch_built"] == f"{major}.{minor}"
    if facts["cuda_kernels"]:
        assert facts["no_cuda_reason"] is None and facts["cuda"] == torch.version.cuda
    else:  # setup.py's reason: GRNND_FORCE_CPU, a torch without CUDA, or no toolkit
        assert isinstance(facts["no_cuda_reason"], str) and facts["no_cuda_reason"]


def test_every_device_op_has_a_cuda_kernel():
    # The real one, or without CUDA kernels the stub that says why (csrc/grnnd.cpp): no op falls
    # to the dispatcher's generic message. Composite ops (knn_graph) run on their parts' kernels.
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("grnnd::")]
    device_ops = [n for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, "CPU")]
    assert {"grnnd::search", "grnnd::knn_segments", "grnnd::segment_edges"} <= set(device_ops)
    assert all(torch._C._dispatch_has_kernel_for_dispatch_key(n, "CUDA") for n in device_ops)
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("grnnd::knn_graph", "CUDA")


def test_a_gpu_machine_with_cpu_kernels_only_is_warned(monkeypatch):
    monkeypatch.setattr(grnnd._C, "with_cuda", 0)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(UserWarning, match=r"built without its CUDA kernels \(.+\), and this machine has a GPU"):
        grnnd._warn_without_cuda_kernels()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grnnd._warn_without_cuda_kernels()  # no GPU: nothing to say
