"""Greedy generation throughput, new tokens/s: gptkiln (fp32 and int8) against transformers and
the book.

    python bench/generate.py [--batches 1 8] [--new-tokens 200] [--repeats 3] [--book-batch8]
                             [--no-check] [--no-int8] [--head-float]

A GPT-2 124M-shaped model with random weights (fp32, 2 threads), an 8-token prompt per row,
200 new greedy tokens, batch 1 and batch 8; tokens/s counts every row's new tokens. Each
implementation runs in a fresh process; one short warm-up call is excluded (it also tunes the
decoding kernels, and for int8 compiles the fused one) and the figure is the median over
``--repeats`` full calls, except for the book's: one full call (it recomputes the whole sequence
for every token, a call takes about a minute at 124M), so its row is that call.

- gptkiln: ``gptkiln.sampling.generate(model, prompts, temperature=0, max_new_tokens=200)``
  (static KV cache, the default).
- gptkiln int8: the same model (same seed, same weights) after
  ``gptkiln.quantize.quantize_model`` (int8 weights, per-channel scales; head and token
  embedding int8 too); with ``--head-float``, one more row with the head and token embedding
  kept fp32.
- transformers: ``GPT2LMHeadModel`` (SDPA attention) ``.generate(do_sample=False,
  use_cache=True, max_new_tokens=200, min_new_tokens=200)``, so it never stops early.
- the book: ``llms_from_scratch.ch04.generate_text_simple`` (no cache: every step re-runs the
  whole sequence). At batch 8 it takes minutes, so it runs only with ``--book-batch8``.

gptkiln and transformers share the GPT-2 layout (qkv bias, tied head); the book's model has its
own (no qkv bias, untied head), which costs the same per token. Unless ``--no-check``, one more
process copies a book model's weights into gptkiln and transformers (``gptkiln.interop``) and
checks that all three pick the same greedy tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

SHAPE = dict(vocab=50257, context=1024, n_layer=12, n_head=12, n_embd=768)
PROMPT_LEN = 8


def prompts(batch: int, vocab: int):
    import torch

    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (batch, PROMPT_LEN), generator=gen)  # (B, T)


def gptkiln_model(layout: str = "gpt2"):
    return common.gptkiln_gpt(SHAPE, layout).eval()


def gptkiln_int8_model(embedding_and_head: bool = True):
    from gptkiln.quantize import quantize_model

    return quantize_model(gptkiln_model(), embedding_and_head=embedding_and_head)


def hf_model(config_dict: dict | None = None):
    if config_dict is None:
        return common.hf_gpt2(SHAPE).eval()
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel._from_config(
        GPT2Config(**config_dict), attn_implementation="sdpa"
    ).eval()


def book_model():
    from llms_from_scratch.ch04 import GPTModel

    return GPTModel(
        {
            "vocab_size": SHAPE["vocab"],
            "context_length": SHAPE["context"],
            "emb_dim": SHAPE["n_embd"],
            "n_heads": SHAPE["n_head"],
            "n_layers": SHAPE["n_layer"],
            "drop_rate": 0.0,
            "qkv_bias": False,
        }
    ).eval()


def generator_for(impl: str, model):
    """A function (prompt ids (B, T), n) -> new ids (B, n) for this implementation."""
    import torch

    if impl == "gptkiln":
        from gptkiln.cpu import prepare_for_decoding
        from gptkiln.sampling import generate

        def run(idx, n):  # the CPU backend prepared as `gptkiln generate` prepares it
            ids = idx.tolist()
            new = generate(
                model, ids, max_new_tokens=n, temperature=0, prepare=prepare_for_decoding
            )
            return torch.tensor(new)
    elif impl == "transformers":

        def run(idx, n):
            out = model.generate(
                idx,
                attention_mask=torch.ones_like(idx),
                do_sample=False,
                use_cache=True,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=model.config.eos_token_id,
            )
            return out[:, idx.size(1) :]
    else:
        from llms_from_scratch.ch04 import generate_text_simple

        def run(idx, n):
            return generate_text_simple(model, idx, n, SHAPE["context"])[:, idx.size(1) :]

    return run


def worker(job: dict) -> None:
    torch = common.setup_torch(job.get("threads", common.THREADS))
    if job["impl"] == "check":
        return check_same_tokens(job)
    impl = job["impl"]
    model = {
        "gptkiln": gptkiln_model,
        "gptkiln int8": gptkiln_int8_model,
        "gptkiln int8, head fp32": lambda: gptkiln_int8_model(embedding_and_head=False),
        "transformers": hf_model,
        "book": book_model,
    }[impl]()
    run = generator_for(impl.split()[0], model)
    idx = prompts(job["batch"], SHAPE["vocab"])
    n = job["new_tokens"]
    with torch.inference_mode():
        run(idx, 8)  # warm-up: first calls allocate and pick kernels
        times = common.time_calls(lambda: run(idx, n), warmup=0, repeats=job["repeats"])
        out = run(idx, 2)
    assert out.shape == (job["batch"], 2), out.shape
    sec = statistics.median(times)
    result = {"tokens_per_s": job["batch"] * n / sec, "seconds": sec, "ms_per_token": 1e3 * sec / n}
    if impl.startswith("gptkiln"):  # what the decode ran, as gptkiln.cpu's tuner left it
        from gptkiln.cpu import specs

        names = {kernel: spec.name for kernel, spec in specs.BY_KERNEL.items()}
        ran = {}
        for m in model.modules():
            kernel = getattr(m, "few_row_kernels", {}).get(job["batch"])
            if kernel is not None:
                shape = "x".join(map(str, m.weight.shape))
                ran[f"{shape} {str(m.weight.dtype).removeprefix('torch.')}"] = names.get(
                    kernel, "?"
                )
        blocks = getattr(model, "decode_blocks", None)
        ran["blocks in one call"] = bool(blocks and job["batch"] in blocks.rows)
        result["kernels"] = ran
    common.emit(result)


def check_same_tokens(job: dict) -> None:
    """One book model's weights in all three implementations: the same greedy tokens?"""
    import torch

    from gptkiln.config import GPTConfig
    from gptkiln.interop import config_to_hf, gptkiln_state_dict_to_hf
    from gptkiln.loading import book_state_dict_to_gptkiln
    from gptkiln.model import GPT

    book = book_model()
    config, sd = book_state_dict_to_gptkiln(book.state_dict(), n_head=SHAPE["n_head"])
    with torch.device("meta"):
        kiln = GPT(config)
    kiln.load_state_dict(sd, assign=True)
    kiln.eval()
    hf = hf_model(config_to_hf(config))
    hf.load_state_dict(gptkiln_state_dict_to_hf(kiln.state_dict(), config))
    assert isinstance(config, GPTConfig)
    idx = prompts(job["batch"], SHAPE["vocab"])
    n = job["new_tokens"]
    with torch.inference_mode():
        outs = {
            impl: generator_for(impl, m)(idx, n)
            for impl, m in (("gptkiln", kiln), ("transformers", hf), ("book", book))
        }
    ref = outs["book"]
    common.emit(
        {
            impl: {
                "same": bool(torch.equal(o, ref)),
                "first_diff": int((o != ref).any(0).nonzero()[0])
                if not torch.equal(o, ref)
                else None,
            }
            for impl, o in outs.items()
            if impl != "book"
        }
    )


# -- driver ------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="interleaved repeats of every process")
    p.add_argument(
        "--book-batch8",
        action="store_true",
        help="also time the book (no cache) at batch sizes above 1: minutes",
    )
    p.add_argument("--no-book", action="store_true", help="leave the book out entirely")
    p.add_argument("--no-check", action="store_true", help="skip the same-tokens check")
    p.add_argument("--no-int8", action="store_true", help="leave out the int8 row")
    p.add_argument(
        "--head-float", action="store_true", help="add int8 with the head and embedding in fp32"
    )
    args = p.parse_args()

    info = common.print_machine()
    rows, kernel_lines = [], []
    for batch in args.batches:
        jobs = [dict(impl="gptkiln")]
        if not args.no_int8:
            jobs.append(dict(impl="gptkiln int8"))
        if args.head_float:
            jobs.append(dict(impl="gptkiln int8, head fp32"))
        jobs.append(dict(impl="transformers"))
        if not args.no_book and (batch == 1 or args.book_batch8):
            jobs.append(dict(impl="book", repeats=1))
        for job in jobs:
            job.update(batch=batch, new_tokens=args.new_tokens)
            job.setdefault("repeats", args.repeats)
        results = common.run_rounds(__file__, jobs, args.rounds, "tokens_per_s")
        by_impl = dict(zip((job["impl"] for job in jobs), results))
        for job, r in zip(jobs, results):
            if "kernels" in r:
                kernel_lines.append(f"# {job['impl']} kernels at batch {batch}: {r['kernels']}")
            row = dict(batch=batch, impl=job["impl"], **r)
            for key, peer in (("ratio", "gptkiln"), ("int8_ratio", "gptkiln int8")):
                if peer in by_impl and job["impl"] != peer:
                    row[key] = common.ratio(by_impl[peer]["tokens_per_s"], r["tokens_per_s"])
                    row[key + "_paired"] = common.paired_ratio(
                        by_impl[peer]["tokens_per_s_rounds"], r["tokens_per_s_rounds"]
                    )
            rows.append(row)
    print()
    common.print_table(
        rows,
        [
            ("batch", "batch"),
            ("impl", "implementation"),
            ("tokens_per_s", "new tokens/s"),
            ("ms_per_token", "ms/step"),
            ("ratio", "gptkiln ratio"),
            ("ratio_paired", "ratio, paired rounds"),
            ("int8_ratio", "int8 ratio"),
            ("int8_ratio_paired", "int8 ratio, paired"),
            ("peak_rss_mb", "peak RSS MB"),
            ("tokens_per_s_rounds", "tokens/s per round"),
            ("others_cores", "others' cores"),
        ],
    )
    print(
        f"\n# {PROMPT_LEN}-token prompt, {args.new_tokens} new greedy tokens per row; "
        f"'gptkiln ratio' = gptkiln (fp32) tokens/s / that row's, 'int8 ratio' = gptkiln "
        f"int8's / that row's; load average now {common.machine()['loadavg_1m']:.2f} (at "
        f"start {info['loadavg_1m']:.2f})"
    )
    print("\n".join(kernel_lines))
    if not args.no_check:
        check = common.run_worker(__file__, dict(impl="check", batch=2, new_tokens=20))
        for impl in ("gptkiln", "transformers"):
            c = check[impl]
            verdict = "same tokens" if c["same"] else f"DIFFERENT from token {c['first_diff']}"
            print(
                f"# check (book weights copied in, batch 2, 20 greedy tokens): {impl} vs book: "
                f"{verdict}"
            )


if __name__ == "__main__":
    job = common.worker_args()
    worker(job) if job is not None else main()
