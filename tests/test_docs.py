"""The runnable examples in the docstrings run and print what they claim."""
import doctest

import pytest

import torch_grnnd
from torch_grnnd import (autograd, batching, codes, eval as eval_module, graph, index, nn, ops, params, progress, pyg,
                         swapping)


@pytest.mark.parametrize("module", [torch_grnnd, ops, params, index, codes, graph, eval_module, nn, autograd, progress,
                                    pyg, swapping, batching], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, extraglobs={"grnnd": torch_grnnd}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module.__name__} has no examples"
    assert result.failed == 0
