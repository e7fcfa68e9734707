"""The workload that .ci/gpu runs under compute-sanitizer must itself run to its end: a part that
raises (an API that changed under it) leaves every kernel path after it unchecked, and the
sanitizer's summary of the paths it did reach still reads "0 errors"."""
import inspect

import pytest
import torch

import sanitizer_workload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_the_sanitizer_workload_runs_every_part(capsys, monkeypatch):
    # Every part the module defines is in the default run (out_of_core once was not).
    defined = {name for name, f in vars(sanitizer_workload).items()
               if inspect.isfunction(f) and f.__module__ == sanitizer_workload.__name__ and name != "main"
               and not name.startswith("_")}  # _helpers serve the parts
    assert defined == set(sanitizer_workload.PARTS)
    ran = []
    for name in sanitizer_workload.PARTS:
        part = getattr(sanitizer_workload, name)
        monkeypatch.setattr(sanitizer_workload, name, lambda g, part=part, name=name: (part(g), ran.append(name)))
    sanitizer_workload.main()
    assert tuple(ran) == sanitizer_workload.PARTS  # each part ran to its end, in the default run
    assert capsys.readouterr().out.endswith("sanitizer workload done\n")
