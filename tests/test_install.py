"""How the extension was built: properties that decide whether it can live in torch's process."""
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
