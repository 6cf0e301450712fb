"""The cost of a training step under each recipe choice, paired: the default run's model and batch
(qwen3-baby, a 16,384-id vocabulary, 8 windows of 64 tokens), one process, the choices' steps
taken in turn, round after round, so that a shared machine's load falls on each alike.

    python bench/recipe_steps.py [--rounds 5] [--steps 3] [--threads 2] [--precision bf16]
                                 [--choices NAME ...]

Prints each choice's median step time (forward, backward, optimizer) and its ratio to the
default's (AdamW), the median of the ratios within each round: the figure to scale step counts
by when recipes are compared at equal wall time (``bench/first_run.py budget --steps``). Beside
the wall time, the process's CPU time a step (``time.process_time``): on a machine shared with
other work, a process waiting for a core does not count there, so with ``--threads 1`` it is
the step's own cost, which the wall time under load is not. ``--precision bf16`` runs every
step under bf16 autocast, as a run in ``--precision bf16`` (or auto's bf16) trains; ``--choices``
measures only the named ones (the default's always), e.g. ``--choices "muon + value embeds 2"``.
A choice may change the batch's shape (context x batch at the same tokens a step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

_SPEEDRUN = {"tie_embeddings": False, "attention_windows": [0, 16, 16, 0]}
CHOICES: dict[str, tuple[str, dict]] = {
    # name -> (optimizer, model config overrides); a context_length override sets the batch to
    # the default's 512 tokens a step (8 x 64), a ``tokens`` one the tokens a step
    "adamw (the default)": ("adamw", {}),
    # the loss as torch computes it (before the blockwise cross-entropy, gptkiln.losses)
    "adamw, torch's cross-entropy": ("adamw", {"torch_loss": True}),
    "speedrun, torch's cross-entropy": ("muon", dict(_SPEEDRUN, torch_loss=True)),
    "muon": ("muon", {}),
    "relu2": ("adamw", {"relu2": True}),
    "softcap 15": ("adamw", {"logit_softcap": 15.0}),
    "zero-init out": ("adamw", {"zero_init_out": True}),
    "muon + relu2 + softcap + zero": (
        "muon",
        {"relu2": True, "logit_softcap": 15.0, "zero_init_out": True},
    ),
    "muon + value embeds 2": ("muon", {"value_embeds": 2}),
    "muon + windows 0,16,16,0": ("muon", {"attention_windows": [0, 16, 16, 0]}),
    "muon, context 128 x batch 4": ("muon", {"context_length": 128}),
    "muon, context 256 x batch 2": ("muon", {"context_length": 256}),
    "muon + untied head": ("muon", {"tie_embeddings": False}),
    "muon + untied + windows 0,16,16,0": ("muon", _SPEEDRUN),
    # the third round: the speedrun recipe's vocabulary, shape and batch (``tokens``: a step's)
    "speedrun, vocab 8192": ("muon", dict(_SPEEDRUN, vocab_size=8192)),
    "speedrun, vocab 12288": ("muon", dict(_SPEEDRUN, vocab_size=12288)),
    "speedrun, 5 layers": (
        "muon",
        dict(_SPEEDRUN, n_layer=5, attention_windows=[0, 16, 16, 16, 0]),
    ),
    "speedrun, 6 layers": (
        "muon",
        dict(_SPEEDRUN, n_layer=6, attention_windows=[0, 16, 16, 16, 16, 0]),
    ),
    "speedrun, width 192": (
        "muon",
        dict(_SPEEDRUN, n_embd=192, n_head=6, n_kv_head=2, intermediate_size=512),
    ),
    "speedrun, intermediate 512": ("muon", dict(_SPEEDRUN, intermediate_size=512)),
    "speedrun, 256 tokens a step": ("muon", dict(_SPEEDRUN, tokens=256)),
    "speedrun, 384 tokens a step": ("muon", dict(_SPEEDRUN, tokens=384)),
    "speedrun, 768 tokens a step": ("muon", dict(_SPEEDRUN, tokens=768)),
    "speedrun, 1024 tokens a step": ("muon", dict(_SPEEDRUN, tokens=1024)),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps of each choice a round")
    p.add_argument("--threads", type=int, default=common.THREADS)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--choices", nargs="+", choices=list(CHOICES), help="only these")
    args = p.parse_args()
    default = "adamw (the default)"
    chosen = {n: c for n, c in CHOICES.items() if n == default or n in (args.choices or CHOICES)}
    torch = common.setup_torch(args.threads)
    from gptkiln import model as model_module
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT
    from gptkiln.optim import make_optimizer

    def torch_cross_entropy(logits, targets, ignore_index=-100):
        return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=-100)

    info = common.print_machine()
    print(f"# {args.precision}, batch: 512 tokens a step (8 x 64 unless a choice says)")
    g = torch.Generator().manual_seed(0)
    built = {}
    for name, (kind, overrides) in chosen.items():
        overrides = dict(overrides)
        tokens = overrides.pop("tokens", 512)
        torch_loss = overrides.pop("torch_loss", False)
        model = GPT(GPTConfig.from_name("qwen3-baby", **{"vocab_size": 16384, **overrides}))
        T, V = model.config.context_length, model.config.vocab_size
        x, y = torch.randint(0, V, (2, tokens // T, T), generator=g)
        optimizer = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95), kind)
        built[name] = (model, optimizer, x, y, torch_loss)
    bf16 = args.precision == "bf16"
    blockwise = model_module.cross_entropy

    def step(model, optimizer, x, y, torch_loss) -> None:
        model_module.cross_entropy = torch_cross_entropy if torch_loss else blockwise
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for one in built.values():  # warm-up: the first steps allocate
        step(*one)
    times: dict[str, list[float]] = {name: [] for name in chosen}
    cpu: dict[str, list[float]] = {name: [] for name in chosen}
    for _ in range(args.rounds):
        for name, one in built.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                step(*one)
            times[name].append((time.perf_counter() - start) / args.steps)
            cpu[name].append((time.process_time() - start_cpu) / args.steps)
    rows = [
        {
            "name": name,
            "median_ms": statistics.median(t) * 1e3,
            "range_ms": f"{min(t) * 1e3:.0f}-{max(t) * 1e3:.0f}",
            "ratio": statistics.median(a / b for a, b in zip(t, times[default])),
            "cpu_ms": statistics.median(cpu[name]) * 1e3,
            "cpu_range": f"{min(cpu[name]) * 1e3:.0f}-{max(cpu[name]) * 1e3:.0f}",
            "cpu_ratio": statistics.median(a / b for a, b in zip(cpu[name], cpu[default])),
        }
        for name, t in times.items()
    ]
    common.print_table(
        rows,
        [
            ("name", "choice"),
            ("median_ms", "wall ms a step (median)"),
            ("range_ms", "range"),
            ("ratio", "x the default's (paired)"),
            ("cpu_ms", "CPU ms a step"),
            ("cpu_range", "range"),
            ("cpu_ratio", "CPU x the default's (paired)"),
        ],
    )
    load = common.machine()["loadavg_1m"]
    print(f"# load average at start {info['loadavg_1m']:.2f}, at end {load:.2f}")


if __name__ == "__main__":
    main()
