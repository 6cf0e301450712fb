"""``gptkiln serve``: an OpenAI-compatible HTTP server with continuous batching, and a playground.

- `app.create_app`: the routes (FastAPI) for one loaded model (chat too, for an
  instruction-tuned run: its stored template formats the messages); `parsing` checks a
  request's values, `answers` shapes its answer, `tools` reads tool calls back per template
  family;
- `batcher.Batcher`: the one decode loop that owns the model, slots over a static KV cache;
  `events` what a sequence is and hears back, `choosing` each row's next token (alone or with
  the rows that sample alike), `constrain` gives a row its grammar mask (JSON schemas, forced
  tool calls), `prefix_cache` the keys and values of prompt prefixes it has seen;
- `schemas`: OpenAI's request and response shapes, and its error shape;
- `metrics`: Prometheus metrics;
- ``static/index.html``: the playground page, shipped in the package (no CDN, no build step).

`serve` loads a model (and an instruction-tuned run's template) once and runs the app under
uvicorn.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import sys
from pathlib import Path

from gptkiln.errors import GptkilnError


def is_loopback(host: str) -> bool:
    """Whether ``host`` is only reachable from this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def check_serve_options(
    *,
    host: str,
    port: int,
    max_batch: int,
    max_queue: int,
    api_key: str | None,
    max_body_bytes: int,
    prefix_cache_mb: int = 256,
) -> None:
    """Refuse, in one line each, what would make a server that cannot start or is unsafe."""
    if not is_loopback(host) and not api_key:
        raise GptkilnError(
            f"--host {host} is reachable from other machines, so the server needs a key: pass "
            "--api-key KEY (or set GPTKILN_API_KEY), or keep the default --host 127.0.0.1"
        )
    if not 1 <= port <= 65535:
        raise GptkilnError(f"--port must be in [1, 65535], got {port}; try 8000")
    if not 1 <= max_batch <= 256:
        raise GptkilnError(f"--max-batch must be in [1, 256], got {max_batch}; try 8")
    if max_queue < 0:
        raise GptkilnError(f"--max-queue must be >= 0, got {max_queue}; try 64")
    if max_body_bytes < 1024:
        raise GptkilnError(f"--max-body-bytes must be >= 1024, got {max_body_bytes}")
    if prefix_cache_mb < 0:
        raise GptkilnError(
            f"--prefix-cache-mb must be >= 0 (0 turns it off), got {prefix_cache_mb}"
        )


def serve(
    run_dir: str | os.PathLike,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int = 8,
    max_queue: int = 64,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
    model_name: str | None = None,
    device: str = "cpu",
    quantize: str | None = None,
    log_level: str = "info",
    prefix_cache_mb: int = 256,
    precision: str | None = None,
) -> None:
    """Load the model of ``run_dir`` once and serve it until interrupted.

    Args:
        run_dir: a run directory or a Hugging Face model directory (GPT-2, Llama 3, Qwen3).
        host, port: where to listen; a host other than a loopback address needs ``api_key``.
        max_batch: sequences decoded together (rows of the KV cache).
        max_queue: sequences that may wait for a row; more are answered 429.
        api_key: required as ``Authorization: Bearer KEY`` on every ``/v1/`` request.
        max_body_bytes: larger request bodies are answered 413.
        model_name: the id clients pass as ``model``; default: the directory's name.
        device: where the model runs (``cpu``, ``cuda``, ``mps``).
        quantize: "int8" quantizes the weights as they load (`gptkiln.loading.load_model`);
            None serves them as stored (a quantized run is served quantized either way).
        log_level: uvicorn's; requests are not logged one by one (see ``/metrics``).
        prefix_cache_mb: MiB of prompt-prefix keys and values kept for later prompts that
            start the same way (`serve.prefix_cache`); 0 turns prefix caching off.
        precision: what it decodes at, ``fp32``, ``bf16`` or ``int8`` (None: the run's own;
            on a GPU the weights are cast to it; `gptkiln.cpu.ready_for_decoding`).
    """
    check_serve_options(
        host=host,
        port=port,
        max_batch=max_batch,
        max_queue=max_queue,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        prefix_cache_mb=prefix_cache_mb,
    )
    import uvicorn

    from gptkiln.api import load_for_decoding, precision_notice
    from gptkiln.config.sample import model_sampling
    from gptkiln.finetune.runs import run_template
    from gptkiln.loading import check_language_model
    from gptkiln.serve.app import create_app

    if model_name is not None and not model_name.strip():
        raise GptkilnError("--model-name is empty; give the name clients pass as model")
    check_can_listen(host, port)  # before the model loads: a port in use is said at once
    model, tokenizer, run_cfg, precision = load_for_decoding(run_dir, device, quantize, precision)
    check_language_model(model, run_dir)  # a classifier's scores are not next tokens
    template = run_template(run_cfg, run_dir)  # an instruction-tuned run's: it can chat
    model.eval()
    name = model_name or Path(run_dir).resolve().name
    sampling = model_sampling(run_dir)  # what a request that does not say samples with
    app = create_app(
        model,
        tokenizer,
        model_name=name,
        template=template,
        sampling_defaults=sampling,
        max_batch=max_batch,
        max_queue=max_queue,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        prefix_cache_bytes=prefix_cache_mb << 20,
    )
    app.state.batcher.precision = precision  # read once, as the batcher prepares its model
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    print(
        f"gptkiln serve: {run_dir} as {name!r} (context {model.config.context_length}, "
        f"{max_batch} sequences at once); playground {url}/, API {url}/v1"
        + _chat_notice(template)
        + _sampling_notice(sampling)
        + (
            f"; {precision_notice(precision)}"
            if device == "cpu"
            else f"; on {device} at {precision}"
        ),
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)


def _sampling_notice(sampling: dict) -> str:
    """What the startup line says of the model's generation_config.json sampling, if any."""
    if not sampling:
        return ""
    from gptkiln.config.sample import sampling_said

    said = sampling_said(sampling)  # by the request fields' names
    return f"; a request that leaves them out samples with its generation_config.json's {said}"


def check_can_listen(host: str, port: int) -> None:
    """Bind a socket to ``host``:``port`` as uvicorn will (and let it go): one line saying why
    it cannot be (a name that does not resolve, a port in use or below 1024 without root, an
    address that is not this machine's), before the model loads, instead of uvicorn's log
    lines and exit 3 after it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise GptkilnError(
            f"--host {host}: not an address this machine can resolve ({e.strerror}); give an "
            "IP address, e.g. 127.0.0.1"
        ) from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds its own
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        hint = {
            errno.EADDRINUSE: "something else listens there: stop it or pick another --port",
            errno.EACCES: "ports below 1024 need root: pick another --port, e.g. 8000",
            errno.EADDRNOTAVAIL: "it is not an address of this machine: give one that is",
        }.get(e.errno, "check --host and --port")
        raise GptkilnError(
            f"--host {host} --port {port}: cannot listen there ({e.strerror}); {hint}"
        ) from None
    sock.close()


def _chat_notice(template) -> str:
    """What serves ``/v1/chat/completions``: the model's own chat template or the template a
    gptkiln fine-tune trained it with (None: chat is refused)."""
    if template is None:
        return ""
    from gptkiln.chat_template import is_chat_template

    return " (chat too: " + (
        "its own chat template)" if is_chat_template(template) else "instruction-tuned)"
    )
