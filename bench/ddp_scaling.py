"""Training throughput on 1 and on 2 processes of this machine: the 1 -> 2 process scaling.

    python bench/ddp_scaling.py [--data SOURCE] [--model baby] [--batch 32] [--steps 20]

Every configuration trains the same global batch (one process with batch 2b, or two with b
each) with the same number of threads in all (``--threads``, the cores to use: one process with
all of them, or two with half each), so that "vs 1 process" says what splitting the work
across processes buys, not what more cores buy; "vs 1 thread" compares with one process on one
core. Each runs under torchrun (gloo on CPU) in fresh processes: the worker builds a real
`Trainer`, takes warm-up steps, then times ``train_step`` (forward, backward with the gradient
all-reduce or reduce-scatter, AdamW). The data is ``--data`` (a gptkiln source, by default
``shakespeare``, the bundled plays; the figures in bench/README.md took the book's
the-verdict.txt), char tokenizer, prepared once. Rounds are interleaved and the best of each
row counts, as a busy spell on a shared machine hits one round, not one row.

On 2 cores this is a figure, not a target: two processes compete for the same cores and
memory bandwidth as one process's two threads do, and pay for the all-reduce besides.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(spec: dict) -> None:
    """Under torchrun: time ``spec["steps"]`` training steps; rank 0 writes tokens/s."""
    import torch

    from gptkiln import distributed as du
    from gptkiln.config import TrainConfig
    from gptkiln.train import Trainer

    torch.set_num_threads(spec["threads"])
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    cfg = TrainConfig(
        data=spec["data"],
        out=spec["out"],
        model=spec["model"],
        context_length=spec["context"],
        batch_size=spec["batch"] // world_size,
        max_steps=spec["warmup"] + spec["steps"],
        parallel=spec["parallel"],
        optimizer="adamw",  # as measured before issue 47's default (Muon, WSD, windows)
        schedule="cosine",
        sampling="random",
        eval_train=False,
        progress=False,
        device="cpu",
        dropout=0.0,
    )
    trainer = Trainer(cfg, overwrite=True)
    total = trainer.batches.total_steps
    for _ in range(spec["warmup"]):
        trainer.train_step(total)
        trainer.step += 1
    du.barrier(trainer.world)
    start = time.perf_counter()
    for _ in range(spec["steps"]):
        trainer.train_step(total)
        trainer.step += 1
    du.barrier(trainer.world)
    seconds = time.perf_counter() - start
    if trainer.world.is_main:
        tokens = spec["steps"] * trainer.tokens_per_step
        Path(spec["result"]).write_text(json.dumps({"tokens_per_s": tokens / seconds}))
    trainer.close()


def measure(nproc: int, threads: int, parallel: str, args, tmp: Path, data: Path) -> float:
    """tokens/s of one configuration, in fresh processes launched by torchrun."""
    result = tmp / f"result-{nproc}-{parallel}.json"
    spec = dict(
        data=str(data),
        out=str(tmp / f"run-{nproc}-{parallel}"),
        model=args.model,
        context=args.context,
        batch=args.batch,
        steps=args.steps,
        warmup=args.warmup,
        parallel=parallel,
        threads=threads,
        result=str(result),
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        __file__,
        "--worker",
        json.dumps(spec),
    ]
    subprocess.run(cmd, env=env, check=True, timeout=900, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data",
        default="shakespeare",
        help="the corpus: a .txt/.md/.jsonl file, a folder of them, or 'shakespeare' (the "
        "bundled plays; the default)",
    )
    parser.add_argument("--model", default="baby", help="a gptkiln model preset")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="global batch (rows per step)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 2,
        help="cores to use in all (split across the processes)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the best one counts")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    from gptkiln.data.prepare import prepare
    from gptkiln.errors import GptkilnError

    with tempfile.TemporaryDirectory(prefix="gptkiln-ddp-bench-") as tmp:
        tmp = Path(tmp)
        try:
            prepare(args.data, tmp / "data", tokenizer="char", progress=False)
        except GptkilnError as e:
            sys.exit(f"--data: {e}")
        half = max(1, args.threads // 2)
        rows = [
            ("1 process", 1, args.threads, "ddp"),
            ("2 processes, DDP", 2, half, "ddp"),
            ("2 processes, FSDP2", 2, half, "fsdp"),
            ("1 process, 1 thread", 1, 1, "ddp"),
        ]
        best = {row: 0.0 for row in rows}
        for _ in range(args.repeats):
            for row in rows:
                best[row] = max(best[row], measure(*row[1:], args, tmp, tmp / "data"))
        print(
            f"data {args.data} (char), model {args.model}, context {args.context}, "
            f"global batch {args.batch}, "
            f"{args.steps} timed steps, {args.threads} threads in all, gloo on CPU, "
            f"best of {args.repeats}"
        )
        header = ("threads each", "tokens/s", "vs 1 process", "vs 1 thread")
        print(f"{'':20} {header[0]:>12} {header[1]:>10} {header[2]:>13} {header[3]:>12}")
        base, one_thread = best[rows[0]], best[rows[-1]]
        for row in rows:
            name, _, threads, _ = row
            print(
                f"{name:20} {threads:>12} {best[row]:>10,.0f} {best[row] / base:>12.2f}x "
                f"{best[row] / one_thread:>11.2f}x"
            )


if __name__ == "__main__":
    main()
