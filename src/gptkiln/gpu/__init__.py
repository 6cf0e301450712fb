"""The CUDA decode backend: the decode step with static shapes and sampling on the device
(`step`), compiled once per batch-size bucket and replayed as a CUDA graph (`graphs`), behind one
entry point, `prepare_graphs(model, rows, steps)`, a `gptkiln.sampling.Prepare` whose caller
(`gptkiln.api` on CUDA, bench/gpu.py) hands it to `sampling.generate_stream`.

The model stays plain (its caches made ``static`` from outside, as gpt-fast's are); sampling.py
imports nothing of this package. The same code runs on the CPU under ``torch.compile``, which is
how the tests hold it equal to the eager path where there is no GPU.
"""

from gptkiln.gpu.graphs import (
    GRAPHS_FROM,
    GraphDecoder,
    GraphPlan,
    RowGraphs,
    bucket_length,
    bucket_rows,
    compile_options,
    graphs_for,
    prepare_graphs,
    row_graphs_for,
)
from gptkiln.gpu.step import DeviceSampling, StaticState, decode_static, graph_step

__all__ = [
    "GRAPHS_FROM",
    "DeviceSampling",
    "GraphDecoder",
    "GraphPlan",
    "RowGraphs",
    "StaticState",
    "bucket_length",
    "bucket_rows",
    "compile_options",
    "decode_static",
    "graph_step",
    "graphs_for",
    "prepare_graphs",
    "row_graphs_for",
]
