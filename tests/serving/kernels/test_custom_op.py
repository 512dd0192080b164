"""The tree attention as the operator torch.ops.specheads.tree_attention_: it gives the
reference's output, its fake implementation traces without running a kernel, and
torch.compile keeps a function that calls it, directly or through the transformers attention
function, in one graph (fullgraph=True) with the same output. Under TRITON_INTERPRET the
operator is opaque to the compiler (serving/kernels/custom_op.py); on a GPU it is a
triton_op whose kernels inductor compiles (bench/gpu/kernels.py's parity section checks).
"""

from __future__ import annotations

import pytest
import torch

from test_tree_attention import make_inputs, relative_error

from specheads.serving.kernels.tree_attention import (
                                                      pack_tree_mask,
                                                      tree_attention,
                                                      tree_attention_forward,
                                                      tree_attention_reference,
                                                      )

PREFIX = 40


@pytest.fixture(scope="module")
def inputs():
    q, k, v, tree_mask = make_inputs(1, 2, 2, 9, PREFIX, 16, torch.float32, seed=1)
    return q, k, v, pack_tree_mask(tree_mask), tree_attention_reference(q, k, v, PREFIX, tree_mask)


def test_operator_gives_the_reference(inputs):
    from specheads.serving.kernels.custom_op import tree_attention_

    q, k, v, packed, ref = inputs
    out = torch.full_like(q, float("nan"))
    assert tree_attention_(q, k, v, packed[None], None, PREFIX, PREFIX, 16 ** -0.5, None, out) is None
    assert relative_error(out, ref) <= 1e-5
    lengths = torch.tensor([PREFIX])
    out_per_sequence = torch.ops.specheads.tree_attention_(q, k, v, packed[None], lengths, 0, PREFIX, 16 ** -0.5,
                                                           None, torch.empty_like(q))
    assert out_per_sequence is None


def test_fake_implementation_runs_no_kernel(inputs):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, packed, _ = inputs
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(x) for x in (q, k, v, packed)]
        out = tree_attention(*fakes[:3], PREFIX, fakes[3], impl="triton")
    assert out.shape == q.shape and out.dtype == q.dtype


def _graph_recorder(graphs: list):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend


def attention_layer(q, k, v, packed, lengths):
    """What a compiled verify forward does per layer: the transformers attention function
    with a device tensor of prefix lengths under a fixed bound (the CUDA-graph path)."""
    out_BTHD, _ = tree_attention_forward(None, q * 1.0, k, v, None, tree_mask=packed, prefix_len=lengths,
                                         max_prefix_len=PREFIX, tree_attention_impl="triton")
    return out_BTHD.transpose(1, 2) + 0.0


def test_compiled_attention_function_is_one_graph_with_the_operator(inputs):
    q, k, v, packed, ref = inputs
    graphs = []
    compiled = torch.compile(attention_layer, backend=_graph_recorder(graphs), fullgraph=True)
    assert relative_error(compiled(q, k, v, packed, torch.tensor([PREFIX])), ref) <= 1e-5
    (graph,) = graphs
    targets = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    assert "specheads.tree_attention_.default" in targets


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_call_gives_the_same_output(inputs, backend):
    q, k, v, packed, ref = inputs
    eager = tree_attention(q, k, v, PREFIX, packed, impl="triton")
    direct = torch.compile(lambda q, k, v, p: tree_attention(q, k, v, PREFIX, p, impl="triton") * 2.0,
                           backend=backend, fullgraph=True)
    assert torch.equal(direct(q, k, v, packed) / 2.0, eager)
    through_layer = torch.compile(attention_layer, backend=backend, fullgraph=True)
    assert torch.equal(through_layer(q, k, v, packed, torch.tensor([PREFIX])), eager)
    assert relative_error(eager, ref) <= 1e-5


def test_compiled_with_dynamic_prefix_lengths():
    # A DynamicCache forward: prefix_len defaults to the key length - T, a symbolic int once
    # dynamo makes the key length dynamic; one compiled graph serves every length.
    def layer(q, k, v, packed):
        out_BTHD, _ = tree_attention_forward(None, q, k, v, None, tree_mask=packed, tree_attention_impl="triton")
        return out_BTHD.transpose(1, 2) * 2.0

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    for prefix_len in (40, 57, 90):
        q, k, v, tree_mask = make_inputs(1, 2, 2, 9, prefix_len, 16, torch.float32, seed=prefix_len)
        out = compiled(q, k, v, pack_tree_mask(tree_mask)) / 2.0
        assert relative_error(out, tree_attention_reference(q, k, v, prefix_len, tree_mask)) <= 1e-5
