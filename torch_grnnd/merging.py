"""Two built graphs into one (seed 003's GGM, adapted to the relative-neighbourhood rule).

The graph of the union starts from both graphs: each row keeps, as already compared ("old"),
the entries of its own graph's row that the rule keeps among themselves (a built row also holds
the fill's two-hop entries, csrc/fill.h, which would otherwise sit in every pool uncompared and
be compared with every new entry), and its S draws come from the other graph's rows in the
cells of the union's hubs (``init_split``), as new ones: its own graph's rows were compared by
its own build. The rounds compare only pairs with a new entry and, as GGM does, only pairs
across the two graphs (``compares_pair`` in csrc/build_schedule.h): a pair of two rows of one
graph was pruned by that graph's own build, so the work goes to where the rows of one graph sit
among those of the other; they stop when a round changes little, as a fresh build does. Pairs
across only took merges of halves from 54-59% to 40-50% of a fresh build's time, at recall@10
within 0.0025 of the fresh build's where the wider rule had been up to 0.002 above it
(benchmarks/README.md, "A merge compares pairs across the two graphs only").
With half the build's draws, starting from the rule's entries took a merge of clustered 10M x
128 halves from 61% to 48% of a fresh build's time and one of 1M real sentence embeddings from
63% to 48%, recall within 0.0005 of the fresh build (one H100, benchmarks/README.md, "A merge
starts from the rows' rule-kept entries"); a fixed cut of each row to its nearest 16 or 24
entries was as fast on the clustered rows but lost up to 0.018 recall on the embeddings.

A merge runs one outer iteration (its rounds, then reverse edges) unless told otherwise. Both
graphs have been through their own reverse edges; what is missing is the edges between the
parts, which the first outer iteration finds; a fresh build's stopping rule, which waits for an
outer iteration that starts settled, took 12% to 29% more time for at most 0.001 more
recall@10 at list 64 (one H100: clustered 2M and 4M x 128, 1M x 384; CPU: 100k real sentence
embeddings, clustered and Zipf-sized clusters; benchmarks/README.md, updates).

A merge draws as many rows as a build (S = ``initial_degree``) unless told otherwise. While
its start held the fill's entries, half the draws saved time at equal recall; from the rule's
entries, half the draws made clustered 10M x 128 halves merge in 48% of a fresh build's time
instead of 60% (recall 0.9937 and 0.9944, fresh 0.9941; one H100), but lost recall where
neighbourhoods are hard to find: on 100k anisotropic Gaussian rows (CPU) 0.917 against 0.9265
with the full draws (fresh 0.929, d = 48) and 0.9371 against 0.9432 (fresh 0.9435, d = 96); on
2M x 96 such rows (H100) 0.7207 against 0.7375 (fresh 0.7254, and the full draws 48% of its time).
The merge keeps the recall; ``initial_degree=8`` trades it for time.
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
    """``(data, graph)`` over the rows of a then b: ``graph`` int32 [Na + Nb, params.degree]."""
    n_a = data_a.shape[0]
    width = max(graph_a.shape[1], graph_b.shape[1])

    def widened(graph: Tensor, offset: int) -> Tensor:
        graph = torch.where(graph >= 0, graph + offset, graph)
        return torch.nn.functional.pad(graph, (0, width - graph.shape[1]), value=-1)

    data = torch.cat([data_a, data_b])
    init = torch.cat([widened(graph_a, 0), widened(graph_b, n_a)])
    return data, ops.build(data, params, metric=metric, progress=progress, init=init, init_split=n_a)
