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
from . import autograd  # noqa: F401  (registers the backward of search, knn and knn_graph)
from . import diagnostics, distributed, nn
from .codes import Codes, encode
from .eval import recall
from .graph import knn_graph
from .index import Index, merge
from .ops import build, knn, search, search_distance_counts
from .params import BuildParams, SearchParams
from .swapping import SwappingIndex

__all__ = ["Index", "merge", "SwappingIndex", "BuildParams", "SearchParams", "Codes", "encode", "build", "search",
           "search_distance_counts", "knn", "knn_graph", "recall", "nn", "distributed", "diagnostics"]
__version__ = "0.1.0"
