"""Training steps of gptkiln and transformers taken in turn in ONE process: the paired ratio.

    python bench/paired_steps.py [--size baby] [--layout gpt2] [--rounds 300] [--no-compile]

A companion to `train_step.py` for machines whose speed drifts (the 2-core EPYCs lent to this
project move by 20-40% within a minute; see README.md). `train_step.py` runs every
implementation in a fresh process, as the benchmark rules ask, so its figures come from different
minutes. Here the implementations take one training step each in turn (the order rotating every
round), so every round sees the same machine, and the ratio is the median over rounds of the
peer's step time over gptkiln's. The price is what a shared process shares: one allocator
(gptkiln's `keep_freed_memory` setting, which at baby size changes nothing measurable; see
README.md), one thread pool, one cache. Rows: gptkiln eager and compiled, the peer eager and
compiled (``torch.compile``, default mode; compilation is in the untimed warm-up). The shapes,
models, optimizers and step are `train_step.py`'s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402
import train_step  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="baby", choices=list(train_step.SIZES))
    p.add_argument("--layout", default="gpt2", choices=list(train_step.LAYOUTS))
    p.add_argument("--rounds", type=int, default=300, help="timed steps of each implementation")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps of each, first")
    p.add_argument("--no-compile", action="store_true", help="eager rows only")
    args = p.parse_args()

    info = common.print_machine()
    torch = common.setup_torch()
    shape = train_step.SIZES[args.size]
    peer = train_step.PEER[args.layout]
    names = ["gptkiln", peer]
    if not args.no_compile:
        names += ["gptkiln (compiled)", f"{peer} (compiled)"]
    x = torch.randint(0, shape["vocab"], (shape["batch"], shape["context"]))
    y = torch.randint(0, shape["vocab"], (shape["batch"], shape["context"]))
    no_autocast = torch.autocast("cpu", enabled=False)
    steps = {}
    for name in names:
        job = dict(shape=shape, layout=args.layout, compile=name.endswith("(compiled)"))
        torch.manual_seed(0)
        model, opt, loss_fn = train_step.BUILDERS[name.split()[0]](job)
        model.train()
        steps[name] = lambda f=loss_fn, o=opt: common.training_step(f, o, x, y, no_autocast)
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            steps[name]()
        print(f"# {name}: {args.warmup} warm-up steps in {time.perf_counter() - t0:.1f} s")

    times = {name: [] for name in names}
    common.wait_for_quiet()
    others_cores = common.others_cores_meter(time.process_time)
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:  # a different implementation goes first each round
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    others = others_cores()

    tokens = shape["batch"] * shape["context"]
    rows = []
    for name in names:
        ms = statistics.median(times[name]) * 1e3
        row = dict(impl=name, ms=ms, tokens_per_s=tokens / ms * 1e3)
        if name.startswith("gptkiln"):
            for key, vs in (("vs_eager", peer), ("vs_compiled", f"{peer} (compiled)")):
                if vs in times:
                    row[key] = statistics.median(a / b for a, b in zip(times[vs], times[name]))
        rows.append(row)
    print()
    common.print_table(
        rows,
        [
            ("impl", "implementation"),
            ("tokens_per_s", "tokens/s (median step)"),
            ("ms", "ms/step"),
            ("vs_eager", f"paired ratio vs {peer}"),
            ("vs_compiled", f"paired ratio vs {peer} (compiled)"),
        ],
    )
    print(
        f"\n# {args.size}, {args.layout} layout, {args.rounds} rounds of one step each, in one "
        f"process; paired ratio = median over rounds of (the peer's step time / gptkiln's). "
        f"Others' cores while timing: {others:.2f}; load average at start "
        f"{info['loadavg_1m']:.2f}, now {common.machine()['loadavg_1m']:.2f}"
    )


if __name__ == "__main__":
    main()
