"""gptkiln serve over real HTTP: the official openai client, raw bad requests, batching equal to
generate, metrics, the key, the body limit, the queue and a client that leaves."""

import concurrent.futures
import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
from serving import ServerThread

from gptkiln.api import generate_text
from gptkiln.checkpoint import save_model
from gptkiln.cli import main as cli_main
from gptkiln.config import GPTConfig, SampleConfig
from gptkiln.inspect import inspect_prompt
from gptkiln.loading import load_run
from gptkiln.model import GPT
from gptkiln.serve import check_serve_options, is_loopback
from gptkiln.serve.app import create_app
from gptkiln.tokenizers import load_tokenizer

NAME = "tiny-run"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny untied GPT-2-tokenizer model saved as a run (random weights)."""
    torch.manual_seed(0)
    tokenizer = load_tokenizer("gpt2")
    config = GPTConfig.from_name(
        "tiny", vocab_size=tokenizer.vocab_size, context_length=64, tie_embeddings=False
    )
    return save_model(GPT(config), tmp_path_factory.mktemp("run") / NAME, tokenizer=tokenizer)


def make_app(run_dir, **options):
    model, tokenizer, _ = load_run(run_dir)
    return create_app(model.eval(), tokenizer, model_name=NAME, **options)


@pytest.fixture(scope="module")
def url(run_dir):
    with ServerThread(make_app(run_dir, max_batch=4, max_queue=8)) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def expected(run_dir, prompt, **cfg) -> str:
    """What `gptkiln generate` (its library function) writes after the prompt."""
    return generate_text(run_dir, prompt, SampleConfig(**cfg))[len(prompt) :]


# -- the official client -----------------------------------------------------------------------
def test_openai_client_completion_is_the_greedy_text(client, run_dir):
    r = client.completions.create(model=NAME, prompt="Hello, I am", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == NAME
    assert r.choices[0].text == expected(run_dir, "Hello, I am", max_new_tokens=12, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == 16


def test_openai_client_streams_the_same_text(client, run_dir):
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt="The sky",
            max_tokens=10,
            temperature=0.9,
            seed=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected(run_dir, "The sky", max_new_tokens=10, temperature=0.9, seed=5)
    token_chunks = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert len(token_chunks) == 10  # one chunk a token
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_openai_client_sees_errors_as_its_exceptions(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", temperature=-1)
    assert e.value.status_code == 400 and "temperature" in e.value.message
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", prompt="x")
    assert client.models.list().data[0].id == NAME
    assert client.models.list().data[0].model_extra["context_length"] == 64


def test_stop_strings_n_seeds_echo_and_logprobs(client, run_dir):
    free = expected(run_dir, "Once", max_new_tokens=12, temperature=0)
    stop = free[4:7]
    r = client.completions.create(
        model=NAME, prompt="Once", max_tokens=12, temperature=0, stop=[stop, "never-seen"]
    )
    assert r.choices[0].text == free[: free.index(stop)] and r.choices[0].finish_reason == "stop"

    r = client.completions.create(
        model=NAME, prompt=["Once", "Twice"], max_tokens=6, temperature=1.0, seed=11, n=2
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:  # the j-th sample of a prompt is drawn with seed + j
        prompt = ["Once", "Twice"][c.index // 2]
        seed = 11 + c.index % 2
        assert c.text == expected(run_dir, prompt, max_new_tokens=6, temperature=1.0, seed=seed)
    tokenizer = load_tokenizer("gpt2")
    prompt_tokens = len(tokenizer.encode("Once")) + len(tokenizer.encode("Twice"))  # once each
    assert r.usage.prompt_tokens == prompt_tokens and r.usage.completion_tokens == 24

    r = client.completions.create(
        model=NAME, prompt="Once upon", max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("Once upon")
    assert len(lp.tokens) == 2 + 3 and lp.token_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[:2] == [0, 4]
    # the chosen greedy token is the most likely one
    assert all(
        ids[0] == t
        for ids, t in zip(lp.model_extra["top_token_ids"][2:], lp.model_extra["token_ids"][2:])
    )


def test_streamed_text_offsets_are_the_whole_answers(client):
    """The emoji is two GPT-2 tokens, each decoding to a replacement character: the offsets of a
    stream count each token's own text, as the whole answer does, not the text a chunk carries."""
    ask = dict(model=NAME, prompt="Smile \U0001f600", max_tokens=6, temperature=0, echo=True)
    whole = client.completions.create(**ask, logprobs=0).choices[0].logprobs
    offsets, tokens = [], []
    for chunk in client.completions.create(**ask, logprobs=0, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            offsets += chunk.choices[0].logprobs.text_offset
            tokens += chunk.choices[0].logprobs.tokens
    assert tokens == whole.tokens and len(tokens) > 6
    assert offsets == whole.text_offset


def spelled(tokenizer, text: str, lp) -> None:
    """The scored tokens spell ``text``, the last perhaps running past its end where a stop
    string begins inside it: each begins in the text at its offset (a character's pieces at
    that character); none begins past it (a stop string's tokens, the end-of-text)."""
    ids = lp.model_extra["token_ids"]
    assert tokenizer.decode(ids).startswith(text) and len(tokenizer.decode(ids[:-1])) < len(text)
    for k, offset in enumerate(lp.text_offset):
        assert offset == len(tokenizer.decode(ids[:k]).rstrip("\ufffd")) < len(text)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_logprob_tokens_spell_the_text_past_a_stop_string_and_inside_characters(
    client, run_dir, stream
):
    """A stop string cuts the text, and its tokens go from the logprobs too; a character of
    several tokens puts each at the character's offset (not one place a token further)."""
    tokenizer = load_tokenizer("gpt2")
    prompt = "a\ua66eb\U0001d518c"  # 'a', three tokens of one character, 'b', ...
    free = expected(run_dir, prompt, max_new_tokens=12, temperature=0)
    stop = free[5:8]
    ask = dict(model=NAME, prompt=prompt, max_tokens=12, temperature=0, echo=True, logprobs=0)
    ask["stop"] = [stop]
    if stream:
        text, offsets, ids = "", [], []
        for chunk in client.completions.create(**ask, stream=True):
            choice = chunk.choices[0]
            text += choice.text
            if choice.logprobs is not None:
                offsets += choice.logprobs.text_offset
                ids += choice.logprobs.model_extra["token_ids"]
        lp = type("Lp", (), {"text_offset": offsets, "model_extra": {"token_ids": ids}})
    else:
        choice = client.completions.create(**ask).choices[0]
        text, lp = choice.text, choice.logprobs
    assert text == prompt + free[: free.index(stop)]
    assert lp.text_offset[:5] == [0, 1, 1, 1, 2]  # the second character is three tokens
    spelled(tokenizer, text, lp)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo_scores_every_prompt_token_even_one_the_prompt_text_lacks(client, stream):
    """An empty prompt is the end-of-text token, whose text the echoed prompt ("") lacks: it is
    scored all the same, and so is every generated token after it (none is taken for one
    past the text)."""
    ask = dict(model=NAME, prompt="", max_tokens=6, temperature=0, echo=True, logprobs=0)
    if stream:
        ids, offsets, text = [], [], ""
        for chunk in client.completions.create(**ask, stream=True):
            text += chunk.choices[0].text
            if chunk.choices[0].logprobs is not None:
                ids += chunk.choices[0].logprobs.model_extra["token_ids"]
                offsets += chunk.choices[0].logprobs.text_offset
    else:
        choice = client.completions.create(**ask).choices[0]
        ids, text = choice.logprobs.model_extra["token_ids"], choice.text
        offsets = choice.logprobs.text_offset
    tokenizer = load_tokenizer("gpt2")
    assert ids[0] == tokenizer.eot_id and len(ids) == 1 + 6, (ids, text)
    # offsets in the text given back: the end-of-text at 0 (the prompt is ""), then each
    # generated token where its text begins, "<|endoftext|>"'s 13 characters not counted
    assert offsets == [0] + [len(tokenizer.decode(ids[1 : k + 1])) for k in range(6)]


def test_a_null_max_tokens_fills_the_context(client, url):
    """``max_tokens: null`` on completions is the rest of the context (as vLLM's), not the
    default 16: a null for a field that takes one keeps its meaning."""
    body = {"prompt": "Hello", "max_tokens": None, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body).json()
    assert r["usage"]["completion_tokens"] > 16 or r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == 64 or (
        r["choices"][0]["finish_reason"] == "stop"
    )


@pytest.mark.parametrize("max_tokens", [None, 5])
def test_a_prompt_that_fills_the_context_is_refused_with_shorten_it(url, max_tokens):
    """A prompt of exactly the context leaves no room for a token: a 400
    ``context_length_exceeded`` naming the prompt, as OpenAI and vLLM answer (not a 200 with an
    empty answer, nor "lower max_tokens to at most 0"); ``max_tokens: 0`` (a prompt scored with
    echo) still fits."""
    body = {"prompt": [50] * 64, "max_tokens": max_tokens}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded", r.text
    assert error["param"] == "prompt" and "shorten the prompt" in error["message"]
    assert "at most 0" not in error["message"]
    body = {"prompt": [50] * 64, "max_tokens": 0, "echo": True, "logprobs": 0}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


def test_a_chat_that_fills_the_context_is_refused_too():
    from gptkiln.serve.parsing import sample_config
    from gptkiln.serve.schemas import ChatCompletionRequest, OpenAIError

    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(OpenAIError) as e:
        sample_config(req, [[1] * 64], 64, source="messages")
    assert e.value.param == "messages" and e.value.code == "context_length_exceeded"
    assert "shorten the messages" in e.value.message
    assert sample_config(req, [[1] * 63], 64, source="messages").max_new_tokens == 1


def test_a_lone_surrogate_is_named_where_it_is():
    """A ``\\ud800`` escape is JSON that UTF-8 cannot hold: the 400 names the field and says
    so (before: "not valid JSON (unexpected end of hex escape)"); other bad escapes stay
    "not valid JSON"."""
    from gptkiln.serve.schemas import ChatCompletionRequest, OpenAIError, parse_request

    for body, where in [
        (b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages[0].content"),
        (b'{"messages": [{"role": "user", "content": "\\udc00b"}]}', "messages[0].content"),
        (b'{"messages": [], "\\ud800": 1}', "the body"),
    ]:
        with pytest.raises(OpenAIError) as e:
            parse_request(ChatCompletionRequest, body)
        assert e.value.param == (None if where == "the body" else where)
        assert e.value.message.startswith(f"{where} is not valid Unicode text (a lone surrogate")
    with pytest.raises(OpenAIError) as e:
        parse_request(ChatCompletionRequest, b'{"messages": "\\u12"}')
    assert "not valid JSON" in e.value.message


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(url):
    """``usage.prompt_tokens_details.cached_tokens``, as OpenAI's and vLLM's usage give it:
    0 the first time, a block of 32 the second (streamed too)."""
    body = {"prompt": list(range(3000, 3040)), "max_tokens": 2, "temperature": 0}
    first = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    again = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["usage"]
    assert again["prompt_tokens_details"] == {"cached_tokens": 32}
    assert again["prompt_tokens"] == 40
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=streamed, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line[6:].startswith("{")]
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


def check_timings(timings: dict, prompt_n: int, predicted_n: int, choices: int = 1) -> None:
    """llama.cpp's ``timings``: the counts as said, the times >= 0, the rate the tokens after
    each choice's first over the time from the first token to the last."""
    assert set(timings) == {
        "prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second",
    }  # fmt: skip
    assert (timings["prompt_n"], timings["predicted_n"]) == (prompt_n, predicted_n)
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] >= 0
    after, seconds = predicted_n - choices, timings["predicted_ms"] / 1000
    if after and seconds:
        assert timings["predicted_per_second"] == pytest.approx(after / seconds, rel=1e-2)
    else:
        assert timings["predicted_per_second"] is None


def test_an_answer_says_its_timings_as_llama_cpps_server_does(url):
    """A whole answer and a stream's usage chunk carry ``timings`` (llama.cpp's fields): the
    prompt tokens prefilled (not those the prefix cache held) and the time to the first token;
    the tokens generated, the time from the first to the last, the decode rate (none for one
    token a choice); a stream without usage asked carries none."""
    body = {"prompt": list(range(4000, 4040)), "max_tokens": 6, "temperature": 0}
    whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    check_timings(whole["timings"], 40, whole["usage"]["completion_tokens"])
    assert whole["usage"]["completion_tokens"] == 6
    two = {**body, "n": 2, "temperature": 1.0, "seed": 1}
    again = httpx.post(f"{url}/v1/completions", json=two, timeout=60).json()  # 32 cached
    check_timings(again["timings"], 40 - 32, 12, choices=2)
    one = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 1}, timeout=60)
    check_timings(one.json()["timings"], 8, 1)
    for options, timed in (({"include_usage": True}, True), (None, False)):
        streamed = {**body, "stream": True, "stream_options": options}
        with httpx.stream("POST", f"{url}/v1/completions", json=streamed, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line[6:].startswith("{")]
        assert [("timings" in c) for c in chunks] == [False] * (len(chunks) - 1) + [timed]
        if timed:
            check_timings(chunks[-1]["timings"], 8, 6)


def test_a_prompt_of_token_ids_and_an_empty_prompt(client, url, run_dir):
    tokenizer = load_tokenizer("gpt2")
    ids = tokenizer.encode("Hello, I am")
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=5, temperature=0)
    assert r.choices[0].text == expected(run_dir, "Hello, I am", max_new_tokens=5, temperature=0)
    r = client.completions.create(model=NAME, prompt="", max_tokens=5, temperature=0)
    assert r.choices[0].text == expected(run_dir, "", max_new_tokens=5, temperature=0)


# -- batching over HTTP equals generate --------------------------------------------------------
def test_concurrent_staggered_requests_equal_generate_alone(url, run_dir):
    cases = [
        ("Hello, I am", dict(max_tokens=20, temperature=0)),
        ("A", dict(max_tokens=7, temperature=0)),
        (
            "In the beginning there was a long prompt, longer than the others",
            dict(max_tokens=12, temperature=0.8, seed=3),
        ),
        ("Why", dict(max_tokens=16, temperature=1.0, top_k=50, seed=9, frequency_penalty=1.0)),
        ("Zebra", dict(max_tokens=9, temperature=1.0, top_p=0.9, seed=0)),
        ("Once", dict(max_tokens=12, temperature=0, repetition_penalty=1.4)),
        ("Twice", dict(max_tokens=12, temperature=1.2, min_p=0.1, seed=2)),
        ("Thrice", dict(max_tokens=12, temperature=0.9, seed=4, logit_bias={"11": 3.0})),
    ]

    def ask(i):
        time.sleep(0.01 * i)  # arrive while the others decode
        prompt, options = cases[i]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, **options}, timeout=60)
        return r.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        texts = list(pool.map(ask, range(len(cases))))
    for (prompt, o), text in zip(cases, texts):
        cfg = dict(
            max_new_tokens=o["max_tokens"],
            temperature=o["temperature"],
            top_k=o.get("top_k"),
            top_p=o.get("top_p"),
            seed=o.get("seed"),
            frequency_penalty=o.get("frequency_penalty", 0.0),
            min_p=o.get("min_p"),
            repetition_penalty=o.get("repetition_penalty", 1.0),
            logit_bias={int(k): v for k, v in o.get("logit_bias", {}).items()},
        )
        assert text == expected(run_dir, prompt, **cfg), prompt


@pytest.mark.slow
def test_the_server_prints_what_gptkiln_generate_prints(client, run_dir):
    r = client.completions.create(
        model=NAME, prompt="Hello, I am", max_tokens=8, temperature=0.7, seed=4
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gptkiln",
            "generate",
            str(run_dir),
            "--prompt",
            "Hello, I am",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0.7",
            "--seed",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "Hello, I am" + r.choices[0].text + "\n"


# -- the other routes --------------------------------------------------------------------------
def test_health_models_metrics_and_the_page(url, client):
    client.completions.create(model=NAME, prompt="Hi", max_tokens=3, temperature=0)
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    models = httpx.get(f"{url}/v1/models").json()
    assert models["data"][0] == {**models["data"][0], "id": NAME, "context_length": 64}
    metrics = httpx.get(f"{url}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    for name in (
        "gptkiln_requests_total",
        "gptkiln_generated_tokens_total",
        "gptkiln_queue_length",
        "gptkiln_time_to_first_token_seconds_bucket",
        "gptkiln_inter_token_latency_seconds_count",
    ):
        assert name in text
    ok = [
        line
        for line in text.splitlines()
        if line.startswith('gptkiln_requests_total{route="/v1/completions",status="200"}')
    ]
    assert ok and float(ok[0].split()[-1]) >= 1
    page = httpx.get(url)
    assert page.status_code == 200 and "<title>gptkiln playground</title>" in page.text
    fetched = page.text.replace("http://www.w3.org/2000/svg", "")  # a name, never fetched
    assert "http://" not in fetched and "https://" not in fetched  # nothing from a CDN


def test_health_and_tokenize_size_the_pages_fields(url, run_dir):
    """What the page sizes Max tokens by: the context (/health) and a prompt's token count
    (/v1/tokenize), the count the server checks a request with."""
    health = httpx.get(f"{url}/health").json()
    assert health["context_length"] == 64 and health["inspect_max_tokens"] == 64
    _, tokenizer, _ = load_run(run_dir)
    prompt = "Hello, I am a language model"
    got = httpx.post(f"{url}/v1/tokenize", json={"prompt": prompt, "model": NAME}).json()
    assert got == {"count": len(tokenizer.encode(prompt)), "max_model_len": 64}
    room = 64 - got["count"]
    fits = httpx.post(
        f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": room}, timeout=120
    )  # a first decode may tune its kernels: seconds on a busy machine
    assert fits.status_code == 200
    over = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": room + 1})
    assert over.json()["error"]["code"] == "context_length_exceeded"
    for body, param in [
        ({}, "prompt"),
        ({"prompt": "a", "messages": []}, "prompt"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),  # no template
        ({"prompt": 5}, "prompt"),
    ]:
        r = httpx.post(f"{url}/v1/tokenize", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, body
    small = GPTConfig.from_name("tiny", vocab_size=50257, context_length=16)
    with ServerThread(create_app(GPT(small), tokenizer, model_name="small")) as small_url:
        health = httpx.get(f"{small_url}/health").json()
    assert health["context_length"] == 16 and health["inspect_max_tokens"] == 16


# -- bad input: a clean 4xx each, and the server still answers ---------------------------------
BAD = [
    ("not json", b"{prompt: 1", 400, None),
    ("invalid UTF-8 bytes", b'{"prompt": "\xff\xfe"}', 400, None),
    ("a JSON array", b"[1, 2]", 400, None),
    ("missing prompt", {"max_tokens": 5}, 400, "prompt"),
    ("prompt a number", {"prompt": 5}, 400, "prompt"),
    ("prompt a mixed list", {"prompt": [1, "a"]}, 400, "prompt"),
    ("prompt an empty list", {"prompt": []}, 400, "prompt"),
    ("token id out of range", {"prompt": [1, 99999999]}, 400, "prompt"),
    ("negative token id", {"prompt": [-1]}, 400, "prompt"),
    ("lone surrogate", b'{"prompt": "\\ud800"}', 400, "prompt"),  # JSON, but not Unicode text
    ("nested 300 deep", b'{"prompt": ' + b"[" * 300 + b"]" * 300 + b"}", 400, None),
    ("100k characters", {"prompt": "word " * 20000}, 400, "prompt"),
    ("max_tokens a string", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("max_tokens negative", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens huge", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ("max_tokens a float", {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    ("max_tokens a bool", {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("temperature < 0", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("temperature a string", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("top_p 0", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p > 1", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("top_k -2", {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("5 stop strings", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("an empty stop string", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("stop a number", {"prompt": "x", "stop": 3}, 400, "stop"),
    ("seed negative", {"prompt": "x", "seed": -3}, 400, "seed"),
    ("seed over 2**63", {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("penalty out of range", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("repetition 0", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("min_p over 1", {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("n 0", {"prompt": "x", "n": 0}, 400, "n"),
    ("n too many", {"prompt": "x", "n": 1000}, 400, "n"),
    ("logprobs too many", {"prompt": "x", "logprobs": 1000}, 400, "logprobs"),
    ("echo a string", {"prompt": "x", "echo": "yes"}, 400, "echo"),
    ("an unknown field", {"prompt": "x", "temprature": 0.5}, 400, "temprature"),
    ("suffix", {"prompt": "x", "suffix": "!"}, 400, "suffix"),
    (
        "logit_bias past the vocabulary",
        {"prompt": "x", "logit_bias": {"99999999": -100}},
        400,
        "logit_bias",
    ),
    ("logit_bias not an id", {"prompt": "x", "logit_bias": {"the": -100}}, 400, "logit_bias"),
    ("logit_bias over 100", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("best_of other than n", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("unknown stream option", {"prompt": "x", "stream_options": {"x": 1}}, 400, "stream_options.x"),
    ("an unknown model", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_a_clean_4xx_naming_the_field(url, body, status, param):
    if isinstance(body, bytes):
        r = httpx.post(
            f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}
        )
    else:
        r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    if param:
        assert param.split(".")[-1] in error["message"]
    if b"[[[" in (body if isinstance(body, bytes) else b""):
        assert "too deep" in error["message"], error  # valid JSON: not said to be invalid
    assert httpx.get(f"{url}/health").status_code == 200


def test_other_methods_and_paths_are_openai_shaped_4xx(url):
    for r in (
        httpx.get(f"{url}/v1/completions"),
        httpx.post(f"{url}/v1/nothing", json={}),
        httpx.get(f"{url}/v1/models/other"),
    ):
        assert r.status_code in (404, 405) and "message" in r.json()["error"]


def test_a_body_over_the_limit_is_413(url):
    big = json.dumps({"prompt": "x" * (2 << 20)})
    r = httpx.post(
        f"{url}/v1/completions", content=big, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no content-length: counted as it arrives
        for _ in range(40):
            yield b"x" * 65536

    r = httpx.post(f"{url}/v1/completions", content=chunks())
    assert r.status_code == 413
    assert httpx.get(f"{url}/health").status_code == 200


def test_the_api_key_is_required_when_set(run_dir):
    with ServerThread(make_app(run_dir, api_key="s3cret")) as url:
        body = {"prompt": "Hi", "max_tokens": 2}
        for given in ("", "Bearer wrong", "s3cret", "Basic s3cret", "Bearer s3cret2"):
            r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": given})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for scheme in ("bearer", "BEARER"):  # the scheme's name is case-insensitive (RFC 9110)
            keyed = {"Authorization": f"{scheme} s3cret"}
            assert httpx.post(f"{url}/v1/completions", json=body, headers=keyed).status_code == 200
        r = httpx.get(f"{url}/v1/models")
        assert r.status_code == 401
        assert httpx.post(f"{url}/v1/inspect", json={"prompt": "Hi"}).status_code == 401
        assert httpx.post(f"{url}/v1/tokenize", json={"prompt": "Hi"}).status_code == 401
        keyed_count = httpx.post(
            f"{url}/v1/tokenize", json={"prompt": "Hi"}, headers={"Authorization": "Bearer s3cret"}
        )
        assert keyed_count.json()["count"] == 1
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert keyed.completions.create(model=NAME, prompt="Hi", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
        assert httpx.get(f"{url}/health").json()["api_key_required"] is True
        assert httpx.get(url).status_code == 200  # the page itself is public; it asks for the key


# -- /v1/inspect: the page's Inspect view ---------------------------------------------------------
def test_inspect_answers_what_inspect_prompt_finds(url, run_dir):
    model, tokenizer, _ = load_run(run_dir)
    want = inspect_prompt(model, tokenizer, "Hello, I am a", top_k=3, max_tokens=4)
    r = httpx.post(
        f"{url}/v1/inspect", json={"prompt": "Hello, I am a", "top_k": 3, "max_tokens": 4}
    )
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["model"] == NAME and got["cropped"] and got["prompt_tokens"] == 5
    assert [t["id"] for t in got["tokens"]] == want.ids and len(want.ids) == 4
    weights = torch.tensor(got["attention"], dtype=torch.float64)  # (L, nh, T, T)
    assert weights.shape == (2, 2, 4, 4)
    torch.testing.assert_close(weights, want.attention.double(), atol=1e-4, rtol=0)
    torch.testing.assert_close(
        weights.sum(-1), torch.ones(2, 2, 4, dtype=torch.float64), atol=1e-3, rtol=0
    )
    for sent, p in zip(got["positions"], want.positions):
        assert [c["id"] for c in sent["top_k"]] == [c.id for c in p.top_k]
        assert [c["prob"] for c in sent["top_k"]] == pytest.approx(
            [c.prob for c in p.top_k], abs=1e-4
        )
    assert got["loss"] == pytest.approx(want.loss, abs=1e-4)


def test_an_inspection_between_decode_steps_changes_no_completion(client, url, run_dir):
    stream = client.completions.create(
        model=NAME, prompt="The sky", max_tokens=30, temperature=0.9, seed=5, stream=True
    )
    text = ""
    for i, chunk in enumerate(stream):
        if i == 2:  # mid-stream: the inspection runs on the model between two steps
            assert httpx.post(f"{url}/v1/inspect", json={"prompt": "Why not"}).status_code == 200
        text += chunk.choices[0].text
    assert text == expected(run_dir, "The sky", max_new_tokens=30, temperature=0.9, seed=5)


BAD_INSPECT = [
    ("missing prompt", {"top_k": 3}, 400, "prompt"),
    ("prompt a list", {"prompt": ["a"]}, 400, "prompt"),
    ("an empty prompt", {"prompt": ""}, 400, "prompt"),
    ("a prompt over 10,000 characters", {"prompt": "x" * 10_001}, 400, "prompt"),
    ("top_k 0", {"prompt": "x", "top_k": 0}, 400, "top_k"),
    ("top_k 21", {"prompt": "x", "top_k": 21}, 400, "top_k"),
    ("max_tokens 0", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens 65", {"prompt": "x", "max_tokens": 65}, 400, "max_tokens"),
    ("max_tokens a string", {"prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ("an unknown field", {"prompt": "x", "layer": 0}, 400, "layer"),
    ("an unknown model", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize(
    "body,status,param", [b[1:] for b in BAD_INSPECT], ids=[b[0] for b in BAD_INSPECT]
)
def test_bad_inspect_input_is_a_clean_4xx_naming_the_field(url, body, status, param):
    r = httpx.post(f"{url}/v1/inspect", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert httpx.get(f"{url}/health").status_code == 200


def generated_tokens(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics").text.splitlines()
    return float(
        next(m for m in metrics if m.startswith("gptkiln_generated_tokens_total")).split()[-1]
    )


def wait_until_idle(url: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/health").json()["active"]:
        assert time.monotonic() < deadline, "a row stayed busy"
        time.sleep(0.01)


def test_a_full_queue_is_429_and_a_client_that_leaves_frees_its_slot(tmp_path):
    # A wider model with a long context, so one request decodes for a few seconds.
    torch.manual_seed(0)
    tokenizer = load_tokenizer("gpt2")
    config = GPTConfig.from_name("baby", vocab_size=tokenizer.vocab_size, context_length=1024)
    run = save_model(GPT(config), tmp_path / "long", tokenizer=tokenizer)
    with ServerThread(make_app(run, max_batch=1, max_queue=0)) as url:
        long = {"prompt": "a", "max_tokens": 1000, "temperature": 1.0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # its first token: it holds the one row
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "b", "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            assert r.headers["retry-after"] == "1"  # the openai client waits that long
        # the stream was closed after one token: its row is free again at the next step
        wait_until_idle(url)
        assert generated_tokens(url) < 900
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "b", "max_tokens": 2})
        assert r.status_code == 200
        # a client that gives up waiting for a whole (not streamed) answer frees its row too
        before = generated_tokens(url)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json={**long, "stream": False}, timeout=0.3)
        wait_until_idle(url)
        assert generated_tokens(url) - before < 900
        assert 'status="429"' in httpx.get(f"{url}/metrics").text


# -- options -----------------------------------------------------------------------------------
def test_a_non_loopback_host_needs_a_key(capsys, monkeypatch):
    # the flags' own errors, whether port 8000 is free here or not (a server of the user's)
    monkeypatch.setattr("gptkiln.serve.check_can_listen", lambda host, port: None)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")
    options = dict(port=8000, max_batch=8, max_queue=64, max_body_bytes=1 << 20)
    check_serve_options(host="0.0.0.0", api_key="k", **options)
    assert cli_main(["serve", "runs/none", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--api-key" in err
    assert cli_main(["serve", "runs/none", "--max-batch", "0"]) == 2
    assert "--max-batch" in capsys.readouterr().err
    assert cli_main(["serve", "runs/none"]) == 2  # no such run: one line, before any server
    assert "does not exist" in capsys.readouterr().err
    assert cli_main(["serve", "runs/none", "--model-name", " "]) == 2
    assert "--model-name is empty" in capsys.readouterr().err


def test_a_port_in_use_is_one_line_before_the_model_loads(run_dir, capsys):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert cli_main(["serve", str(run_dir), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--port {port}: cannot listen there" in err, err
    assert "pick another --port" in err
