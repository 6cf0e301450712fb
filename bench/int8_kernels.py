"""Few-row products for decoding, int8 weights against fp32: every candidate at GPT-2 124M's shapes.

    python bench/int8_kernels.py [--rows 1 8] [--repeats 7] [--rounds 1]

The research behind the int8 kernels of `gptkiln.cpu` (its spec table, `gptkiln.cpu.specs`).
Each product runs over all the layers of a weight shape that GPT-2 124M has (12 of 768x2304
``c_attn``, 768x768 ``attn.c_proj``, 768x3072 ``c_fc``, 3072x768 ``mlp.c_proj``; one 768x50257
head), as decoding reads them, so the weights
stream from memory and not from a warm cache; random N(0, 0.02) weights, int8 per output
channel (`gptkiln.quantize.quantize_per_channel`), fp32 activations, 2 threads. The figure is
the median of ``--repeats`` passes after two warm-up ones (and, for compiled kernels, after
the compile); "a decode step" sums the five shapes: the products of one token (batch 1) or
one step of 8 rows.

Implementations, each in a fresh process:

- fp32: ``F.linear`` (MKL) and the other fp32 kernels of the spec table (row blocks of the
  weight, oneDNN's linear, ``few_rows``: the project's own loop, `gptkiln.cpu.products.
  few_rows_linear`): what gptkiln decodes with before quantization.
- int8, the tuner's exact candidates (int8 weights, fp32 activations): ``dequantize`` (the
  weight converted to fp32, one product, the scales after), ``int8pack_mm``
  (``aten._weight_int8pack_mm``), ``fused`` (the loop inductor generates from
  `gptkiln.cpu.products._int8_rows`), ``int8_rows`` (the project's own loop).
- rounding on purpose, each its precision's kernel: ``q8_rows`` (int8 weights, activations
  rounded to 8 bits in blocks of 32 as llama.cpp's q8_0; the ``int8`` precision, where the CPU
  has VNNI) and ``bf16_rows`` (a bf16 copy of each fp32 weight; the ``bf16`` precision).
  A kernel this machine does not offer (`gptkiln.cpu.specs.available`) is left out.
- int8, looked at and not candidates: ``torchao`` (``quantize_(Int8WeightOnlyConfig())`` on an
  ``nn.Linear``, torchao 0.18, eager) and ``torchao+compile`` (the same under ``torch.compile``);
  ``int8pack_mm bf16`` (torch's kernel with the activations rounded to bf16: its vectorised
  path on this build; another function than fp32's); ``fbgemm dynamic`` (``quantized::
  linear_dynamic``: the activations quantized to int8 too, so not weight-only).

"max rel err" is the largest difference from the reference (``F.linear`` for fp32, the
dequantized weight's ``F.linear`` for int8) over the largest output; "tuner" says whether
the tuner would accept it (`gptkiln.cpu.tuner._agrees`: ``allclose`` with rtol 1e-4, atol
1e-5, or for a kernel that rounds on purpose a relative error of at most 3%).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

SHAPES = [  # (out, in), layers of that shape in GPT-2 124M
    ((2304, 768), 12),
    ((768, 768), 12),
    ((3072, 768), 12),
    ((768, 3072), 12),
    ((50257, 768), 1),
]
FP32 = ["linear", "weight_rows", "input_rows", "onednn", "few_rows"]
INT8 = ["dequantize", "int8pack_mm", "fused", "int8_rows"]
ROUNDING = ["q8_rows", "bf16_rows"]  # the spec table's kernels of the int8 and bf16 precisions
OTHERS = ["torchao", "torchao+compile", "int8pack_mm bf16", "fbgemm dynamic"]
BYTES = {"bf16_rows": 2, **{name: 4 for name in FP32}}  # per weight read; int8: 1


def layers_of(torch, shape, count: int):
    """``count`` layers of ``shape``: (fp32 weight, int8 weight, scale, bias or None)."""
    from gptkiln.quantize import quantize_per_channel

    out = []
    for _ in range(count):
        w = torch.randn(shape) * 0.02
        q, s = quantize_per_channel(w)
        b = None if shape[0] == 50257 else torch.randn(shape[0]) * 0.01  # the head has none
        out.append((w, q, s, b))
    return out


def kernel_for(torch, impl: str, layer):
    """A function x -> y for one layer, and the reference it is compared with."""
    import torch.nn.functional as F

    from gptkiln.cpu import specs
    from gptkiln.quantize import dequantize

    w, q, s, b = layer
    if impl in specs.BY_NAME:
        spec = specs.BY_NAME[impl]
        if not specs.available(spec):
            return None
        k = spec.kernel
        if spec.weight == "float32":
            return (lambda x: k(x, w, b)), (lambda x: F.linear(x, w, b))
        return (lambda x: k(x, q, s, b)), (lambda x: F.linear(x, dequantize(q, s), b))
    reference = lambda x: F.linear(x, dequantize(q, s), b)  # noqa: E731
    if impl.startswith("torchao"):
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        m = torch.nn.Linear(w.size(1), w.size(0), bias=b is not None)
        with torch.no_grad():
            m.weight.copy_(w)
            if b is not None:
                m.bias.copy_(b)
        quantize_(m, Int8WeightOnlyConfig())
        # torchao's own quantization of w: its int8 values and scales are the reference
        tq, ts = m.weight.qdata, m.weight.scale.flatten().float()
        ref = lambda x: F.linear(x, dequantize(tq, ts), b)  # noqa: E731
        if impl == "torchao":
            return m, ref
        compiled = torch.compile(_own_code(_module_call), dynamic=False)
        return (lambda x: compiled(m, x)), ref
    if impl == "int8pack_mm bf16":
        sb = s.to(torch.bfloat16)
        return (
            lambda x: _add(torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q, sb), b)
        ), reference
    if impl == "fbgemm dynamic":
        torch.backends.quantized.engine = "x86"
        zeros = torch.zeros(w.size(0), dtype=torch.long)
        qw = torch.quantize_per_channel(dequantize(q, s), s.double(), zeros, 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qw, b)
        return (lambda x: torch.ops.quantized.linear_dynamic(x, packed)), reference
    raise ValueError(impl)


def _module_call(m, x):
    return m(x)


def _own_code(fn):
    """A copy of ``fn`` with its own code object: torch.compile keeps at most
    ``torch._dynamo.config.recompile_limit`` (8) graphs per code object, one per layer shape."""
    import types

    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)


def _add(y, b):
    y = y.float()
    return y if b is None else y + b


def worker(job: dict) -> None:
    torch = common.setup_torch(job.get("threads", common.THREADS))
    from gptkiln.cpu.tuner import _agrees

    impl = job["impl"]
    results = {}
    with torch.no_grad():
        for (shape, count), seed in zip(SHAPES, range(len(SHAPES))):
            torch.manual_seed(seed)
            layers = layers_of(torch, shape, count)
            fns = [kernel_for(torch, impl, layer) for layer in layers]
            if fns[0] is None:  # not offered on this machine
                return common.emit({"shapes": {}})
            for rows in job["rows"]:
                x = torch.randn(rows, shape[1])
                got, ref = fns[0][0](x).float(), fns[0][1](x)
                err = float((got - ref).abs().max() / ref.abs().max())
                accepted = _agrees(impl, got, ref)
                times = common.time_calls(
                    lambda x=x, fns=fns: [fn(x) for fn, _ in fns], warmup=2, repeats=job["repeats"]
                )
                sec = statistics.median(times)
                per_byte = BYTES.get(impl, 1)
                results[f"{rows}:{shape[0]}x{shape[1]}"] = {
                    "ms": 1e3 * sec,
                    "gb_s": shape[0] * shape[1] * count * per_byte / sec / 1e9,
                    "err": err,
                    "tuner": accepted,
                }
    common.emit({"shapes": results})


def bandwidth_worker(job: dict) -> None:
    """Read bandwidth: the best of 10 sums over a 512 MiB fp32 tensor, 2 threads."""
    torch = common.setup_torch(job.get("threads", common.THREADS))
    x = torch.ones(2**27)  # 512 MiB
    best = min(common.time_calls(x.sum, warmup=1, repeats=10))
    common.emit({"gb_s": x.numel() * 4 / best / 1e9})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rounds", type=int, default=1, help="interleaved repeats of every process")
    p.add_argument("--impls", nargs="+", default=FP32 + INT8 + ROUNDING + OTHERS)
    args = p.parse_args()
    info = common.print_machine()
    bandwidth = common.run_worker(__file__, {"impl": "bandwidth"})["gb_s"]
    jobs = [dict(impl=i, rows=args.rows, repeats=args.repeats) for i in args.impls]
    results: dict[str, dict] = {}
    for _ in range(args.rounds):  # the fastest round of each (shape, rows) is kept
        for job in jobs:
            r = common.run_worker(__file__, job)
            for key, v in r["shapes"].items():
                old = results.setdefault(job["impl"], {}).get(key)
                if old is None or v["ms"] < old["ms"]:
                    results[job["impl"]][key] = v
    for rows in args.rows:
        table = []
        for impl in args.impls:
            mine = results.get(impl, {}).items()
            cells = {k.split(":")[1]: v for k, v in mine if k.startswith(f"{rows}:")}
            if not cells:
                print(f"# {impl}: not offered on this machine (gptkiln.cpu.specs.available)")
                continue
            step = sum(v["ms"] for v in cells.values())
            row = {"impl": impl, "step": step}
            for shape, v in cells.items():
                row[shape] = f"{v['ms']:.2f} ({v['gb_s']:.1f})"
            row["err"] = max(v["err"] for v in cells.values())
            row["tuner"] = "yes" if all(v["tuner"] for v in cells.values()) else "no"
            table.append(row)
        fp32_best = min((r["step"] for r in table if r["impl"] in FP32), default=math.nan)
        for row in table:
            row["vs"] = fp32_best / row["step"]
        print(f"\n## {rows} row(s): ms over all layers of a shape (GB/s of weights read)\n")
        shapes = [f"{o}x{i}" for (o, i), _ in SHAPES]
        common.print_table(
            table,
            [("impl", "implementation")]
            + [(s, s) for s in shapes]
            + [
                ("step", "decode step ms"),
                ("vs", "speed vs best fp32"),
                ("err", "max rel err"),
                ("tuner", "tuner"),
            ],
        )
    print(
        f"\n# read bandwidth (sum over 512 MiB fp32, 2 threads): {bandwidth:.1f} GB/s; "
        f"load average now {common.machine()['loadavg_1m']:.2f} (at start "
        f"{info['loadavg_1m']:.2f})"
    )


if __name__ == "__main__":
    job = common.worker_args()
    if job is None:
        main()
    elif job["impl"] == "bandwidth":
        bandwidth_worker(job)
    else:
        worker(job)
