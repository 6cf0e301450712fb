"""Llama 3 and Qwen3 shapes: gptkiln against transformers' ``LlamaForCausalLM`` /
``Qwen3ForCausalLM`` with the same weights, training tokens/s and greedy decoding tokens/s.

    python bench/families.py [--families llama3 qwen3] [--parts train decode] [--rounds 2]
                             [--no-int8] [--quick]

The ~124M presets of each family (``llama3-124m``: 12 layers, 12 query heads and 4 key/value
heads of 64, SwiGLU 2,432 wide, RoPE, tied head, 124,730,880 parameters; ``qwen3-124m``: the
same with q/k RMSNorm, 124,732,416), random weights (gptkiln's initialisation, seed 0), fp32, 2
threads, dropout 0. Every worker builds gptkiln's model from the same seed; the transformers
worker then copies its weights into transformers' model (`to_hf`), so both run the same numbers.
Before any timing, one process per family checks that they are the same model: logits of a
64-token sequence (max abs difference) and 20 greedy tokens with each one's KV cache.

Training (context 256, batch 2, a fixed random batch; one step = forward + loss + backward +
optimizer step + zero_grad; median over the timed steps):

- gptkiln: as ``gptkiln train`` runs it: ``GPT(config)(x, y)`` returns the loss,
  ``gptkiln.optim.make_optimizer`` (decay groups, fused AdamW), ``keep_freed_memory()`` first;
  eager (``gptkiln train``'s default) and ``torch.compile(model)`` (``gptkiln train --compile``;
  compiling falls in the untimed warm-up steps).
- transformers: as its ``Trainer`` trains by default: SDPA attention (the default
  ``attn_implementation``), eager (``TrainingArguments.torch_compile`` is off by default), the
  optimizer ``Trainer.create_optimizer()`` makes from ``TrainingArguments(learning_rate,
  weight_decay)`` (its default ``optim``, ``adamw_torch_fused``, with its own no-decay groups),
  ``model(input_ids=x, labels=x).loss``.

Decoding (batch 1, an 8-token prompt, 200 new greedy tokens; one warm-up call excluded, which
also tunes gptkiln's kernels; median over ``--repeats`` calls):

- gptkiln: ``gptkiln.sampling.generate(model, prompt, max_new_tokens=200, temperature=0)``: its
  static KV cache and the decoding kernels ``gptkiln.cpu.prepare_for_decoding`` picks.
- gptkiln int8: the same model after ``gptkiln.quantize.quantize_model`` (int8 weights, per
  channel; head and embedding too), as ``gptkiln generate --quantize int8`` runs it.
- transformers: ``model.generate(do_sample=False, use_cache=True, max_new_tokens=200,
  min_new_tokens=200)`` (its default dynamic cache, SDPA).

Each implementation runs in a fresh process; with ``--rounds N`` the processes are interleaved and
the best round kept, with the median of the within-round ratios beside it (``_common``).
``--quick``: one round, 2 timed training steps, 32 new tokens, one repeat: a minute or two a
process, to see that everything runs, not figures to quote.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402
import generate as generate_bench  # noqa: E402

FAMILIES = ("llama3", "qwen3")
TRAIN = dict(context=256, batch=2, warmup=3, steps=5)
DECODE = dict(prompt=8, new_tokens=200, repeats=3)
QUICK_TRAIN = dict(context=256, batch=2, warmup=2, steps=2)
QUICK_DECODE = dict(prompt=8, new_tokens=32, repeats=1)
LR, WEIGHT_DECAY = 4e-4, 0.1
TRAIN_IMPLS = ("gptkiln", "gptkiln compiled", "transformers")
DECODE_IMPLS = ("gptkiln", "gptkiln int8", "transformers")
CHECK_LEN, CHECK_TOKENS = 64, 20


# -- the models --------------------------------------------------------------------------------
def gptkiln_model(family: str, context: int | None = None):
    """gptkiln's ``{family}-124m`` (context as given, else the preset's 1,024), dropout 0,
    gptkiln's initialisation from seed 0."""
    import torch

    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT

    extra = {} if context is None else dict(context_length=context)
    config = GPTConfig.from_name(f"{family}-124m", dropout=0.0, **extra)
    torch.manual_seed(0)
    return GPT(config)


def to_hf(model):
    """transformers' ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` holding ``model``'s weights, its
    config and names as ``gptkiln convert to-hf`` writes them (`gptkiln.interop`), SDPA
    attention."""
    import transformers

    from gptkiln.interop import config_to_hf, gptkiln_state_dict_to_hf

    config = model.config
    qwen = config.family == "qwen3"
    hf_config = (transformers.Qwen3Config if qwen else transformers.LlamaConfig).from_dict(
        config_to_hf(config), attn_implementation="sdpa"
    )
    theirs = (transformers.Qwen3ForCausalLM if qwen else transformers.LlamaForCausalLM)(hf_config)
    missing, unexpected = theirs.load_state_dict(
        gptkiln_state_dict_to_hf(model.state_dict(), config), strict=False
    )
    tied = ["lm_head.weight"] if config.tie_embeddings else []
    assert list(missing) == tied and not unexpected, (missing, unexpected)
    return theirs


def hf_model(family: str, context: int | None = None):
    """transformers' model with the weights of `gptkiln_model` (the same seed)."""
    return to_hf(gptkiln_model(family, context))


# -- training ----------------------------------------------------------------------------------
def build_train(job: dict):
    """(model, optimizer, loss_fn(x, y)) for one training implementation."""
    import torch

    family, context = job["family"], job["shape"]["context"]
    if job["impl"].startswith("gptkiln"):
        from gptkiln.allocator import keep_freed_memory
        from gptkiln.optim import make_optimizer

        keep_freed_memory()  # as `gptkiln train` does on the CPU
        model = gptkiln_model(family, context)
        opt = make_optimizer(model, LR, WEIGHT_DECAY, (0.9, 0.95))
        forward = torch.compile(model) if job["impl"] == "gptkiln compiled" else model
        return model, opt, lambda x, y: forward(x, y)[1]

    import tempfile

    from transformers import Trainer, TrainingArguments

    model = hf_model(family, context)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, learning_rate=LR, weight_decay=WEIGHT_DECAY, report_to=[]
        )
        opt = Trainer(model=model, args=args).create_optimizer()
    return model, opt, lambda x, y: model(input_ids=x, labels=x).loss  # labels shifted inside


def train_worker(job: dict) -> None:
    torch = common.setup_torch(job.get("threads", common.THREADS))
    s = job["shape"]
    model, opt, loss_fn = build_train(job)
    model.train()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (s["batch"], s["context"]), generator=gen)
    y = torch.randint(0, vocab, (s["batch"], s["context"]), generator=gen)
    no_autocast = torch.autocast("cpu", enabled=False)
    times = common.time_calls(
        lambda: common.training_step(loss_fn, opt, x, y, no_autocast),
        warmup=s["warmup"],
        repeats=s["steps"],
    )
    sec = statistics.median(times)
    common.emit(
        {
            "tokens_per_s": s["batch"] * s["context"] / sec,
            "ms_per_step": sec * 1e3,
            "params": sum(p.numel() for p in model.parameters()),
            "optimizer": type(opt).__name__ + (" fused" if opt.defaults.get("fused") else ""),
        }
    )


# -- decoding ----------------------------------------------------------------------------------
def prompt(length: int, vocab: int):
    import torch

    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (1, length), generator=gen)  # (1, T)


def decode_worker(job: dict) -> None:
    torch = common.setup_torch(job.get("threads", common.THREADS))
    s, impl = job["shape"], job["impl"]
    if impl == "transformers":
        model = hf_model(job["family"])
    else:
        model = gptkiln_model(job["family"])
        if impl == "gptkiln int8":
            from gptkiln.quantize import quantize_model

            model = quantize_model(model)
    model.eval()
    run = generate_bench.generator_for(impl.split()[0], model)  # as bench/generate.py calls them
    idx = prompt(s["prompt"], model.config.vocab_size)
    n = s["new_tokens"]
    with torch.inference_mode():
        run(idx, 8)  # warm-up: allocations, and gptkiln's kernel tuner (and int8's compile)
        times = common.time_calls(lambda: run(idx, n), warmup=0, repeats=s["repeats"])
    sec = statistics.median(times)
    result = {"tokens_per_s": n / sec, "ms_per_token": 1e3 * sec / n}
    if impl.startswith("gptkiln"):
        from gptkiln.cpu import specs
        from gptkiln.cpu.planned import few_row_kernels

        kernels = {few_row_kernels(m).get(1) for m in model.modules()} - {None}
        picked = sorted(specs.BY_KERNEL[k].name for k in kernels if k in specs.BY_KERNEL)
        result["kernels"] = ", ".join(picked)  # the kernels the layers ran at one row
    common.emit(result)


# -- the same model? ---------------------------------------------------------------------------
def check_worker(job: dict) -> None:
    """gptkiln's model and transformers' with its weights: logits and greedy tokens."""
    torch = common.setup_torch(job.get("threads", common.THREADS))
    ours = gptkiln_model(job["family"]).eval()
    theirs = to_hf(ours).eval()
    vocab = ours.config.vocab_size
    idx = torch.randint(0, vocab, (1, CHECK_LEN), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        a, b = ours(idx), theirs(idx).logits
        first = prompt(8, vocab)
        tok_a = generate_bench.generator_for("gptkiln", ours)(first, CHECK_TOKENS)
        tok_b = generate_bench.generator_for("transformers", theirs)(first, CHECK_TOKENS)
    same = bool(torch.equal(tok_a, tok_b))
    common.emit(
        {
            "max_abs_diff": float((a - b).abs().max()),
            "logit_scale": float(b.abs().max()),
            "same_tokens": same,
            "first_diff": None if same else int((tok_a != tok_b).nonzero()[0, 1]),
        }
    )


def bandwidth_worker(job: dict) -> None:
    """Read bandwidth: the best of 10 sums over a 512 MiB fp32 tensor (as
    ``bench/int8_kernels.py``), and the bytes of each family's weights read per decoded token."""
    torch = common.setup_torch(job.get("threads", common.THREADS))
    x = torch.ones(2**27)  # 512 MiB
    best = min(common.time_calls(x.sum, warmup=1, repeats=10))
    out = {"gb_s": x.numel() * 4 / best / 1e9}
    with torch.device("meta"):
        for family in FAMILIES:
            model = gptkiln_model(family)  # a tied head: its matrix is read once, by the head
            out[family] = sum(p.numel() for p in model.parameters()) * 4 / 1e6  # MB, fp32
    common.emit(out)


def worker(job: dict) -> None:
    parts = {"check": check_worker, "train": train_worker, "decode": decode_worker}
    {**parts, "bandwidth": bandwidth_worker}[job["part"]](job)


# -- driver ------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--parts", nargs="+", default=["train", "decode"], choices=["train", "decode"])
    p.add_argument("--rounds", type=int, default=2, help="interleaved repeats of every process")
    p.add_argument("--repeats", type=int, help="decoding calls timed per process (default 3)")
    p.add_argument("--new-tokens", type=int, help="new tokens per decoding call (default 200)")
    p.add_argument("--no-int8", action="store_true", help="leave out the int8 decoding row")
    p.add_argument("--no-compile", action="store_true", help="leave out gptkiln's compiled row")
    p.add_argument("--quick", action="store_true", help="a short run: 1 round, few steps/tokens")
    args = p.parse_args()
    train_shape = dict(QUICK_TRAIN if args.quick else TRAIN)
    decode_shape = dict(QUICK_DECODE if args.quick else DECODE)
    for key in ("repeats", "new_tokens"):
        if getattr(args, key) is not None:
            decode_shape[key] = getattr(args, key)
    rounds = 1 if args.quick else args.rounds

    info = common.print_machine()
    rows, checks, kernel_lines = [], [], []
    memory = None
    if "decode" in args.parts:  # how fast a token could be at best: all its weights, read once
        memory = common.run_worker(__file__, dict(part="bandwidth"))
    for family in args.families:
        check = common.run_worker(__file__, dict(part="check", family=family))
        checks.append(
            f"# check {family}-124m, same weights: logits of {CHECK_LEN} tokens differ by at most "
            f"{check['max_abs_diff']:.2e} (largest logit {check['logit_scale']:.2f}); "
            f"{CHECK_TOKENS} greedy tokens with the KV cache: "
            + (
                "the same"
                if check["same_tokens"]
                else f"DIFFERENT from token {check['first_diff']}"
            )
        )
        print(checks[-1], flush=True)
        parts = {"train": (TRAIN_IMPLS, train_shape), "decode": (DECODE_IMPLS, decode_shape)}
        for part in args.parts:
            impls, shape = parts[part]
            impls = [
                i
                for i in impls
                if not (args.no_int8 and i.endswith("int8"))
                and not (args.no_compile and i.endswith("compiled"))
            ]
            jobs = [dict(part=part, family=family, impl=i, shape=shape) for i in impls]
            results = common.run_rounds(__file__, jobs, rounds, "tokens_per_s")
            peer = results[impls.index("transformers")]
            if part == "decode" and memory is not None:
                floor = memory[family] / memory["gb_s"]  # MB / (GB/s) = ms
                checks.append(
                    f"# {family}-124m fp32 weights {memory[family]:.0f} MB a token: at the "
                    f"machine's {memory['gb_s']:.1f} GB/s (sum over 512 MiB, 2 threads) a token "
                    f"takes at least {floor:.1f} ms, so against transformers' "
                    f"{peer['ms_per_token']:.1f} ms/token fp32 decoding can reach at most "
                    f"{peer['ms_per_token'] / floor:.2f}x"
                )
            for job, r in zip(jobs, results):
                row = dict(model=f"{family}-124m", part=part, impl=job["impl"], **r)
                if job["impl"] != "transformers":
                    row["ratio"] = common.ratio(r["tokens_per_s"], peer["tokens_per_s"])
                    row["ratio_paired"] = common.paired_ratio(
                        r["tokens_per_s_rounds"], peer["tokens_per_s_rounds"]
                    )
                print(
                    f"# {family} {part} {job['impl']}: {r['tokens_per_s']:.1f} tokens/s "
                    f"(others' cores {r['others_cores']:.2f})",
                    flush=True,
                )
                if r.get("kernels"):
                    line = f"# {family} {job['impl']} decoding kernels: {r['kernels']}"
                    kernel_lines.append(line)
                rows.append(row)
    print()
    common.print_table(
        rows,
        [
            ("model", "model"),
            ("part", "work"),
            ("impl", "implementation"),
            ("tokens_per_s", "tokens/s"),
            ("ratio", "ratio vs transformers"),
            ("ratio_paired", "ratio, paired rounds"),
            ("ms_per_step", "ms/step"),
            ("ms_per_token", "ms/token"),
            ("optimizer", "optimizer"),
            ("peak_rss_mb", "peak RSS MB"),
            ("tokens_per_s_rounds", "tokens/s per round"),
            ("others_cores", "others' cores"),
        ],
    )
    print(
        f"\n# train: context {train_shape['context']}, batch {train_shape['batch']}, median of "
        f"{train_shape['steps']} steps after {train_shape['warmup']}; decode: batch 1, "
        f"{decode_shape['prompt']}-token prompt, {decode_shape['new_tokens']} new greedy tokens, "
        f"median of {decode_shape['repeats']} calls; {rounds} round(s); targets: train >= 1.25x, "
        f"decode (fp32) >= 1.8x. Load average now {common.machine()['loadavg_1m']:.2f} (at start "
        f"{info['loadavg_1m']:.2f})"
    )
    print("\n".join(checks + kernel_lines))


if __name__ == "__main__":
    job = common.worker_args()
    worker(job) if job is not None else main()
