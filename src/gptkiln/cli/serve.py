"""``gptkiln serve``: a run behind OpenAI's completions API and a playground page
(`gptkiln.serve.serve`)."""

from __future__ import annotations

import argparse
import os

from gptkiln.cli.common import (
    add_device_flag,
    add_precision_flag,
    add_quantize_flag,
    add_run_argument,
    example,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over HTTP: OpenAI's completions API and a web playground",
        description="Serve a run (or a Hugging Face model directory) with an OpenAI-compatible "
        "API (POST /v1/completions, GET /v1/models; POST /v1/chat/completions for an "
        "instruction-tuned run, its messages in the run's template), GET /health, GET /metrics "
        "(Prometheus) and a playground page at /. Concurrent requests are batched together as "
        "they come; a prompt that starts as an earlier one did reuses its keys and values "
        "(prefix caching). The API supports: streaming, n, seed, stop, temperature, top_p, "
        "top_k, min_p, repetition, presence and frequency penalties (a request that leaves "
        "temperature, top_p, top_k, min_p or repetition_penalty out gets the model's "
        "generation_config.json value, as vLLM's), logprobs (both endpoints), echo; "
        "response_format json_object and json_schema (always enforced, on both endpoints); "
        "tools, tool_choice (auto, none, required, a named function) and tool messages, for a "
        "model whose own chat template has a tool section (Qwen3/Hermes <tool_call> or Llama "
        "3.x JSON calls); vLLM's ignore_eos. It takes and ignores what means nothing to a local "
        "server (store, metadata, service_tier, prompt_cache_key, safety_identifier, user, "
        "reasoning_effort, verbosity), and takes logit_bias (token ids to biases in [-100, "
        "100]). It refuses with HTTP 400: suffix, best_of "
        "other than n, prediction, web_search_options, audio modalities, a schema keyword it "
        "cannot enforce, tools for a template without a tool section, image or audio content.",
        epilog=example("gptkiln serve runs/default --port 8000")
        + "then open http://127.0.0.1:8000/ or point an OpenAI client at "
        "http://127.0.0.1:8000/v1\n",
    )
    add_run_argument(p)
    p.add_argument(
        "--host",
        metavar="ADDRESS",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only; any other address "
        "needs --api-key)",
    )
    p.add_argument(
        "--port", type=int, default=8000, metavar="PORT", help="TCP port, 1-65535 (default: 8000)"
    )
    p.add_argument(
        "--max-batch",
        metavar="N",
        type=int,
        default=8,
        help="sequences decoded together, 1-256 (default: 8); each holds a KV-cache row",
    )
    p.add_argument(
        "--max-queue",
        metavar="N",
        type=int,
        default=64,
        help="sequences that may wait for a free row, >= 0 (default: 64); more get HTTP 429",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/ requests (default: $GPTKILN_API_KEY, "
        "else none; required with a non-loopback --host)",
    )
    p.add_argument(
        "--max-body-bytes",
        metavar="BYTES",
        type=int,
        default=1 << 20,
        help="largest request body, >= 1024 bytes (default: 1048576); larger get HTTP 413",
    )
    p.add_argument(
        "--model-name",
        metavar="NAME",
        default=None,
        help="the model id clients send and /v1/models lists (default: the directory's name)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        metavar="MIB",
        type=int,
        default=256,
        help="memory for the keys and values of prompt prefixes kept for later prompts that "
        "start the same way, >= 0 (default: 256; 0 turns prefix caching off)",
    )
    add_device_flag(p)
    add_quantize_flag(p)
    add_precision_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from gptkiln.devices import resolve_device
    from gptkiln.serve import serve

    serve(
        args.run_dir,
        host=args.host,
        port=args.port,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        api_key=args.api_key or os.environ.get("GPTKILN_API_KEY") or None,
        max_body_bytes=args.max_body_bytes,
        model_name=args.model_name,
        device=resolve_device(args.device),
        quantize=args.quantize,
        prefix_cache_mb=args.prefix_cache_mb,
        precision=args.precision,
    )
