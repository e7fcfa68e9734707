"""The workload that .ci/gpu runs under compute-sanitizer must itself run to its end: a part that
raises (an API that changed under it) leaves every kernel path after it unchecked, and the
sanitizer's summary of the paths it did reach still reads "0 errors"."""
import pytest
import torch

import sanitizer_workload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_the_sanitizer_workload_runs_every_part(capsys, monkeypatch):
    parts = ("edge_sizes", "hubs_and_repair", "segments", "editing", "out_of_core")
    ran = []
    for name in parts:
        part = getattr(sanitizer_workload, name)
        monkeypatch.setattr(sanitizer_workload, name, lambda g, part=part, name=name: (part(g), ran.append(name)))
    sanitizer_workload.main()
    assert tuple(ran) == parts  # each part called by the default run, and each ran to its end
    assert capsys.readouterr().out.endswith("sanitizer workload done\n")
