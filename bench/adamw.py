"""One AdamW step alone, ms: torch's fused kernel against foreach and the per-tensor loop.

    python bench/adamw.py [--sizes baby 124m]

``gptkiln.optim.make_optimizer`` asks for the fused kernel on CPU and CUDA; this is the
measurement behind that choice. gptkiln's decay / no-decay parameter groups over a GPT-2 layout
model (``baby``: 4 layers, 128 dims, vocab 65; ``124m``: GPT-2 small), random gradients, fp32,
2 threads; each kernel in a fresh process, the median over the timed steps after warm-up. The
peers use the per-tensor loop: it is torch's default for CPU parameters.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

SIZES = {
    "baby": dict(n_layer=4, n_head=4, n_embd=128, vocab=65, steps=50),
    "124m": dict(n_layer=12, n_head=12, n_embd=768, vocab=50257, steps=10),
}
KERNELS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "loop": dict(foreach=False)}


def worker(job: dict) -> None:
    torch = common.setup_torch(job.get("threads", common.THREADS))
    from gptkiln.optim import param_groups

    s = SIZES[job["size"]]
    model = common.gptkiln_gpt(dict(s, context=64))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(
        param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), **KERNELS[job["kernel"]]
    )
    times = common.time_calls(opt.step, warmup=3, repeats=s["steps"])
    common.emit({"ms": 1e3 * statistics.median(times)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--rounds", type=int, default=1, help="interleaved repeats of every process")
    args = p.parse_args()
    info = common.print_machine()
    rows = []
    for size in args.sizes:
        jobs = [dict(size=size, kernel=k) for k in KERNELS]
        results = common.run_rounds(__file__, jobs, args.rounds, "ms", best="min")
        fused = results[0]["ms"]
        for job, r in zip(jobs, results):
            rows.append(dict(size=size, kernel=job["kernel"], ratio=r["ms"] / fused, **r))
    print()
    common.print_table(
        rows,
        [
            ("size", "size"),
            ("kernel", "AdamW kernel"),
            ("ms", "ms/step"),
            ("ratio", "time vs fused"),
            ("others_cores", "others' cores"),
        ],
    )
    print(
        f"\n# load average now {common.machine()['loadavg_1m']:.2f} "
        f"(at start {info['loadavg_1m']:.2f})"
    )


if __name__ == "__main__":
    job = common.worker_args()
    worker(job) if job is not None else main()
