"""Training-step throughput, tokens/s: gptkiln against transformers and the book's model.

    python bench/train_step.py [--sizes baby 124m] [--rounds 3] [--compile] [--malloc-keep] [--bf16]

With ``--compile``, gptkiln and its peers also run under ``torch.compile`` (default mode;
compilation falls in the untimed warm-up steps), gptkiln's compiled row compared with the
eager peer (``ratio``, as ``gptkiln train --compile`` against the peer as its project runs it by
default) and with the compiled peer (``ratio vs compiled``); with ``--bf16`` too, compiled rows
under bf16 autocast as well, compared the same way with the peer's bf16 rows.

One step = forward + loss + backward + AdamW step + zero_grad, fp32, dropout 0, 2 threads, on a
fixed random batch. Every implementation runs in a fresh process; warm-up steps are excluded and
the figure is the median step time over the timed steps (then the best round). Rounds run
every implementation once each, interleaved; ``ratio`` divides the best rounds and ``ratio,
paired rounds`` is the median over rounds of the ratio within a round (baby: 4 rounds, 124M:
2). Each implementation is used as its own project uses it:

- gptkiln: ``GPT(config)(x, y)`` returns the loss; ``gptkiln.optim.make_optimizer`` (decay groups,
  the AdamW kernel gptkiln picks); ``gptkiln.allocator.keep_freed_memory()`` first, as the
  ``gptkiln train`` command does on CPU (glibc keeps freed blocks: no page faults per step).
- transformers: ``GPT2LMHeadModel`` with SDPA attention, ``model(input_ids=x, labels=x).loss``,
  ``torch.optim.AdamW(model.parameters())`` (torch's default kernel choice).
- the book: ``llms_from_scratch.ch04.GPTModel``, ``cross_entropy(logits.flatten(0, 1), y)`` as in
  its ``calc_loss_batch``, ``torch.optim.AdamW(model.parameters())`` as in its chapter 5.

Pairs with identical shapes: gptkiln's GPT-2 layout (qkv bias, tied head) against transformers,
its book layout (no qkv bias, untied head: the ``book-124m`` preset) against the book's model.
With ``--malloc-keep`` the peers also run a second time with glibc set the same way (through
its environment variables), and the gptkiln rows get a second ratio against those: what is left
of the lead when the peer gets the same allocator treatment.
With ``--bf16`` every implementation also runs under ``torch.autocast("cpu", torch.bfloat16)``
(fp32 weights and optimizer, as ``gptkiln train --precision bf16``), and those gptkiln rows are
compared with the peers' bf16 rows; it pays on CPUs with AMX, where bf16 matmuls run several
times faster than fp32 ones.
Sizes: ``baby`` (4 layers, 4 heads, 128 dims, context 64, batch 12, vocab 65) and ``124m``
(12 layers, 12 heads, 768 dims, context 256, batch 2, vocab 50257).

gptkiln's achieved FLOP/s use ``GPT.flops_per_token``: 6 N + 12 L T C per token (N parameters
of the matmuls: without position embeddings, and without the token embedding when the head is
untied; L layers, T context, C width), compared with an fp32 matmul peak
measured in the same run (2048^2, the faster of MKL and oneDNN).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

SIZES = {
    "baby": dict(
        n_layer=4,
        n_head=4,
        n_embd=128,
        context=64,
        batch=12,
        vocab=65,
        warmup=10,
        steps=60,
        rounds=4,
    ),
    "124m": dict(
        n_layer=12,
        n_head=12,
        n_embd=768,
        context=256,
        batch=2,
        vocab=50257,
        warmup=3,
        steps=5,
        rounds=2,
    ),
}
LAYOUTS = common.LAYOUTS
PEER = {"gpt2": "transformers", "book": "book"}
# What gptkiln.allocator.keep_freed_memory sets with mallopt (no mmap, no trimming), as glibc
# environment variables, for the peers' "(malloc keep)" rows; plus a 256 MB top pad, which
# gptkiln does not set: fewer heap growths for the peers, if anything in their favour.
MALLOC_KEEP = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "100000000000",
    "MALLOC_TOP_PAD_": str(256 << 20),
}
LR, WEIGHT_DECAY = 4e-4, 0.1


# -- workers -----------------------------------------------------------------------------------
def build_gptkiln(job: dict):
    import torch

    from gptkiln.optim import make_optimizer

    if not job.get("no_keep"):
        from gptkiln.allocator import keep_freed_memory

        keep_freed_memory()
    model = common.gptkiln_gpt(job["shape"], job["layout"])
    kind = job.get("optimizer", "gptkiln")
    if kind == "gptkiln":
        opt = make_optimizer(model, LR, WEIGHT_DECAY, (0.9, 0.95))
    else:  # an explicit AdamW kernel, for measuring the choice
        from gptkiln.optim import param_groups

        flags = {
            "fused": dict(fused=True),
            "foreach": dict(foreach=True),
            "loop": dict(foreach=False),
        }[kind]
        opt = torch.optim.AdamW(
            param_groups(model, WEIGHT_DECAY), lr=LR, betas=(0.9, 0.95), **flags
        )
    forward = torch.compile(model) if job.get("compile") else model

    def loss_fn(x, y):
        return forward(x, y)[1]

    return model, opt, loss_fn


def build_transformers(job: dict):
    import torch

    vocab = job["shape"]["vocab"]
    model = common.hf_gpt2(
        job["shape"], bos_token_id=vocab - 1, eos_token_id=vocab - 1, tie_word_embeddings=True
    )
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    forward = torch.compile(model) if job.get("compile") else model

    def loss_fn(x, y):
        return forward(input_ids=x, labels=x).loss  # labels are shifted inside

    return model, opt, loss_fn


def build_book(job: dict):
    import torch
    import torch.nn.functional as F
    from llms_from_scratch.ch04 import GPTModel

    s = job["shape"]
    model = GPTModel(
        {
            "vocab_size": s["vocab"],
            "context_length": s["context"],
            "emb_dim": s["n_embd"],
            "n_heads": s["n_head"],
            "n_layers": s["n_layer"],
            "drop_rate": 0.0,
            "qkv_bias": False,
        }
    )
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    forward = torch.compile(model) if job.get("compile") else model

    def loss_fn(x, y):
        return F.cross_entropy(forward(x).flatten(0, 1), y.flatten())  # the book's calc_loss_batch

    return model, opt, loss_fn


BUILDERS = {"gptkiln": build_gptkiln, "transformers": build_transformers, "book": build_book}


def worker(job: dict) -> None:
    torch = common.setup_torch(job.get("threads", common.THREADS))
    s = job["shape"]
    model, opt, loss_fn = BUILDERS[job["impl"]](job)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randint(0, s["vocab"], (s["batch"], s["context"]))
    y = torch.randint(0, s["vocab"], (s["batch"], s["context"]))

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(job.get("bf16")))

    def step():
        common.training_step(loss_fn, opt, x, y, autocast)

    times = common.time_calls(step, warmup=s["warmup"], repeats=s["steps"])
    sec = statistics.median(times)
    out = {
        "tokens_per_s": s["batch"] * s["context"] / sec,
        "ms_per_step": sec * 1e3,
        "params": n_params,
    }
    if job["impl"] == "gptkiln":
        out["flops_per_token"] = model.flops_per_token(s["context"])
    common.emit(out)


# -- driver ------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved repeats of every process (default: 4 baby, 2 124m)",
    )
    p.add_argument(
        "--optimizers",
        nargs="+",
        default=["gptkiln"],
        choices=["gptkiln", "fused", "foreach", "loop"],
        help="extra gptkiln rows with an explicit AdamW kernel",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="add torch.compile'd rows: gptkiln (compared with the eager peer, and with the "
        "compiled peer in 'ratio vs compiled') and the peer",
    )
    p.add_argument(
        "--bf16", action="store_true", help="also run every implementation under bf16 autocast"
    )
    p.add_argument(
        "--malloc-keep",
        action="store_true",
        help="also run the peers with glibc told to keep freed memory "
        f"({' '.join(f'{k}={v}' for k, v in MALLOC_KEEP.items())}), as gptkiln does, and a "
        "gptkiln row without it",
    )
    args = p.parse_args()

    info = common.print_machine()
    peaks = common.matmul_peak_gflops()
    peak = peaks["best"]
    print(
        f"# fp32 matmul peak (2048^2, {common.THREADS} threads): {peak:.1f} GFLOP/s, the best of "
        + ", ".join(f"{k} {peaks[k]:.1f}" for k in ("mkl", "onednn") if k in peaks)
    )
    rows = []
    for size in args.sizes:
        shape = SIZES[size]
        jobs = []
        for layout in args.layouts:
            for kind in args.optimizers:
                jobs.append(dict(impl="gptkiln", layout=layout, optimizer=kind))
            if args.compile:
                jobs.append(dict(impl="gptkiln", layout=layout, compile=True))
            jobs.append(dict(impl=PEER[layout], layout=layout))
            if args.compile:
                jobs.append(dict(impl=PEER[layout], layout=layout, compile=True))
            if args.malloc_keep:
                jobs.append(dict(impl="gptkiln", layout=layout, no_keep=True))
                jobs.append(dict(impl=PEER[layout], layout=layout, env=MALLOC_KEEP))
            if args.bf16:
                jobs.append(dict(impl="gptkiln", layout=layout, bf16=True))
                jobs.append(dict(impl=PEER[layout], layout=layout, bf16=True))
            if args.bf16 and args.compile:
                jobs.append(dict(impl="gptkiln", layout=layout, bf16=True, compile=True))
                jobs.append(dict(impl=PEER[layout], layout=layout, bf16=True, compile=True))
        for job in jobs:
            job["shape"] = shape
        results = common.run_rounds(__file__, jobs, args.rounds or shape["rounds"], "tokens_per_s")
        peers = {
            (j["layout"], bool(j.get("env")), bool(j.get("bf16")), bool(j.get("compile"))): r
            for j, r in zip(jobs, results)
            if j["impl"] != "gptkiln"
        }
        for job, r in zip(jobs, results):
            name = job["impl"]
            if job.get("optimizer", "gptkiln") != "gptkiln":
                name += f" (AdamW {job['optimizer']})"
            if job.get("compile"):
                name += " (compiled)"
            if job.get("env"):
                name += " (malloc keep)"
            if job.get("no_keep"):
                name += " (glibc default)"
            bf16 = bool(job.get("bf16"))
            if bf16:
                name += " (bf16 autocast)"
            row = dict(size=size, layout=job["layout"], impl=name, **r)
            if job["impl"] == "gptkiln":
                peer = peers[(job["layout"], False, bf16, False)]
                row["ratio"] = common.ratio(r["tokens_per_s"], peer["tokens_per_s"])
                row["ratio_paired"] = common.paired_ratio(
                    r["tokens_per_s_rounds"], peer["tokens_per_s_rounds"]
                )
                if (job["layout"], True, False, False) in peers and not bf16:
                    kept_peer = peers[(job["layout"], True, False, False)]["tokens_per_s"]
                    row["ratio_keep"] = common.ratio(r["tokens_per_s"], kept_peer)
                if job.get("compile"):
                    compiled_peer = peers[(job["layout"], False, bf16, True)]
                    row["ratio_compiled"] = common.ratio(
                        r["tokens_per_s"], compiled_peer["tokens_per_s"]
                    )
                row["vs"] = PEER[job["layout"]] + (" (bf16)" if bf16 else "")
                achieved = r["tokens_per_s"] * r["flops_per_token"] / 1e9
                row["gflops"] = achieved
                row["of_peak"] = None if bf16 else 100 * achieved / peak  # the peak is fp32
            rows.append(row)
    print()
    common.print_table(
        rows,
        [
            ("size", "size"),
            ("layout", "layout"),
            ("impl", "implementation"),
            ("tokens_per_s", "tokens/s"),
            ("ms_per_step", "ms/step"),
            ("ratio", "ratio"),
            ("ratio_paired", "ratio, paired rounds"),
            ("ratio_keep", "ratio vs kept"),
            ("ratio_compiled", "ratio vs compiled"),
            ("vs", "vs"),
            ("gflops", "GFLOP/s"),
            ("of_peak", "% of peak"),
            ("peak_rss_mb", "peak RSS MB"),
            ("tokens_per_s_rounds", "tokens/s per round"),
            ("others_cores", "others' cores"),
        ],
    )
    print(
        f"\n# GFLOP/s = tokens/s x GPT.flops_per_token(T) = tokens/s x (6N + 12 L T C), N the "
        f"parameters of the matmuls (without position embeddings, and without the token "
        f"embedding when the head is untied, as in the book layout: a lookup). "
        f"peak = {peak:.1f} GFLOP/s. 'ratio' divides the best rounds; 'ratio, paired rounds' is "
        f"the median over rounds of the ratio within a round. Load average now "
        f"{common.machine()['loadavg_1m']:.2f} (at start {info['loadavg_1m']:.2f})"
    )


if __name__ == "__main__":
    job = common.worker_args()
    worker(job) if job is not None else main()
