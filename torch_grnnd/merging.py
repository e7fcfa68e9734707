"""Two built graphs into one (seed 003's GGM, adapted to the relative-neighbourhood rule).

The graph of the union starts from both graphs: each row keeps, as already compared ("old"),
the entries of its own graph's row that the rule keeps among themselves (a built row also holds
the fill's two-hop entries, csrc/build/fill.h, which would otherwise sit in every pool uncompared and
be compared with every new entry), and its S draws come from the other graph's rows in the
cells of the union's hubs (``init_split``), as new ones: its own graph's rows were compared by
its own build. The rounds compare only pairs with a new entry and, as GGM does, only pairs
across the two graphs (``compares_pair`` in csrc/build/build_schedule.h): a pair of two rows of one
graph was pruned by that graph's own build, so the work goes to where the rows of one graph sit
among those of the other.

A merge runs one outer iteration (its rounds, then reverse edges) unless told otherwise: both
graphs have been through their own reverse edges, and what is missing is the edges between the
parts, which the first outer iteration finds. It draws as many rows as a build (S =
``initial_degree``): half the draws saved time on clustered rows but lost recall where
neighbourhoods are hard to find; ``initial_degree=8`` trades recall for time.

Measured in benchmarks/README.md: "A merge compares pairs across the two graphs only", "A merge
starts from the rows' rule-kept entries, and draws from the other graph", and the updates.
"""
from typing import Any, Dict, Tuple

import torch
from torch import Tensor

from . import ops
from .params import BuildParams
from .progress import Progress


OUTER_ITERS = 1


def schedule(params: BuildParams, settings: Dict[str, Any]) -> BuildParams:
    """The build settings a merge runs with: ``params`` with one outer iteration unless the
    caller's ``settings`` name ``outer_iters``."""
    if settings.get("outer_iters") is None:
        return params.replace(outer_iters=OUTER_ITERS)
    return params


def merge_graphs(data_a: Tensor, graph_a: Tensor, data_b: Tensor, graph_b: Tensor, params: BuildParams,
                 metric: ops.Metric, progress: Progress = False) -> Tuple[Tensor, Tensor]:
    """``(data, graph)`` over the rows of a then b: ``graph`` int32 [Na + Nb, the larger of
    params.degree and the two graphs' widths] (a graph its build widened keeps its width)."""
    n_a = data_a.shape[0]
    width = max(graph_a.shape[1], graph_b.shape[1])
    params = params.replace(degree=max(params.degree, width))

    def widened(graph: Tensor, offset: int) -> Tensor:
        graph = torch.where(graph >= 0, graph + offset, graph)
        return torch.nn.functional.pad(graph, (0, width - graph.shape[1]), value=-1)

    data = torch.cat([data_a, data_b])
    init = torch.cat([widened(graph_a, 0), widened(graph_b, n_a)])
    return data, ops.build(data, params, metric=metric, progress=progress, init=init, init_split=n_a)
