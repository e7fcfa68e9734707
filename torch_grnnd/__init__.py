"""torch_grnnd: GRNND k-NN graphs and batched nearest-neighbour search as PyTorch ops.

    import torch_grnnd as grnnd
    index = grnnd.Index.build(emb, metric="cosine")
    dists, ids = index.search(queries, k=10)

The ops are also reachable as ``torch.ops.grnnd.build/search/knn/knn_graph``; the distances
they return are differentiable (``autograd``), and ``torch_grnnd.nn`` has the layers
``KNNGraph`` and ``Retriever``. Logs go to the ``"torch_grnnd"`` logger.
"""
import warnings

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers torch.ops.grnnd.*)


def _check_torch_release() -> None:
    # An extension compiled against one torch release and loaded under another may declare
    # torch's types differently (C++17 against C++20 headers, see setup.py) and crash on the
    # first error message instead of raising it.
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    built = _C.torch_release
    if built != major * 100 + minor:
        raise ImportError(
            f"torch_grnnd was compiled against torch {built // 100}.{built % 100} but torch {torch.__version__} "
            "is installed; reinstall it (pip install --no-build-isolation -e .) under this torch")


_check_torch_release()


def _build_record() -> dict:
    try:
        from ._build import BUILD
    except ImportError:  # built without setup.py
        return {}
    return BUILD


def info() -> dict:
    """How this install was built, from the extension itself and the record ``setup.py`` writes
    next to it (``torch_grnnd/_build.py``). The keys:

    - ``cuda_kernels`` (bool): whether the CUDA kernels are compiled in; ``no_cuda_reason`` (str or
      None): if not, why, as ``setup.py`` found it (``GRNND_FORCE_CPU``, a torch without CUDA, no
      CUDA toolkit), or "unknown: ..." without a record that matches the extension.
    - ``cuda`` (str or None): the CUDA release the kernels were compiled with; ``cuda_arch_list``
      (str or None): the GPU archs they were compiled for, spelt as ``TORCH_CUDA_ARCH_LIST``
      (``"9.0+PTX"``; empty from older builds, which recorded only that the GPUs visible at build
      time chose them); ``cuda_home``: the toolkit's folder.
    - ``torch_built`` (str): the torch compiled against; ``torch_running`` (str): the torch running
      now. Their releases (major.minor) agree: the import refuses another release.
    - ``cxx``, ``cxx_standard`` (str or None): the C++ compiler and the standard compiled for.
    - ``gpu_visible`` (bool): whether the running torch sees a GPU.
    - ``mismatch`` (str or None): what differs when the record describes another build than the
      extension's (one left by an earlier build); the record is then ignored.

    Records from older builds lack some keys; theirs are None.

    Example:
        >>> import torch, torch_grnnd as grnnd
        >>> facts = grnnd.info()
        >>> facts["torch_running"] == torch.__version__, facts["cuda_kernels"] in (True, False)
        (True, True)
    """
    recorded = _build_record()
    cuda_kernels = bool(_C.with_cuda)
    release = f"{_C.torch_release // 100}.{_C.torch_release % 100}"
    recorded_release = ".".join(recorded.get("torch", release).split(".")[:2])
    differences = [f"{what}: {was} in the record, {now} in the extension" for what, was, now in (
        ("CUDA kernels", recorded.get("cuda_kernels", cuda_kernels), cuda_kernels),
        ("torch release", recorded_release, release)) if was != now]
    mismatch = (f"torch_grnnd/_build.py describes another build than the extension's ({'; '.join(differences)}): "
                "reinstall to renew it") if differences else None
    if mismatch is not None:
        recorded = {}  # another build's facts: none of them is known to hold for this one
    if cuda_kernels:
        no_cuda_reason = None
    else:
        no_cuda_reason = recorded.get("no_cuda_reason") or "unknown: no record from setup.py matches this extension"
    return {"cuda_kernels": cuda_kernels, "no_cuda_reason": no_cuda_reason, "cuda": recorded.get("cuda"),
            "cuda_arch_list": recorded.get("cuda_arch_list"), "cuda_home": recorded.get("cuda_home"),
            "torch_built": recorded.get("torch", release),
            "torch_running": torch.__version__, "cxx": recorded.get("cxx"), "cxx_standard": recorded.get("cxx_standard"),
            "gpu_visible": torch.version.cuda is not None and torch.cuda.is_available(), "mismatch": mismatch}


def _warn_without_cuda_kernels() -> None:
    # Asked only when the extension lacks the CUDA kernels but torch has CUDA: the one case where
    # a user would otherwise learn it at the first CUDA call. The cheap tests come first, so a
    # CUDA build and a CPU torch never ask the driver; is_available leaves torch's CUDA state
    # uninitialised (no context).
    if _C.with_cuda or torch.version.cuda is None or not torch.cuda.is_available():
        return
    warnings.warn(f"torch_grnnd was built without its CUDA kernels ({info()['no_cuda_reason']}), and this machine "
                  "has a GPU: torch_grnnd ops on CUDA tensors will raise. Reinstall with the CUDA toolkit of "
                  f"torch's CUDA {torch.version.cuda} present (nvcc on PATH or CUDA_HOME set): "
                  "pip install --no-build-isolation -e . (torch_grnnd.info() describes this build)", stacklevel=2)


_warn_without_cuda_kernels()
from . import autograd  # noqa: F401  (registers the backward of search, knn and knn_graph)
from . import diagnostics, distributed, nn
from .batching import QueryBatcher
from .codes import Codes, encode
from .eval import recall
from .graph import knn_graph
from .index import EditableIndex, Index, SearchIndex, merge
from .building import build
from .ops import knn, search, search_distance_counts
from .params import BuildParams, SearchParams
from .swapping import SwappingIndex

__all__ = ["info", "Index", "SearchIndex", "EditableIndex", "merge", "SwappingIndex", "QueryBatcher", "BuildParams",
           "SearchParams", "Codes", "encode", "build", "search", "search_distance_counts", "knn", "knn_graph", "recall",
           "nn", "distributed", "diagnostics"]
__version__ = "0.1.0"
