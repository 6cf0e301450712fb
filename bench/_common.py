"""What every benchmark shares: one fresh process per measurement, medians, peak RSS, the machine.

Each benchmark script is both the driver and the worker. The driver (``python bench/X.py``)
starts the script again once per implementation, ``python bench/X.py --worker '{json}'``, so no
implementation inherits another's allocator state, threads or peak memory; the worker prints one
line ``RESULT {json}`` that the driver collects. Peers are measured in the same run and, with
``--rounds N``, interleaved (A B C A B C ...), so a busy neighbour slows all of them alike; the
figure kept is each process's median over its timed repeats, and across rounds the fastest
(see `run_rounds`).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
THREADS = 2
RESULT_PREFIX = "RESULT "


# -- inside a worker ---------------------------------------------------------------------------
def status_mb(field: str = "VmHWM") -> float:
    """A memory field of /proc/self/status in MB (VmHWM: peak resident set; VmRSS: now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def setup_torch(threads: int = THREADS, seed: int = 0):
    """Fixed intra-op threads and seed; returns the torch module."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    return torch


def time_calls(fn: Callable[[], object], warmup: int, repeats: int) -> list[float]:
    """Seconds per call of ``fn`` over ``repeats`` calls, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def training_step(loss_fn: Callable, opt, x, y, autocast):
    """One training step as every training benchmark times it: the loss under ``autocast``,
    backward, the optimizer step, zero_grad. Returns the loss, detached."""
    with autocast:
        loss = loss_fn(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def emit(result: dict) -> None:
    """Hand a worker's result back to the driver (always with the worker's peak RSS)."""
    result.setdefault("peak_rss_mb", status_mb("VmHWM"))
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def worker_args(argv: Sequence[str] | None = None) -> dict | None:
    """The worker's job when the script was started with ``--worker JSON``, else None."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--worker":
        return json.loads(argv[1])
    return None


# -- the models under test ---------------------------------------------------------------------
LAYOUTS = {
    "gpt2": dict(qkv_bias=True, tie_embeddings=True),  # GPT-2's, as transformers builds it
    "book": dict(qkv_bias=False, tie_embeddings=False),  # the book's GPTModel (book-124m)
}


def gptkiln_gpt(shape: dict, layout: str = "gpt2"):
    """A freshly initialised gptkiln ``GPT`` of ``shape`` (vocab, context, n_layer, n_head,
    n_embd; padded_vocab, optional: the embedding's and head's rows) in one of `LAYOUTS`,
    dropout 0."""
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT

    padded = shape.get("padded_vocab")
    config = GPTConfig(
        vocab_size=shape["vocab"],
        padded_vocab_size=padded if padded and padded > shape["vocab"] else None,
        context_length=shape["context"],
        n_layer=shape["n_layer"],
        n_head=shape["n_head"],
        n_embd=shape["n_embd"],
        dropout=0.0,
        **LAYOUTS[layout],
    )
    return GPT(config)


def hf_gpt2(shape: dict, **extra):
    """A freshly initialised transformers ``GPT2LMHeadModel`` of ``shape`` with SDPA attention,
    dropout 0; ``extra`` goes to ``GPT2Config``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=shape["vocab"],
        n_positions=shape["context"],
        n_embd=shape["n_embd"],
        n_layer=shape["n_layer"],
        n_head=shape["n_head"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **extra,
    )
    return GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")


# -- in the driver -----------------------------------------------------------------------------
def _busy_seconds() -> float:
    """CPU seconds spent busy on this machine since boot, all cores (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def others_cores_meter(own_cpu_seconds: Callable[[], float]) -> Callable[[], float]:
    """Start measuring; the function returned gives the mean number of cores that *other*
    processes kept busy since (machine busy time minus ``own_cpu_seconds``' growth, over the wall
    time), never below 0."""
    t0, b0, c0 = time.perf_counter(), _busy_seconds(), own_cpu_seconds()

    def others_cores() -> float:
        wall = time.perf_counter() - t0
        return max(0.0, ((_busy_seconds() - b0) - (own_cpu_seconds() - c0)) / wall)

    return others_cores


def wait_for_quiet(max_wait: float | None = None, busy_cores: float = 0.25) -> float:
    """Wait (up to ``max_wait`` s, env BENCH_MAX_WAIT, default 120) until other processes use
    less than ``busy_cores`` cores over a 1 s window; returns the last window's busy cores."""
    max_wait = float(os.environ.get("BENCH_MAX_WAIT", 120)) if max_wait is None else max_wait
    deadline = time.monotonic() + max_wait
    while True:
        b0 = _busy_seconds()
        time.sleep(1.0)
        busy = _busy_seconds() - b0
        if busy < busy_cores or time.monotonic() > deadline:
            return busy


def run_worker(script: str | Path, job: dict, timeout: float = 900) -> dict:
    """Run one job in a fresh interpreter; its ``RESULT`` dict (raises with its stderr if none).

    Adds ``others_cores``: the mean number of cores that *other* processes kept busy while it ran
    (machine busy time minus the worker's own CPU time, over its wall time); near 0 on a quiet
    machine, and a figure to distrust when it is not.
    """
    wait_for_quiet()
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(job.get("threads", THREADS)),
        TOKENIZERS_PARALLELISM="false",
        TRANSFORMERS_VERBOSITY="error",
        PYTHONWARNINGS="ignore",
        **job.get("env", {}),
    )
    others_cores = others_cores_meter(_children_cpu_seconds)
    proc = subprocess.run(
        [sys.executable, str(script), "--worker", json.dumps(job)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    others = others_cores()
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
            result["others_cores"] = others
            return result
    raise RuntimeError(f"worker {job} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def run_rounds(
    script: str | Path, jobs: Sequence[dict], rounds: int, key: str, best: str = "max"
) -> list[dict]:
    """Run every job ``rounds`` times, interleaved; per job, the best round by ``key`` (``max``
    for a throughput, ``min`` for a time), with ``key + '_rounds'`` listing every round's value.

    Each round's figure is already a median over timed repeats inside the worker. Across rounds
    the best is kept because a busy neighbour can only slow a run down: the fastest round is the
    least disturbed one, for every implementation alike.
    """
    results: list[list[dict]] = [[] for _ in jobs]
    for _ in range(rounds):
        for i, job in enumerate(jobs):
            results[i].append(run_worker(script, job))
    pick = max if best == "max" else min
    out = []
    for rs in results:
        chosen = dict(pick(rs, key=lambda r: r[key]))
        chosen[key + "_rounds"] = [r[key] for r in rs]
        out.append(chosen)
    return out


def matmul_peak_gflops(threads: int = THREADS, n: int = 2048, repeats: int = 10) -> dict:
    """fp32 matmul throughput (n x n @ n x n, 2 n^3 FLOPs) in a fresh process, by each library
    torch reaches on the CPU: MKL (``torch.mm``) and oneDNN (its linear), and ``best`` of them:
    the machine's practical peak, measured in the same run as the figures compared with it.

    Both count: on an AMD EPYC (Zen 4) MKL ran at 119 GFLOP/s and oneDNN at 186, so MKL alone
    would have understated the peak by a third.
    """
    job = {"job": "matmul", "threads": threads, "n": n, "repeats": repeats}
    return run_worker(__file__, job)


def _matmul_worker(job: dict) -> None:
    from gptkiln.cpu import specs

    torch = setup_torch(job["threads"])
    n = job["n"]
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    result = {}
    kernels = {"mkl": lambda: torch.mm(a, b, out=out)}
    onednn = specs.offered("float32", "fp32").get("onednn")  # where this torch build has it
    if onednn is not None:
        bt = b.t().contiguous()  # linear takes the (out, in) weight: a @ bt.T == a @ b
        kernels["onednn"] = lambda: onednn(a, bt, None)
    for name, fn in kernels.items():
        times = time_calls(fn, warmup=3, repeats=job["repeats"])
        result[name] = 2 * n**3 / statistics.median(times) / 1e9
    result["best"] = max(result.values())
    emit(result)


def machine() -> dict:
    """CPU model and cores, torch and Python versions, and the load average right now."""
    model = platform.processor() or "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    import torch

    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": THREADS,
        "loadavg_1m": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def print_machine(info: dict | None = None) -> dict:
    info = info or machine()
    print(
        f"# {info['date']} | {info['cpu']}, {info['cores']} cores | torch {info['torch']} | "
        f"python {info['python']} | {info['threads']} threads | "
        f"load average (1 min) at start {info['loadavg_1m']:.2f}"
    )
    return info


def print_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> None:
    """A Markdown table of ``rows``; ``columns`` are (key, header) pairs."""
    cells = [[_cell(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h) in enumerate(columns)]
    print("| " + " | ".join(h.ljust(w) for (_, h), w in zip(columns, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for c in cells:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(c, widths)) + " |")


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        return " / ".join(_cell(v) for v in value)
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    return str(value)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def paired_ratio(a_rounds: Sequence[float], b_rounds: Sequence[float]) -> float | None:
    """The median over rounds of a / b, each round's two figures taken minutes apart at most.

    A machine that slows down for tens of seconds at a time can give one implementation its
    best round in a fast phase and the other none: the ratio of the best rounds then swings
    with the phases, while the ratio within a round pairs figures from the same phase.
    """
    pairs = [a / b for a, b in zip(a_rounds, b_rounds) if a and b]
    return statistics.median(pairs) if pairs else None


if __name__ == "__main__":
    job = worker_args()
    if job is None or job.get("job") != "matmul":
        sys.exit("usage: the benchmarks start this file as a worker; run bench/*.py instead")
    _matmul_worker(job)
