"""Attention on the CPU in training: SDPA against the explicit softmax, the kernels alone and the
recipes' whole steps, paired in one process.

    python bench/attention_steps.py [--threads 1] [--rounds 8] [--no-kernels] [--no-steps]

``kernels``: causal attention of 4 query and 2 key/value heads of 32 (qwen3-baby's) at each
context (batch sized to 768 positions a step, down to 1), forward and backward (or the forward
alone, without a gradient), bf16 and fp32: CPU microseconds a call, the median of the rounds.
``steps``: the default run's step (AdamW, batch 8, tied head) and the speedrun recipe's (Muon,
AdamW 8e-3, untied head, batch 12) on qwen3-baby with a 16,384-id vocabulary, in bf16 autocast
with the trainer's allocator (`gptkiln.allocator.keep_freed_memory`), gradient clipping and
optimizer step, each taken with SDPA (``EXPLICIT_GRAD_MAX_T = 0``) and with the model's choice
(`gptkiln.model._explicit_for_grad`), in alternating rounds: wall and CPU ms a step, and each
one's wall time over SDPA's, the median of the rounds' ratios. At one thread on a shared
machine the CPU time is the step's own cost; at two, only a quiet machine says anything.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402


def cpu_us(fn, rounds: int, calls: int = 10) -> float:
    fn(), fn()  # warm-up: oneDNN builds its kernels
    times = []
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(calls):
            fn()
        times.append((time.process_time() - start) / calls * 1e6)
    return statistics.median(times)


def kernels(torch, rounds: int) -> None:
    import torch.nn.functional as F

    from gptkiln.model import explicit_attention

    rows = []
    for T in (64, 128, 256, 512, 1024):
        B = max(1, 768 // T)
        for dtype in (torch.bfloat16, torch.float32):
            for grad in (True, False):
                q, k, v = (
                    torch.randn(B, h, T, 32, dtype=dtype, requires_grad=grad) for h in (4, 2, 2)
                )
                out_grad = torch.randn(B, 4, T, 32, dtype=dtype)

                def call(explicit: bool, q=q, k=k, v=v, grad=grad, out_grad=out_grad):
                    if explicit:
                        y = explicit_attention(q, k, v, None, 0.0)
                    else:
                        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    if grad:
                        y.backward(out_grad)

                sdpa = cpu_us(lambda call=call: call(False), rounds)
                spelled = cpu_us(lambda call=call: call(True), rounds)
                rows.append(
                    dict(
                        T=T,
                        B=B,
                        dtype=str(dtype).removeprefix("torch."),
                        grad="forward and backward" if grad else "forward, no gradient",
                        sdpa=sdpa,
                        explicit=spelled,
                        ratio=spelled / sdpa,
                    )
                )
    common.print_table(
        rows,
        [
            ("T", "T"),
            ("B", "batch"),
            ("dtype", "dtype"),
            ("grad", "what"),
            ("sdpa", "SDPA us (CPU)"),
            ("explicit", "explicit us (CPU)"),
            ("ratio", "explicit / SDPA"),
        ],
    )


def steps(torch, rounds: int) -> None:
    import gptkiln.model as model_module
    from gptkiln.allocator import keep_freed_memory
    from gptkiln.config import GPTConfig
    from gptkiln.optim import make_optimizer

    keep_freed_memory()  # as `gptkiln train`
    limit = model_module.EXPLICIT_GRAD_MAX_T
    built = {}
    for name, kind, batch, tie, lr, adamw_lr in (
        ("default (AdamW, batch 8)", "adamw", 8, True, 1e-3, None),
        ("speedrun (Muon, batch 12, untied)", "muon", 12, False, 2e-3, 8e-3),
    ):
        config = GPTConfig.from_name("qwen3-baby", vocab_size=16384, tie_embeddings=tie)
        model = model_module.GPT(config)
        optimizer = make_optimizer(model, lr, 0.1, (0.9, 0.95), kind, adamw_lr=adamw_lr)
        x, y = torch.randint(0, 16384, (2, batch, 64))
        built[name] = (model, optimizer, x, y)

    def step(model, optimizer, x, y) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for one in built.values():
        for _ in range(3):
            step(*one)
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for kernel, bound in (("SDPA", 0), ("explicit (the model's choice)", limit)):
            model_module.EXPLICIT_GRAD_MAX_T = bound
            for name, one in built.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                for _ in range(4):
                    step(*one)
                wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
                times.setdefault((name, kernel), []).append((wall / 4 * 1e3, cpu / 4 * 1e3))
    model_module.EXPLICIT_GRAD_MAX_T = limit
    rows = []
    for (name, kernel), t in times.items():
        sdpa = times[name, "SDPA"]
        rows.append(
            dict(
                name=name,
                kernel=kernel,
                wall=statistics.median(w for w, _ in t),
                cpu=statistics.median(c for _, c in t),
                ratio=statistics.median(w / s for (w, _), (s, _) in zip(t, sdpa, strict=True)),
            )
        )
    common.print_table(
        rows,
        [
            ("name", "step"),
            ("kernel", "attention"),
            ("wall", "wall ms a step (median)"),
            ("cpu", "CPU ms a step (median)"),
            ("ratio", "wall x SDPA's (paired median)"),
        ],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--no-kernels", action="store_true", help="the whole steps only")
    p.add_argument("--no-steps", action="store_true", help="the kernels only")
    args = p.parse_args()
    torch = common.setup_torch(args.threads)
    info = common.print_machine()
    print(f"# --threads {args.threads} (the line above names _common's default)")
    if not args.no_kernels:
        kernels(torch, args.rounds)
    if not args.no_steps:
        steps(torch, args.rounds)
    print(
        f"# load average at start {info['loadavg_1m']:.2f}, at end "
        f"{common.machine()['loadavg_1m']:.2f}"
    )


if __name__ == "__main__":
    main()
