"""Every index class offers one surface (torch_grnnd.SearchIndex / EditableIndex): search a
batch for k neighbours, count the live vectors, save a state; the editable ones add, remove and
compact. Code written against the protocol runs on any of them and gets the same answers."""
import pytest
import torch

import torch_grnnd as grnnd
from torch_grnnd.distributed import ReplicatedIndex, ShardedIndex

from conftest import clustered


def test_the_classes_follow_the_protocol():
    assert issubclass(grnnd.Index, grnnd.EditableIndex)
    assert issubclass(ShardedIndex, grnnd.EditableIndex)
    assert issubclass(grnnd.nn.Retriever, grnnd.EditableIndex)
    assert issubclass(grnnd.SwappingIndex, grnnd.SearchIndex)
    assert issubclass(ReplicatedIndex, grnnd.SearchIndex)
    assert not issubclass(grnnd.SwappingIndex, grnnd.EditableIndex)  # its shards' graphs are fixed


def nearest(index: grnnd.SearchIndex, queries: torch.Tensor) -> torch.Tensor:
    """Code that knows only the protocol."""
    dists, ids = index.search(queries, 5)
    assert dists.shape == ids.shape == (queries.shape[0], 5) and ids.dtype == torch.long
    assert bool((dists[:, 1:] >= dists[:, :-1]).all())
    return ids


def test_one_caller_gets_the_same_answers_from_each_index():
    data = clustered(4000, 16, 20, seed=61)
    queries = data[:50] + 0.01
    indexes = {"Index": grnnd.Index.build(data), "Retriever": grnnd.nn.Retriever(data, k=5),
               "SwappingIndex": grnnd.SwappingIndex.build(data, device="cpu", shard_rows=2000)}
    exact = grnnd.knn(data, queries, 5)[1]
    for name, index in indexes.items():
        assert isinstance(index, grnnd.SearchIndex), name
        assert len(index) == 4000, name
        assert grnnd.recall(nearest(index, queries), exact) >= 0.95, name
        assert set(index.state_dict()), name
    for name in ("Index", "Retriever"):
        index = indexes[name]
        index.add(data[:10] + 100.0)  # numbered on from 4000
        index.remove(torch.tensor([0, 1]))
        index.compact()
        assert len(index) == 4008, name
        assert not torch.isin(nearest(index, queries), torch.tensor([0, 1])).any(), name


def test_a_damaged_swapping_state_is_refused_like_an_index_state():
    data = torch.randn(3000, 8)
    state = grnnd.SwappingIndex.build(data, device="cpu", shard_rows=1000).state_dict()
    assert grnnd.SwappingIndex.from_state_dict(state).search(data[:3], 1)[1].flatten().tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="graph ids must lie in"):
        grnnd.SwappingIndex.from_state_dict({**state, "graphs": [state["graphs"][0] + 2000] + state["graphs"][1:]})
    with pytest.raises(ValueError, match="cover the 3000 rows"):
        grnnd.SwappingIndex.from_state_dict({**state, "graphs": state["graphs"] * 2})
    with pytest.raises(TypeError, match="graph must be int32"):
        grnnd.SwappingIndex.from_state_dict({**state, "graphs": [g.long() for g in state["graphs"]]})
