"""Prefix caching in `gptkiln serve`: how much sooner a request's first token comes when its
1,000-token system prompt was seen by the request before.

    python bench/prefix_cache.py [--rounds 3] [--system-tokens 1000] [--shape 124m|tiny]

A GPT-2 124M-shaped model with random weights (fp32; prefill time does not depend on what the
weights say) is saved as a run and served by a real ``gptkiln serve`` process (bench/serve.py's
helpers). After one warm-up request, each round sends a new random system prompt of
``--system-tokens`` token ids followed by a 16-token question, streamed with ``max_tokens`` 1
(so nothing else runs beside it), then the same system prompt with another question: the first
is a miss (its prompt is new), the second a hit. Time to first token is from the request sent
to its first token's chunk. The same rounds run against a second server started with
``--prefix-cache-mb 0`` as the peer (there the second request prefills everything again). The
server's /metrics hit counts are printed as a check that the hits happened. Beside the wall
time, the CPU seconds the server process spent on each request (from /proc): on a busy host,
where wall time is mostly waiting for a core, that is the work the cache saved.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402
import serve as serve_bench  # noqa: E402


async def first_token_seconds(url: str, prompt: list[int]) -> float:
    import httpx

    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    async with httpx.AsyncClient(timeout=600) as client:
        sent = time.perf_counter()
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["text"] is not None:
                        return time.perf_counter() - sent
    raise RuntimeError("no token came")


def timed(url: str, prompt: list[int], pid: int) -> tuple[float, float]:
    """(seconds to the first token, CPU seconds the server used for the whole request)."""
    before = serve_bench.cpu_seconds(pid)
    seconds = asyncio.run(first_token_seconds(url, prompt))
    time.sleep(0.5)  # the request ends with its one token; its blocks are kept after it
    return seconds, serve_bench.cpu_seconds(pid) - before


def rounds(url: str, n: int, system_tokens: int, pid: int) -> list[tuple[float, ...]]:
    rng = random.Random(1)
    asyncio.run(first_token_seconds(url, [rng.randrange(50000) for _ in range(64)]))  # warm-up
    out = []
    for _ in range(n):
        system = [rng.randrange(50000) for _ in range(system_tokens)]
        first = timed(url, system + [rng.randrange(50000)] * 16, pid)
        second = timed(url, system + [rng.randrange(50000)] * 16, pid)
        out.append((*first, *second))
    return out


def main() -> None:
    import httpx

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--shape", choices=sorted(serve_bench.SHAPES), default="124m")
    args = parser.parse_args()
    common.print_machine()
    with tempfile.TemporaryDirectory() as tmp:
        run = serve_bench.save_run(args.shape, Path(tmp))
        for cache_mb in (256, 0):
            port = 8431
            server = _start(run, port, ["--max-batch", "4", "--prefix-cache-mb", str(cache_mb)])
            url = f"http://127.0.0.1:{port}"
            try:
                serve_bench.wait_until_up(url, server)
                got = rounds(url, args.rounds, args.system_tokens, server.pid)
                metrics = httpx.get(f"{url}/metrics").text
            finally:
                server.terminate()
                server.wait()
            hits = [line for line in metrics.splitlines() if line.startswith("gptkiln_prefix")]
            print(f"## --prefix-cache-mb {cache_mb}")
            print(
                "| round | 1st TTFT s | 2nd TTFT s | 1st / 2nd | 1st server CPU s | "
                "2nd server CPU s | 1st / 2nd |"
            )
            print("|---|---|---|---|---|---|---|")
            for i, (a, ca, b, cb) in enumerate(got, 1):
                cells = [f"{a:.3f}", f"{b:.3f}", f"{a / b:.1f}", f"{ca:.2f}", f"{cb:.2f}"]
                print(f"| {i} | {' | '.join(cells)} | {ca / cb:.1f} |")
            wall = statistics.median(a / b for a, _, b, _ in got)
            cpu = statistics.median(ca / cb for _, ca, _, cb in got)
            print(f"median 1st / 2nd: TTFT {wall:.1f}x, server CPU {cpu:.1f}x; {' '.join(hits)}")


def _start(run: Path, port: int, extra: list[str]):
    import os
    import subprocess

    cmd = [sys.executable, "-m", "gptkiln", "serve", str(run), "--port", str(port), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(common.THREADS)}
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


if __name__ == "__main__":
    main()
