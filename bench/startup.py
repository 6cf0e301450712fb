"""Start-up: how long a whole ``gptkiln`` process takes to its first token, against the floor,
``python -c "import torch"``.

    python bench/startup.py [--rounds 3] [--no-int8] [--no-serve] [--run DIR]

A GPT-2 124M-shaped run with random weights (fp32, the gpt2 tokenizer) is saved in a temporary
directory (or ``--run DIR`` is used). Every figure is a fresh process, started as a user starts
it (``python -m gptkiln ...``), in rounds that interleave all the rows (so that the machine's
other load falls on every row alike); each row shows the median and the range over the rounds:

- ``import torch``: ``python -c "import torch"``, the floor of any Python tool on torch.
- ``generate, first token``: ``gptkiln generate RUN --prompt The --max-new-tokens 32
  --temperature 0``, from the start of the process to the first byte it writes (the prompt and
  the first token are written together, once the model is loaded, the decode kernels tuned and
  the prompt prefilled), and ``whole process``: the same command's wall time (32 tokens).
- ``fp32`` and ``int8`` (``--quantize int8``: the float run quantized on load), each with a
  **cold** cache (a new, empty ``GPTKILN_CACHE``, so the decode kernels are timed and
  inductor's int8 kernels compiled afresh) and a **warm** one (the cache the cold run left).
- ``serve, /health``: ``gptkiln serve RUN`` started on a free port, polled every 20 ms until
  ``/health`` answers 200; cold (it tunes the kernels for every batch size it decodes before it
  answers) and warm.

Targets (issue 28, warm cache): first token <= import torch + 0.5 s, fp32 and int8; serve
answering /health <= import torch + 2 s. The margin column is each row's median minus
``import torch``'s. The CPU column is the process's CPU seconds (user + system, all threads) at
the same moment, median, and its margin over ``import torch``'s: on a loaded machine a steadier
figure than wall time, which also holds the waits for other processes' turns (it counts both
threads of a parallel op, so it can exceed wall time on a quiet machine). Timings on a shared
machine are noisy: each round first waits (up to
``BENCH_MAX_WAIT`` s) for other processes to go quiet and then reports the cores they kept busy
during it; rows in one round run back to back.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

SHAPE = dict(vocab=50257, context=1024, n_layer=12, n_head=12, n_embd=768)
NEW_TOKENS = 32


def save_run(directory: Path) -> Path:
    """The 124M-shaped run with random weights, saved as ``gptkiln train`` would."""
    from gptkiln.checkpoint import save_model
    from gptkiln.tokenizers import load_tokenizer

    common.setup_torch()
    return save_model(
        common.gptkiln_gpt(SHAPE), directory / "startup-bench", tokenizer=load_tokenizer("gpt2")
    )


def environment(cache: Path) -> dict[str, str]:
    """The user's environment with ``cache`` as gptkiln's cache and inductor's left to it."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["GPTKILN_CACHE"] = str(cache)
    return env


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far: on a loaded
    machine a steadier figure than wall time, which waits for the other processes' turns."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def import_torch(env: dict[str, str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", "import torch"], env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError("python -c 'import torch' failed")
    return {"seconds": time.perf_counter() - start, "cpu": usage.ru_utime + usage.ru_stime}


def generate(run: Path, env: dict[str, str], quantize: str | None) -> dict:
    """Seconds to the first byte on stdout (the first token) and to the end of the process."""
    cmd = [sys.executable, "-m", "gptkiln", "generate", str(run), "--prompt", "The"]
    cmd += ["--max-new-tokens", str(NEW_TOKENS), "--temperature", "0"]
    if quantize:
        cmd += ["--quantize", quantize]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = os.read(proc.stdout.fileno(), 1)
    first_token = time.perf_counter() - start
    cpu = cpu_seconds(proc.pid)
    rest, err = proc.communicate()
    whole = time.perf_counter() - start
    if proc.returncode != 0 or not first:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err.decode()}")
    return {"seconds": first_token, "whole": whole, "cpu": cpu}


def serve_health(run: Path, env: dict[str, str]) -> dict:
    """Seconds from starting ``gptkiln serve`` to its first 200 on /health."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "gptkiln", "serve", str(run), "--port", str(port)]
    start = time.perf_counter()
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited:\n{server.stderr.read().decode()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return {"seconds": time.perf_counter() - start, "cpu": cpu_seconds(server.pid)}
            except httpx.HTTPError:
                pass
            if time.perf_counter() - start > 600:
                raise RuntimeError("the server did not answer /health in 600 s")
            time.sleep(0.02)
    finally:
        server.terminate()
        server.wait(timeout=60)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_round(run: Path, scratch: Path, r: int, int8: bool, serve: bool) -> dict[str, dict]:
    """Every row once, back to back; the warm rows read the cache their cold row just wrote."""
    results = {}
    results["import torch"] = import_torch(environment(scratch / "unused"))
    for quantize in [None, "int8"] if int8 else [None]:
        name = quantize or "fp32"
        cache = scratch / f"cache-{name}-{r}"  # new each round: cold
        results[f"generate {name}, cold cache"] = generate(run, environment(cache), quantize)
        results[f"generate {name}, warm cache"] = generate(run, environment(cache), quantize)
    if serve:  # serve tunes every batch size it decodes (1, 2, 4, ... 32) before it answers
        cache = scratch / f"cache-serve-{r}"
        results["serve /health, cold cache"] = serve_health(run, environment(cache))
        results["serve /health, warm cache"] = serve_health(run, environment(cache))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--run", type=Path, default=None, help="a run to use (default: a new one)")
    parser.add_argument("--no-int8", action="store_true")
    parser.add_argument("--no-serve", action="store_true")
    args = parser.parse_args()

    common.print_machine()
    with tempfile.TemporaryDirectory(prefix="gptkiln-startup-") as tmp:
        scratch = Path(tmp)
        os.environ["GPTKILN_CACHE"] = str(scratch / "bench")  # saving the run: not the user's
        run = args.run or save_run(scratch)
        rounds: dict[str, list[dict]] = {}
        for r in range(args.rounds):
            common.wait_for_quiet()
            others = common.others_cores_meter(common._children_cpu_seconds)
            for name, result in one_round(
                run, scratch, r, not args.no_int8, not args.no_serve
            ).items():
                rounds.setdefault(name, []).append(result)
            print(
                f"# round {r + 1} of {args.rounds} done; other processes kept "
                f"{others():.2f} cores busy meanwhile (of {os.cpu_count()})",
                flush=True,
            )
        shutil.rmtree(scratch, ignore_errors=True)
    floor = statistics.median(x["seconds"] for x in rounds["import torch"])
    cpu_floor = statistics.median(x["cpu"] for x in rounds["import torch"])
    rows = []
    for name, results in rounds.items():
        seconds = [x["seconds"] for x in results]
        median = statistics.median(seconds)
        whole = [x["whole"] for x in results if "whole" in x]
        cpu = statistics.median(x["cpu"] for x in results)
        target = 2.0 if name.startswith("serve") else 0.5
        rows.append(
            {
                "what": name if "generate" not in name else f"{name}, first token",
                "median": f"{median:.2f} s",
                "range": f"{min(seconds):.2f}-{max(seconds):.2f}",
                "whole": f"{statistics.median(whole):.2f} s" if whole else None,
                "margin": None if name == "import torch" else f"{median - floor:+.2f} s",
                "cpu": f"{cpu:.2f} s"
                + ("" if name == "import torch" else f" ({cpu - cpu_floor:+.2f})"),
                "target": None
                if name == "import torch" or "cold" in name
                else f"+{target:.1f} s: {'met' if median - floor <= target else 'missed'}",
            }
        )
    common.print_table(
        rows,
        [
            ("what", "what (fresh process)"),
            ("median", "median"),
            ("range", "range"),
            ("whole", f"whole process ({NEW_TOKENS} tokens)"),
            ("margin", "over import torch"),
            ("cpu", "CPU s (over import torch)"),
            ("target", "target (warm)"),
        ],
    )


if __name__ == "__main__":
    main()
