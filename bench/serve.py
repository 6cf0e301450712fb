"""`gptkiln serve` under load: streaming clients at once, aggregate tokens/s and latencies.

    python bench/serve.py [--clients 1 4 16 32] [--requests 20 60 160 260] [--new-tokens 128]
                          [--max-batch 32] [--time-limit 300] [--shape 124m|tiny]
                          [--device cpu|cuda] [--precision fp32|bf16|int8]
    python bench/serve.py --device cuda --precision bf16 --clients 1 16 --requests 16 64
    python bench/serve.py --smoke          # every code path, tiny shape, seconds

A GPT-2 124M-shaped model with **random weights** (the GPT-2 layout, fp32; throughput does not
depend on what the weights say, and the 128 tokens a request asks for are always all generated:
sampled at temperature 0.8, end-of-text is about 1 in 50,257 a token) is saved as a run and
served by a real ``gptkiln serve`` process (``--max-batch``, default 32, so every client of the
largest level decodes at once). For each level, that many clients each stream one request after
another (``stream: true``, ``max_tokens`` 128, a seed per request) until the level's fixed number
of requests is done or ``--time-limit`` seconds have passed. Prompts are token ids of mixed
lengths, 16, 48, 96 and 160 tokens in turn.

Per level: aggregate tokens/s (every token received, over the level's wall time), p50/p95 time to
first token (request sent -> first token's chunk), p50/p95 inter-token latency (between two
token chunks of one stream), requests done and errors (a status other than 200, a broken stream,
or fewer tokens than asked). The peer is the same server with one client, in the same run: the
ratio column is each level's tokens/s over one client's. The clients run in this process
(asyncio + httpx) while the server has its own; on a 2-core machine they share the cores, as a
real client on the same machine would.

``--device cuda`` serves on the GPU (``gptkiln serve --device cuda``: each batch bucket's decode
forward a CUDA graph, `gptkiln.gpu.RowGraphs`), at ``--precision`` (bf16 there by default: the
weights cast to bf16). Before the timed levels a warm-up runs one level of each bucket's number
of clients (1, 2, 4, ... ``--max-batch``), so that every bucket's graph is compiled outside them;
on the CPU the warm-up is one short level. bench/gpu.py's ``serve`` part runs this on the GPU
and a 16-client CPU level beside it (`measure`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

SHAPES = {
    "124m": dict(vocab=50257, context=1024, n_layer=12, n_head=12, n_embd=768),
    "tiny": dict(vocab=50257, context=1024, n_layer=2, n_head=2, n_embd=64),  # a smoke run
}
PROMPT_LENS = (16, 48, 96, 160)


def save_run(shape: str, directory: Path) -> Path:
    common.setup_torch()
    from gptkiln.checkpoint import save_model
    from gptkiln.tokenizers import load_tokenizer

    return save_model(
        common.gptkiln_gpt(SHAPES[shape]),
        directory / "serve-bench",
        tokenizer=load_tokenizer("gpt2"),
    )


def start_server(
    run: Path,
    port: int,
    max_batch: int,
    max_queue: int,
    device: str = "cpu",
    precision: str | None = None,
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "gptkiln",
        "serve",
        str(run),
        "--port",
        str(port),
        "--max-batch",
        str(max_batch),
        "--max-queue",
        str(max_queue),
        "--device",
        device,
        *(["--precision", precision] if precision else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(common.THREADS)}
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_until_up(url: str, server: subprocess.Popen, timeout: float = 600) -> float:
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited:\n{server.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not come up")


def prompt_ids(i: int) -> list[int]:
    import random

    rng = random.Random(i)
    return [rng.randrange(50000) for _ in range(PROMPT_LENS[i % len(PROMPT_LENS)])]


async def one_request(client, url: str, i: int, new_tokens: int) -> dict:
    """Stream one completion; when each token's chunk arrived, and what went wrong if anything."""
    body = {
        "prompt": prompt_ids(i),
        "max_tokens": new_tokens,
        "temperature": 0.8,
        "seed": i,
        "stream": True,
    }
    sent = time.perf_counter()
    arrivals: list[float] = []
    error = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"]["message"]
                    elif chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                        arrivals.append(time.perf_counter())
    except Exception as e:  # a broken connection is an error of the run, not of the bench
        error = f"{type(e).__name__}: {e}"
    if error is None and len(arrivals) != new_tokens:
        error = f"{len(arrivals)} tokens instead of {new_tokens}"
    return {"sent": sent, "arrivals": arrivals, "error": error}


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_level(
    url: str, clients: int, requests: int, new_tokens: int, limit: float, server_pid: int
):
    import resource

    import httpx

    def ours() -> float:  # this process (the clients) and the server
        me = resource.getrusage(resource.RUSAGE_SELF)
        return me.ru_utime + me.ru_stime + cpu_seconds(server_pid)

    others = common.others_cores_meter(ours)
    start = time.perf_counter()
    todo = iter(range(requests))
    results: list[dict] = []

    async def client_loop(client):
        for i in todo:
            if time.perf_counter() - start > limit:
                return
            results.append(await one_request(client, url, i, new_tokens))

    timeout = httpx.Timeout(limit + 60)
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    wall = time.perf_counter() - start
    return {**summarize(clients, requests, results, wall), "others_cores": others()}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


def summarize(clients: int, asked: int, results: list[dict], wall: float) -> dict:
    tokens = sum(len(r["arrivals"]) for r in results)
    ttft = [r["arrivals"][0] - r["sent"] for r in results if r["arrivals"]]
    gaps = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    errors = [r["error"] for r in results if r["error"]]
    return {
        "clients": clients,
        "requests": len(results),
        "asked": asked,
        "errors": len(errors),
        "first_error": errors[0] if errors else "",
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "itl_p50_ms": 1000 * percentile(gaps, 50) if gaps else None,
        "itl_p95_ms": 1000 * percentile(gaps, 95) if gaps else None,
    }


def warm_up(url: str, device: str, max_batch: int, server_pid: int) -> None:
    """Levels not counted: on a GPU one of each bucket's number of clients (every bucket's CUDA
    graph compiled here, not in a timed level); on the CPU one short level."""
    levels = [1] if device == "cpu" else sorted({min(2**i, max_batch) for i in range(9)})
    for clients in levels:
        asyncio.run(run_level(url, clients, clients, 8, 600, server_pid))


def measure(
    *,
    shape: str,
    clients: list[int],
    requests: list[int],
    new_tokens: int,
    max_batch: int,
    time_limit: float,
    device: str = "cpu",
    precision: str | None = None,
    quiet_wait: float | None = None,
) -> dict:
    """Serve a random-weight model of ``shape`` on ``device`` and run each level of ``clients``
    (``requests`` each); {"up_s": the server's start-up seconds, "rows": a row per level}."""
    with tempfile.TemporaryDirectory(prefix="gptkiln-serve-bench-") as tmp:
        run = save_run(shape, Path(tmp))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(
            run, port, max_batch, max(clients), device=device, precision=precision
        )
        try:
            up = wait_until_up(url, server)
            print(f"server on {device} up in {up:.1f} s (load, cache, kernel tuning)", flush=True)
            t0 = time.perf_counter()
            warm_up(url, device, max_batch, server.pid)
            print(f"warm-up levels {time.perf_counter() - t0:.1f} s (graphs compiled on a GPU)")
            print(f"others' cores before: {common.wait_for_quiet(quiet_wait):.2f}")
            rows = []
            for n, asked in zip(clients, requests):
                row = asyncio.run(run_level(url, n, asked, new_tokens, time_limit, server.pid))
                rows.append({"device": device, **row})
                print(json.dumps(row), flush=True)
        finally:
            server.terminate()
            server.wait(timeout=30)
    one = next((r["tok_s"] for r in rows if r["clients"] == 1), None)
    for row in rows:
        row["vs_1_client"] = common.ratio(row["tok_s"], one)
    return {"up_s": up, "rows": rows}


COLUMNS = [
    ("device", "device"),
    ("clients", "clients"),
    ("requests", "requests"),
    ("errors", "errors"),
    ("tok_s", "tokens/s"),
    ("vs_1_client", "vs 1 client"),
    ("ttft_p50_s", "TTFT p50 s"),
    ("ttft_p95_s", "TTFT p95 s"),
    ("itl_p50_ms", "ITL p50 ms"),
    ("itl_p95_ms", "ITL p95 ms"),
    ("wall_s", "wall s"),
    ("others_cores", "others' cores"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--requests", type=int, nargs="+", default=[20, 60, 160, 260])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--time-limit", type=float, default=300, help="seconds per level")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="124m")
    parser.add_argument("--device", default="cpu", help="where the server runs: cpu or cuda")
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16", "int8"),
        help="the server's --precision (default: bf16 on a GPU, the run's own fp32 on a CPU)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shape, 1 and 2 clients, 8 tokens: seconds"
    )
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.clients, args.requests, args.new_tokens = "tiny", [1, 2], [2, 4], 8
        args.max_batch = 2
    if len(args.requests) != len(args.clients):
        parser.error("give one --requests count per --clients level")
    precision = args.precision or (None if args.device == "cpu" else "bf16")
    common.print_machine()
    print(
        f"model: GPT-2 {args.shape}-shaped, random weights; {args.new_tokens} new tokens a "
        f"request; prompts of {', '.join(map(str, PROMPT_LENS))} tokens in turn; server "
        f"--device {args.device} --precision {precision or 'as stored'} "
        f"--max-batch {args.max_batch}"
    )
    result = measure(
        shape=args.shape,
        clients=args.clients,
        requests=args.requests,
        new_tokens=args.new_tokens,
        max_batch=args.max_batch,
        time_limit=args.time_limit,
        device=args.device,
        precision=precision,
        quiet_wait=0 if args.smoke else None,
    )
    rows = result["rows"]
    print()
    common.print_table(rows, COLUMNS)
    total = sum(r["requests"] for r in rows)
    errors = sum(r["errors"] for r in rows)
    at16 = next((r for r in rows if r["clients"] == 16), None)
    print(f"\nrequests {total}, errors {errors}")
    if at16 is not None:
        print(
            f"targets: 16 clients {at16['vs_1_client']:.2f}x one client's tokens/s (>= 3), "
            f"p95 TTFT {at16['ttft_p95_s']:.2f} s (< 2); errors {errors} over {total} "
            f"requests (0 over >= 500)"
        )
    if errors and args.smoke:
        first = next(r["first_error"] for r in rows if r["errors"])
        sys.exit(f"bench/serve.py --smoke: {errors} errors, the first: {first}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
