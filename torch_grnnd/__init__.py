"""torch_grnnd: GRNND k-NN graphs and batched nearest-neighbour search as PyTorch ops.

    import torch_grnnd as grnnd
    index = grnnd.Index.build(emb, metric="cosine")
    dists, ids = index.search(queries, k=10)

The ops are also reachable as ``torch.ops.grnnd.build/search/knn/knn_graph``; the distances
they return are differentiable (``autograd``), and ``torch_grnnd.nn`` has the layers
``KNNGraph`` and ``Retriever``. Logs go to the ``"torch_grnnd"`` logger.
"""
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


def info() -> dict:
    """How this install was built: the torch it was compiled against and runs under, whether it
    holds the CUDA kernels and, if not, why (as ``setup.py`` found it), the CUDA release and
    archs, and the C++ compiler. ``setup.py`` records the build next to the extension; a record
    that disagrees with the extension (a stale copy) is reported as such.

    Example:
        >>> import torch, torch_grnnd as grnnd
        >>> facts = grnnd.info()
        >>> facts["torch_running"] == torch.__version__, facts["cuda_kernels"] in (True, False)
        (True, True)
    """
    try:
        from ._build import BUILD as recorded
    except ImportError:  # built without setup.py
        recorded = {}
    facts = {"torch": None, "cuda_kernels": None, "no_cuda_reason": None, "cuda": None, "cuda_arch_list": None,
             "cuda_home": None, "cxx": None, "cxx_standard": None, **recorded}
    built = _C.torch_release
    facts.update(torch_built=f"{built // 100}.{built % 100}", torch_running=torch.__version__,
                 cuda_kernels=bool(_C.with_cuda), gpu_visible=torch.version.cuda is not None and torch.cuda.is_available())
    if recorded.get("cuda_kernels") is not None and recorded["cuda_kernels"] != facts["cuda_kernels"]:
        facts["no_cuda_reason"] = "unknown: torch_grnnd/_build.py describes another build than the extension's"
    facts.pop("torch", None)
    return facts


def _warn_without_cuda_kernels() -> None:
    # Asked only when the extension lacks the CUDA kernels but torch has CUDA: the one case where
    # a user would otherwise learn it at the first CUDA call.
    if _C.with_cuda or torch.version.cuda is None or not torch.cuda.is_available():
        return
    import warnings
    reason = info()["no_cuda_reason"] or "unknown"
    warnings.warn(f"torch_grnnd was built without its CUDA kernels ({reason}), and this machine has a GPU: "
                  "torch_grnnd ops on CUDA tensors will raise. Reinstall with the CUDA toolkit of torch's CUDA "
                  f"{torch.version.cuda} present (nvcc on PATH or CUDA_HOME set): "
                  "pip install --no-build-isolation -e .", stacklevel=2)


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
