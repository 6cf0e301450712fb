"""GPU figures: bf16 + torch.compile training of GPT-2 124M at context 1024 (tokens/s and MFU), and
bf16 greedy generation, gptkiln against transformers in the same run.

    python bench/gpu.py [--batch 16] [--steps 20] [--no-compile] [--gen-batches 1 8]
    python bench/gpu.py --device cpu --smoke     # every code path on a CPU, tiny shapes, seconds

(Where gptkiln is not installed, as on a lent GPU machine: ``PYTHONPATH=src python3 bench/gpu.py``.)

Training step = forward + loss + backward + AdamW step + zero_grad, on a fixed random batch, with
fp32 weights and bf16 autocast, as ``gptkiln train`` runs on CUDA:

- gptkiln: ``GPT`` in the GPT-2 layout, ``torch.compile(model)``, ``gptkiln.optim.make_optimizer``
  (the fused AdamW kernel on CUDA);
- transformers: ``GPT2LMHeadModel`` (SDPA attention, tied head), ``torch.compile(model)``,
  ``torch.optim.AdamW(model.parameters(), fused=True)``.

Each runs in a fresh process; the compile and the first steps are warm-up, excluded; the figure
is the median step time (CUDA synchronised) over ``--steps``. MFU = tokens/s x FLOPs per token /
peak, with FLOPs per token = 6 N + 12 L T C (``GPT.flops_per_token``: N parameters without
position embeddings, L layers, T context, C width; PaLM, appendix B), and the peak the GPU's
dense bf16 figure from its data sheet (H100/H200 SXM 989 TFLOP/s, A100 312; ``--peak-tflops``
for others). A bf16 8192^3 matmul measured in the same run gives the practical ceiling beside it.

Generation: a 124M-shaped model with random weights cast to bf16, an 8-token prompt per row, 200
new greedy tokens at batch 1 and 8: ``gptkiln.sampling.generate`` (static KV cache) against
``GPT2LMHeadModel.generate(use_cache=True, min_new_tokens=200)``; tokens/s counts every row.
``gptkiln int8`` is the same model after ``gptkiln.quantize.quantize_model`` (int8 weights,
per-channel scales, bf16 activations); on a GPU its products are the dequantized ones
(`gptkiln.cpu.products.dequantize_linear`: the decoding tuner times kernels on the CPU only).
``gptkiln graphs`` is ``generate`` with ``gptkiln.gpu.prepare_graphs`` (what ``gptkiln
generate`` runs on CUDA: the decode step compiled with ``mode="reduce-overhead"``, a CUDA graph
per bucket, greedy on the device), against ``transformers static``: ``generate`` with
``cache_implementation="static"``, which compiles the forward the same way on CUDA (on a CPU
neither captures a graph: the smoke run checks the code paths). Their warm-up (the compile) is
timed apart; ``same ids`` is the share of rows whose ids equal the eager path's in the process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402
import generate as generate_bench  # noqa: E402

SHAPE = dict(vocab=50257, context=1024, n_layer=12, n_head=12, n_embd=768)
SMOKE_SHAPE = dict(vocab=256, context=64, n_layer=2, n_head=2, n_embd=64)
PROMPT_LEN = 8
LR, WEIGHT_DECAY = 6e-4, 0.1
# dense bf16 TFLOP/s from the data sheets, the most specific name first
PEAK_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.4,  # SXM
    "H200": 989.4,
    "A100": 312.0,
}


def peak_tflops(device_name: str) -> float | None:
    for key, tflops in PEAK_TFLOPS.items():
        if key in device_name:
            return tflops
    return None


# -- workers -----------------------------------------------------------------------------------
def _sync(torch, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(torch, device: str, fn, warmup: int, repeats: int) -> list[float]:
    """Seconds per call of fn, each call synchronised, after ``warmup`` calls."""

    def call():
        fn()
        _sync(torch, device)

    return common.time_calls(call, warmup, repeats)


def _peak_memory_mb(torch, device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None


def matmul_worker(job: dict) -> None:
    torch = common.setup_torch()
    n, device = job["n"], job["device"]
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = _timed(torch, device, lambda: a @ b, warmup=3, repeats=job["repeats"])
    common.emit({"tflops": 2 * n**3 / statistics.median(times) / 1e12})


def train_worker(job: dict) -> None:
    torch = common.setup_torch()
    device, s = job["device"], job["shape"]
    if job["impl"] == "gptkiln":
        from gptkiln.optim import make_optimizer

        model = common.gptkiln_gpt(s, "gpt2").to(device)
        opt = make_optimizer(model, LR, WEIGHT_DECAY, (0.9, 0.95))
        flops_per_token = model.flops_per_token(s["context"])
        forward = torch.compile(model) if job["compile"] else model

        def loss_fn(x, y):
            return forward(x, y)[1]
    else:
        vocab = s["vocab"]
        model = common.hf_gpt2(
            s, bos_token_id=vocab - 1, eos_token_id=vocab - 1, tie_word_embeddings=True
        ).to(device)
        fused = device.startswith("cuda")
        opt = torch.optim.AdamW(
            model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=fused or None
        )
        flops_per_token = None
        forward = torch.compile(model) if job["compile"] else model

        def loss_fn(x, y):
            return forward(input_ids=x, labels=x).loss  # labels are shifted inside

    model.train()
    x = torch.randint(0, s["vocab"], (job["batch"], s["context"]), device=device)
    y = torch.randint(0, s["vocab"], (job["batch"], s["context"]), device=device)
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16)
    losses = []

    def step():
        losses.append(common.training_step(loss_fn, opt, x, y, autocast))

    t0 = time.perf_counter()
    for _ in range(job["warmup"]):
        step()
    _sync(torch, device)
    warmup_s = time.perf_counter() - t0
    times = _timed(torch, device, step, warmup=0, repeats=job["steps"])
    sec = statistics.median(times)
    first, last = float(losses[0]), float(losses[-1])
    if not last < first:  # a fixed batch must be learnt: a broken step is not a fast one
        raise RuntimeError(f"loss did not fall on a fixed batch: {first:.3f} -> {last:.3f}")
    common.emit(
        {
            "tokens_per_s": job["batch"] * s["context"] / sec,
            "ms_per_step": sec * 1e3,
            "warmup_s": warmup_s,
            "flops_per_token": flops_per_token,
            "loss_first_last": [first, last],
            "peak_gpu_mb": _peak_memory_mb(torch, device),
            "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        }
    )


def generate_worker(job: dict) -> None:
    torch = common.setup_torch()
    device, s, n = job["device"], job["shape"], job["new_tokens"]
    gen = torch.Generator().manual_seed(1234)
    idx = torch.randint(0, s["vocab"], (job["batch"], PROMPT_LEN), generator=gen).to(device)
    if job["impl"] in ("gptkiln", "gptkiln graphs"):
        model = common.gptkiln_gpt(s, "gpt2")
    elif job["impl"] == "gptkiln int8":
        from gptkiln.quantize import quantize_model

        model = quantize_model(common.gptkiln_gpt(s, "gpt2").eval())
    else:
        model = common.hf_gpt2(s, bos_token_id=s["vocab"] - 1, eos_token_id=s["vocab"] - 1)
    model = model.to(device, torch.bfloat16).eval()  # int8 weights stay int8
    compiled = job["impl"] in COMPILED
    run_n = compiled_generator(job["impl"], model) if compiled else None
    run_n = run_n or generate_bench.generator_for(job["impl"].split()[0], model)

    def run(k):
        return run_n(idx, k)

    with torch.inference_mode():
        t0 = time.perf_counter()
        first = run(n if compiled else 8)  # warm-up: kernels picked (graphs compiled), memory taken
        _sync(torch, device)
        warmup_s = time.perf_counter() - t0
        times = _timed(torch, device, lambda: run(n), warmup=0, repeats=job["repeats"])
        out = run(2)
        same = None
        if job["impl"] == "gptkiln graphs":  # the eager path's greedy ids, in this process
            eager = generate_bench.generator_for("gptkiln", model)(idx, n)
            same = (torch.as_tensor(first).cpu() == eager.cpu()).all(dim=1).float().mean().item()
    assert len(out) == job["batch"], len(out)
    sec = statistics.median(times)
    common.emit(
        {
            "tokens_per_s": job["batch"] * n / sec,
            "ms_per_token": 1e3 * sec / n,
            "peak_gpu_mb": _peak_memory_mb(torch, device),
            "warmup_s": warmup_s if compiled else None,
            "same_ids": same,
        }
    )


COMPILED = ("gptkiln graphs", "transformers static")


def compiled_generator(impl: str, model):
    """(prompt ids (B, T), n) -> new ids (B, n) for the compiled rows (`COMPILED`)."""
    import torch

    if impl == "gptkiln graphs":
        from functools import partial

        from gptkiln.gpu import prepare_graphs
        from gptkiln.sampling import generate

        prepare = partial(prepare_graphs, min_steps=1)  # the smoke run's 8 tokens too

        def run(idx, n):
            ids = generate(model, idx.tolist(), max_new_tokens=n, temperature=0, prepare=prepare)
            return torch.tensor(ids)

        return run

    def run(idx, n):  # transformers' static cache: its forward compiled on CUDA
        out = model.generate(
            idx,
            attention_mask=torch.ones_like(idx),
            do_sample=False,
            use_cache=True,
            cache_implementation="static",
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=model.config.eos_token_id,
        )
        return out[:, idx.size(1) :]

    return run


def worker(job: dict) -> None:
    {"matmul": matmul_worker, "train": train_worker, "generate": generate_worker}[job["job"]](job)


# -- driver ------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=16, help="training rows of 1024 tokens")
    p.add_argument("--steps", type=int, default=20, help="timed training steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (the compile is in them)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--gen-batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3, help="timed generation calls")
    p.add_argument("--rounds", type=int, default=1, help="interleaved repeats of every process")
    p.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, for MFU")
    p.add_argument(
        "--parts", nargs="+", default=["train", "generate"], choices=["train", "generate"]
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes and few steps: check the code paths"
    )
    args = p.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench/gpu.py: no CUDA device here; --device cpu --smoke checks the code paths")
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    if args.smoke:
        args.batch, args.steps, args.warmup, args.new_tokens, args.repeats = 2, 3, 2, 8, 1
    compile_ = not args.no_compile

    common.print_machine()
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    peak = args.peak_tflops or peak_tflops(gpu)
    mm = common.run_worker(
        __file__,
        dict(job="matmul", device=args.device, n=512 if args.smoke else 8192, repeats=10),
    )["tflops"]
    print(f"# {gpu}: bf16 matmul {mm:.1f} TFLOP/s measured; data-sheet peak {peak} TFLOP/s")

    if "train" in args.parts:
        train_part(args, shape, compile_, peak, mm)
    if "generate" in args.parts:
        generate_part(args, shape)


def train_part(args, shape: dict, compile_: bool, peak: float | None, mm: float) -> None:
    train_jobs = [
        dict(
            job="train",
            impl=impl,
            device=args.device,
            shape=shape,
            batch=args.batch,
            steps=args.steps,
            warmup=args.warmup,
            compile=compile_,
        )
        for impl in ("gptkiln", "transformers")
    ]
    results = common.run_rounds(__file__, train_jobs, args.rounds, "tokens_per_s")
    flops = results[0]["flops_per_token"]  # same shapes, same FLOPs per token for both
    rows = []
    for job, r in zip(train_jobs, results):
        achieved = r["tokens_per_s"] * flops / 1e12  # TFLOP/s
        rows.append(
            dict(
                impl=job["impl"],
                **r,
                tflops=achieved,
                mfu=100 * achieved / peak if peak else None,
                of_matmul=100 * achieved / mm,
                ratio=common.ratio(results[0]["tokens_per_s"], r["tokens_per_s"])
                if job["impl"] != "gptkiln"
                else None,
            )
        )
    print(
        f"\n## training, bf16 autocast{' + torch.compile' if compile_ else ''}, "
        f"batch {args.batch} x context {shape['context']}, {flops / 1e6:.0f} MFLOP per token\n"
    )
    common.print_table(
        rows,
        [
            ("impl", "implementation"),
            ("tokens_per_s", "tokens/s"),
            ("ms_per_step", "ms/step"),
            ("tflops", "TFLOP/s"),
            ("mfu", "MFU %"),
            ("of_matmul", "% of measured matmul"),
            ("ratio", "gptkiln ratio"),
            ("peak_gpu_mb", "peak GPU MB"),
            ("warmup_s", "warm-up s"),
            ("loss_first_last", "loss first / last"),
        ],
    )


def generate_part(args, shape: dict) -> None:
    rows = []
    for batch in args.gen_batches:
        jobs = [
            dict(
                job="generate",
                impl=impl,
                device=args.device,
                shape=shape,
                batch=batch,
                new_tokens=args.new_tokens,
                repeats=args.repeats,
            )
            for impl in (
                "gptkiln",
                "gptkiln graphs",
                "gptkiln int8",
                "transformers",
                "transformers static",
            )
        ]
        results = common.run_rounds(__file__, jobs, args.rounds, "tokens_per_s")
        kiln, graphs = results[0]["tokens_per_s"], results[1]["tokens_per_s"]
        for job, r in zip(jobs, results):
            row = dict(batch=batch, impl=job["impl"], **r)
            if job["impl"] != "gptkiln":
                row["ratio"] = common.ratio(kiln, r["tokens_per_s"])
            if job["impl"] != "gptkiln graphs":
                row["graphs_ratio"] = common.ratio(graphs, r["tokens_per_s"])
            rows.append(row)
    print(
        f"\n## generation, bf16 weights (gptkiln int8: int8 weights, bf16 activations), "
        f"{PROMPT_LEN}-token prompt, {args.new_tokens} new greedy tokens per row\n"
    )
    common.print_table(
        rows,
        [
            ("batch", "batch"),
            ("impl", "implementation"),
            ("tokens_per_s", "new tokens/s"),
            ("ms_per_token", "ms/step"),
            ("ratio", "gptkiln ratio"),
            ("graphs_ratio", "graphs ratio"),
            ("peak_gpu_mb", "peak GPU MB"),
            ("warmup_s", "warm-up s"),
            ("same_ids", "same ids"),
        ],
    )
    print("\n# 'gptkiln ratio' = gptkiln tokens/s / that row's tokens/s")
    print("# 'graphs ratio' = gptkiln graphs tokens/s / that row's tokens/s")


if __name__ == "__main__":
    job = common.worker_args()
    worker(job) if job is not None else main()
