"""parity_cli/backends/exporting.py: the CompositeImplicitAutograd op list torch.export materialises
once per op namespace is materialised once an export, and again when the dispatcher's list changes;
what the export produces does not change."""

import warnings

import pytest
import torch
from conftest import SLOW

from parity_cli.backends.exporting import cia_ops_materialized_once


@pytest.fixture
def materialisations(monkeypatch):
    """How many times torch's own _materialize_cpp_cia_ops ran (a counter put under the memo)."""
    from torch._export import utils

    calls, original = [0], utils._materialize_cpp_cia_ops

    def counted():
        calls[0] += 1
        original()

    monkeypatch.setattr(utils, "_materialize_cpp_cia_ops", counted)
    return calls


def _decomposed():
    exported = torch.export.export(torch.nn.RMSNorm(8, eps=1e-6).eval(), (torch.zeros(2, 8),))
    return exported.run_decompositions().graph_module.code


@SLOW
def test_an_op_registered_between_two_exports_is_materialised(materialisations):
    plain_calls = materialisations[0]
    plain = _decomposed()
    plain_calls = materialisations[0] - plain_calls
    assert plain_calls > 1  # once a namespace, without the memo
    with cia_ops_materialized_once():
        before = materialisations[0]
        assert _decomposed() == plain and materialisations[0] == before + 1
        assert _decomposed() == plain and materialisations[0] == before + 1  # the same list: not again
        lib = torch.library.Library("parity_exporting_test", "FRAGMENT")
        lib.define("twice(Tensor x) -> Tensor")
        lib.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
        assert _decomposed() == plain and materialisations[0] == before + 2  # the list changed: again
        assert hasattr(torch.ops.parity_exporting_test.twice, "default")
    from torch._export import utils

    assert utils._materialize_cpp_cia_ops.__name__ == "counted"  # torch's own function back after the export


@SLOW
def test_an_executorch_program_is_byte_for_byte_the_one_without_it(materialisations):
    pytest.importorskip("executorch", reason="needs ExecuTorch: pip install --no-deps executorch==1.5.1 torchao")
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    def lowered():
        module = torch.nn.LayerNorm(8, eps=1e-5).eval().half()
        exported = torch.export.export(module, (torch.zeros(2, 8, dtype=torch.float16),))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()]).to_executorch().buffer

    before = materialisations[0]
    plain = lowered()
    plain_calls, before = materialisations[0] - before, materialisations[0]
    with cia_ops_materialized_once():
        memoised = lowered()
    assert memoised == plain
    assert plain_calls > 100 and materialisations[0] - before == 1  # three decompositions, ~200 namespaces each
