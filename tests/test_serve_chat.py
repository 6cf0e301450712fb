"""POST /v1/chat/completions over real HTTP: an instruction-tuned run's chat, read by the
official openai client, equal to what ``gptkiln chat`` and ``generate`` answer; a plain run and
bad messages are clean 400s; the page's Chat view (headless Chromium) says the same.

The run is fine-tuned here (a tiny GPT with a character tokenizer, seconds), then served by
`gptkiln.serve.serve` itself (uvicorn.run caught, the app run in a thread), so the test also
sees serve() hand the run's stored template to the app.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import string
from typing import Literal

import httpx
import openai
import pydantic
import pytest
import torch
import uvicorn
from browser import fill, wait_for
from instruction_data import instructions
from serving import ServerThread

import gptkiln.serve
from gptkiln.api import stream_from_model, stream_text
from gptkiln.chat import Chat
from gptkiln.checkpoint import save_model
from gptkiln.config import FinetuneConfig, GPTConfig, SampleConfig
from gptkiln.finetune import finetune, train_config
from gptkiln.finetune.templates import ALPACA, format_conversation
from gptkiln.loading import load_run
from gptkiln.model import GPT
from gptkiln.serve import serve
from gptkiln.serve.app import create_app
from gptkiln.tokenizers import build_char_tokenizer

CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"
NAME = "chat-run"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(a plain base run, the run instruction-tuned from it with the book's template)."""
    root = tmp_path_factory.mktemp("chat")
    tokenizer = build_char_tokenizer([CHARS], with_eot=True)
    torch.manual_seed(0)
    config = GPTConfig.from_name("tiny", vocab_size=tokenizer.vocab_size, context_length=256)
    save_model(GPT(config), root / "base", tokenizer=tokenizer)
    (root / "instructions.json").write_text(json.dumps(instructions(60)))
    ft = FinetuneConfig(base=str(root / "base"), data=str(root / "instructions.json"))
    settings = dict(batch_size=4, lr=3e-3, progress=False, sample_tokens=4, eval_interval=50)
    finetune(ft, train_config(ft, out=str(root / NAME), epochs=3, **settings))
    return root / "base", root / NAME


def served_app(run_dir, monkeypatch):
    """The app `gptkiln serve RUN` would run (uvicorn.run caught before it listens)."""
    got = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: got.setdefault("app", app))
    # nothing listens on serve()'s port (8000), which another program may hold
    monkeypatch.setattr(gptkiln.serve, "check_can_listen", lambda host, port: None)
    serve(run_dir, model_name=NAME, max_batch=4, max_queue=8, log_level="warning")
    return got["app"]


@pytest.fixture(scope="module")
def url(runs):
    with pytest.MonkeyPatch.context() as monkeypatch:
        app = served_app(runs[1], monkeypatch)
    with ServerThread(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def greedy(max_new_tokens: int = 24, **cfg) -> SampleConfig:
    return SampleConfig(max_new_tokens=max_new_tokens, temperature=0, **cfg)


# -- the official client -----------------------------------------------------------------------
def test_a_chat_answer_is_what_generate_and_chat_answer(client, runs):
    run = runs[1]
    r = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Repeat sun."}],
        max_tokens=24,
        temperature=0,
    )
    assert r.object == "chat.completion" and r.model == NAME and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    first = "".join(stream_text(run, "Repeat sun.", greedy()))  # gptkiln generate RUN --prompt
    assert choice.message.content == first
    tokens = len(load_run(run)[1].encode(format_conversation(ALPACA, [], "Repeat sun.")))
    assert r.usage.prompt_tokens == tokens
    assert r.usage.total_tokens == tokens + r.usage.completion_tokens

    # a conversation: gptkiln chat's second reply, given its first turn as messages
    chat = Chat(run, greedy())
    assert "".join(chat.reply("Repeat sun.")) == first
    prompt = chat.prompt("Repeat the input.")  # the first turn, then the message
    second = "".join(chat.reply("Repeat the input."))
    r = client.chat.completions.create(
        model=NAME,
        messages=[
            {"role": "user", "content": "Repeat sun."},
            {"role": "assistant", "content": chat.turns[0][1]},
            {"role": "user", "content": "Repeat the input."},
        ],
        max_completion_tokens=24,  # OpenAI's newer name for max_tokens
        temperature=0,
    )
    assert r.choices[0].message.content == second
    assert r.usage.prompt_tokens == len(chat.tokenizer.encode(prompt))


def test_tokenize_counts_messages_in_the_runs_template(url, runs):
    """The page sizes a chat's Max tokens by this count: the prompt_tokens a chat request has."""
    messages = [{"role": "user", "content": "Repeat sun."}]
    got = httpx.post(f"{url}/v1/tokenize", json={"messages": messages}).json()
    text = format_conversation(ALPACA, [], "Repeat sun.")
    assert got == {"count": len(load_run(runs[1])[1].encode(text)), "max_model_len": 256}
    assert httpx.get(f"{url}/health").json()["context_length"] == 256


class Colour(pydantic.BaseModel):
    colour: Literal["red", "green", "blue"]
    count: int = pydantic.Field(ge=0, le=9)


def test_a_trained_run_answers_in_a_pydantic_schema(client):
    r = client.chat.completions.parse(
        model=NAME,
        messages=[{"role": "user", "content": "Repeat sun."}],
        response_format=Colour,
        max_tokens=80,
        temperature=0,
    )
    assert isinstance(r.choices[0].message.parsed, Colour), r.choices[0].message.content


def test_a_system_message_replaces_the_templates_system_text(client, runs):
    run = runs[1]
    model, tokenizer, _ = load_run(run)
    system = "You repeat words."
    prompt = format_conversation(dataclasses.replace(ALPACA, system=system), [], "Repeat cat.")
    cfg = greedy(stop=ALPACA.stop_strings())
    want = "".join(stream_from_model(model, tokenizer, prompt, cfg))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Repeat cat."}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert want != "".join(stream_text(run, "Repeat cat.", greedy()))  # the system text counts


def test_a_stream_is_the_role_then_the_same_text_then_the_finish(client, runs):
    run, message = runs[1], "Repeat the input."
    cfg = SampleConfig(max_new_tokens=40, temperature=0.8, seed=3)
    free = "".join(stream_text(run, message, cfg))  # a character a token
    # a stop string that starts with the last token's text: it is held back until the end
    end = next(p for p in range(20, len(free) - 3) if free.find(free[p : p + 3]) == p) + 1
    stop = free[end - 1 : end + 2]
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": message}],
            max_tokens=end,
            temperature=0.8,
            seed=3,
            stop=stop,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    middle = chunks[1:-2]
    assert middle and all(c.choices[0].delta.content for c in middle)
    text = "".join(c.choices[0].delta.content for c in middle)
    cut = dataclasses.replace(cfg, max_new_tokens=end, stop=(stop,))
    assert text == free[:end] == "".join(stream_text(run, message, cut))
    last = chunks[-2].choices[0]
    assert last.delta.content is None and last.finish_reason == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == end
    assert usage.total_tokens == usage.prompt_tokens + end
    timings = chunks[-1].model_extra["timings"]  # llama.cpp's, on the usage chunk alone
    assert timings["predicted_n"] == end and timings["predicted_per_second"] > 0
    assert timings["prompt_n"] == usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
    assert all(not c.model_extra for c in chunks[:-1])
    whole = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": message}], max_tokens=3
    )
    assert whole.model_extra["timings"]["predicted_n"] == whole.usage.completion_tokens == 3


def test_n_samples_draw_with_seed_plus_j_and_penalties_apply(client, runs):
    run = runs[1]
    messages = [{"role": "user", "content": "Repeat moon."}]
    r = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=20, temperature=1.0, seed=7, n=2
    )
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        cfg = SampleConfig(max_new_tokens=20, temperature=1.0, seed=7 + c.index)
        assert c.message.content == "".join(stream_text(run, "Repeat moon.", cfg))
    r = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=20, temperature=0, frequency_penalty=2.0
    )
    cfg = greedy(20, frequency_penalty=2.0)
    assert r.choices[0].message.content == "".join(stream_text(run, "Repeat moon.", cfg))


def test_the_templates_headers_end_an_answer(runs, monkeypatch, tmp_path):
    # A chat prompt never holds the template's input part, so its header changes no prompt: a
    # copy of the run whose input header is a word the model writes shows that the template's
    # stop strings end the answer (they are added to the request's own).
    run = tmp_path / NAME
    shutil.copytree(runs[1], run)
    model, tokenizer, cfg = load_run(run)
    prompt = format_conversation(ALPACA, [], "Repeat sun.")
    free = "".join(stream_from_model(model, tokenizer, prompt, greedy(40)))
    word = free.split()[0]
    assert "{input}" not in word and "{" not in word, free
    cfg["finetune"]["template"]["input"] = f"\n\n{word}\n{{input}}"
    (run / "config.json").write_text(json.dumps(cfg))
    with ServerThread(served_app(run, monkeypatch)) as url:
        body = {"messages": [{"role": "user", "content": "Repeat sun."}], "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 40}).json()
    choice = r["choices"][0]
    assert choice["message"]["content"] == free[: free.index(word)]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == "".join(stream_text(run, "Repeat sun.", greedy(40)))


# -- refusals ----------------------------------------------------------------------------------
def test_a_plain_run_refuses_chat_and_still_completes(runs):
    model, tokenizer, _ = load_run(runs[0])
    app = create_app(model.eval(), tokenizer, model_name="base")  # no template: a plain run
    with ServerThread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="base", messages=[{"role": "user", "content": "Hi."}]
            )
        assert "not instruction-tuned" in e.value.message and "/v1/completions" in e.value.message
        assert e.value.body["code"] == "not_instruction_tuned"
        r = client.completions.create(model="base", prompt="Hi", max_tokens=3)
        assert r.usage.completion_tokens == 3


def test_serve_hands_no_template_for_a_plain_run(runs, monkeypatch):
    with ServerThread(served_app(runs[0], monkeypatch)) as url:
        body = {"messages": [{"role": "user", "content": "Hi."}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "not_instruction_tuned"


def test_a_request_that_leaves_sampling_out_takes_the_models_generation_config(
    runs, monkeypatch, tmp_path, capsys
):
    """vLLM's --generation-config auto: the fields of a request left out (temperature here)
    are what the run's generation_config.json sets; one given, or OpenAI's default where the
    model sets none, is the request's. The startup line says so."""
    run = tmp_path / "run"
    shutil.copytree(runs[1], run)
    (run / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    body = {"prompt": "Repeat sun.", "max_tokens": 12, "seed": 3}
    with ServerThread(served_app(run, monkeypatch)) as url:
        left_out = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
        greedy = {**body, "temperature": 0}
        said = httpx.post(f"{url}/v1/completions", json=greedy).json()["choices"][0]["text"]
        hot = {**body, "temperature": 1.5}
        drawn = httpx.post(f"{url}/v1/completions", json=hot).json()["choices"][0]["text"]
        null = {**body, "temperature": None, "top_k": None}
        nulled = httpx.post(f"{url}/v1/completions", json=null).json()["choices"][0]["text"]
    assert left_out == said != drawn
    assert nulled == left_out  # null is left out, as vLLM reads it
    assert "leaves them out samples with its generation_config.json's greedy (do_sample false)" in (
        capsys.readouterr().err
    )
    with ServerThread(served_app(runs[1], monkeypatch)) as url:  # none: OpenAI's temperature 1
        left_out = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
        hot = {**body, "temperature": 1.0}
        assert (
            left_out == httpx.post(f"{url}/v1/completions", json=hot).json()["choices"][0]["text"]
        )


USER = {"role": "user", "content": "Repeat sun."}
BAD = [
    ("an empty list", {"messages": []}, "messages", "(none)"),
    ("a wrong role", {"messages": [{"role": "bot", "content": "x"}]}, "messages", "'bot'"),
    (
        "two users in a row",
        {"messages": [USER, USER]},
        "messages",
        "user, user",
    ),
    (
        "ending with the assistant",
        {"messages": [USER, {"role": "assistant", "content": "sun"}]},
        "messages",
        "user, assistant",
    ),
    (
        "a system message later",
        {"messages": [USER, {"role": "system", "content": "s"}]},
        "messages",
        "user, system",
    ),
    ("a missing content", {"messages": [{"role": "user"}]}, "messages[0].content", "required"),
    (
        "a null content",
        {"messages": [{"role": "user", "content": None}]},
        "messages[0].content",
        "",
    ),
    ("a missing role", {"messages": [{"content": "x"}]}, "messages[0].role", "required"),
    ("messages not a list", {"messages": "Repeat sun."}, "messages", "list"),
    ("a message not an object", {"messages": ["hi"]}, "messages[0]", "an object {role"),
    ("no messages", {"max_tokens": 3}, "messages", "required"),
    (
        "an unknown message field",
        {"messages": [{**USER, "weight": 1}]},
        "messages[0].weight",
        "role, content, name",
    ),
    ("an unknown field", {"messages": [USER], "functions": []}, "functions", "unknown"),
    (
        "two budgets that disagree",
        {"messages": [USER], "max_tokens": 3, "max_completion_tokens": 4},
        "max_completion_tokens",
        "disagree",
    ),
    ("too many tokens", {"messages": [USER], "max_tokens": 500}, "max_tokens", "at most"),
    ("too long", {"messages": [{"role": "user", "content": "x" * 300}]}, "messages", "shorten"),
    ("a bad temperature", {"messages": [USER], "temperature": 3}, "temperature", "[0, 2]"),
    ("five stop strings", {"messages": [USER], "stop": list("abcde")}, "stop", "up to 4"),
    # a field inside another is described as itself, not as the object around it
    (
        "a schema name with a space",
        {
            "messages": [USER],
            "response_format": {"type": "json_schema", "json_schema": {"name": "a b"}},
        },
        "response_format.json_schema.name",
        "1 to 64 letters",
    ),
    (
        "an unknown format type",
        {"messages": [USER], "response_format": {"type": "yaml"}},
        "response_format.type",
        '"text", "json_object" or "json_schema", got "yaml"',
    ),
    (
        "tool call arguments as an object",
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}
                    ],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
        "a JSON object as a string",
    ),
]


@pytest.mark.parametrize("body,param,needle", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_messages_are_a_clean_400_naming_the_field(url, body, param, needle):
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param.split("[")[0] in error["message"] and needle in error["message"]
    good = {"messages": [USER], "max_tokens": 2}
    assert httpx.post(f"{url}/v1/chat/completions", json=good).status_code == 200


# -- the page's Chat view, in a real headless Chromium ---------------------------------------
def chat_page(browser, url, max_tokens: str, temperature: str) -> None:
    """Open the page, set the Generate view's sampling (which Chat uses), switch to Chat."""
    browser.get(url)
    wait_for(lambda: NAME in browser.find_element("id", "model-info").text)
    fill(browser, "max-tokens", max_tokens)
    fill(browser, "temperature", temperature)
    wait_for(lambda: browser.find_element("id", "tab-chat").is_displayed())
    browser.find_element("id", "tab-chat").click()


def say(browser, text: str) -> str:
    """Send a message; the answer as the page shows it (its last assistant bubble)."""
    answers = len(browser.find_elements("css selector", ".msg.assistant"))
    fill(browser, "chat-input", text)
    browser.find_element("id", "chat-send").click()
    status = browser.find_element("id", "chat-status")
    wait_for(lambda: status.get_attribute("data-state") in ("done", "error"))
    bubbles = browser.find_elements("css selector", ".msg.assistant")
    assert len(bubbles) == answers + 1, browser.find_element("id", "chat-error").text
    return bubbles[-1].get_attribute("textContent")


def test_the_page_chats_as_gptkiln_chat_does_and_new_chat_forgets(browser, url, runs):
    run = runs[1]
    chat = Chat(run, greedy())
    first, second = "".join(chat.reply("Repeat sun.")), "".join(chat.reply("Repeat the input."))
    alone = "".join(Chat(run, greedy()).reply("Repeat the input."))  # no first turn
    assert second != alone  # the conversation so far changes the answer

    chat_page(browser, url, max_tokens="24", temperature="0")
    assert say(browser, "Repeat sun.") == first
    assert say(browser, "Repeat the input.") == second  # both turns went as messages
    users = [
        m.get_attribute("textContent") for m in browser.find_elements("css selector", ".msg.user")
    ]
    assert users == ["Repeat sun.", "Repeat the input."]
    assert int(browser.find_element("id", "chat-tokens").text) > 0  # the stream's usage

    browser.find_element("id", "chat-reset").click()
    assert browser.find_elements("css selector", ".msg") == []
    assert say(browser, "Repeat the input.") == alone


def test_the_json_switch_makes_the_answer_a_json_object(browser, url):
    chat_page(browser, url, max_tokens="100", temperature="0")
    browser.find_element("id", "chat-json").click()
    answer = say(browser, "Repeat sun.")
    assert isinstance(json.loads(answer), dict), answer
    browser.find_element("id", "chat-json").click()  # off again: free text
    with pytest.raises(ValueError):
        json.loads(say(browser, "Repeat sun."))


def test_a_chat_error_is_shown_and_the_message_given_back(browser, url):
    chat_page(browser, url, max_tokens="24", temperature="5")  # above OpenAI's 2
    fill(browser, "chat-input", "Repeat sun.")
    browser.find_element("id", "chat-send").click()
    status = browser.find_element("id", "chat-status")
    wait_for(lambda: status.get_attribute("data-state") == "error")
    assert "temperature" in browser.find_element("id", "chat-error").text
    assert browser.find_elements("css selector", ".msg") == []
    assert browser.find_element("id", "chat-input").get_attribute("value") == "Repeat sun."


def test_a_plain_run_has_no_chat_tab(browser, runs):
    model, tokenizer, _ = load_run(runs[0])
    with ServerThread(create_app(model.eval(), tokenizer, model_name="base")) as url:
        assert httpx.get(f"{url}/health").json()["chat"] is False
        browser.get(url)
        wait_for(lambda: "base" in browser.find_element("id", "model-info").text)
        assert not browser.find_element("id", "tab-chat").is_displayed()


def test_the_page_drops_the_oldest_turns_that_no_longer_fit_as_gptkiln_chat_does(
    browser, url, runs
):
    messages = ["Repeat sun.", "Repeat the input.", "Repeat moon."]
    chat = Chat(runs[1], greedy())  # 24 new tokens: the third prompt holds one earlier turn
    want, prompts = [], []
    for message in messages:
        prompts.append(chat.prompt(message))
        want.append("".join(chat.reply(message)))
    assert "Repeat sun." in prompts[1] and "Repeat sun." not in prompts[2]
    assert "Repeat the input." in prompts[2]

    chat_page(browser, url, max_tokens="24", temperature="0")
    assert [say(browser, m) for m in messages] == want
    bubbles = browser.find_elements("css selector", ".msg")
    forgotten = ["forgotten" in b.get_attribute("class") for b in bubbles]
    assert forgotten == [True, True, False, False, False, False]  # the first question and answer


def test_a_message_that_cannot_fit_is_refused_on_the_page_before_it_is_sent(browser, url, runs):
    """The conversation is counted in the template first (POST /v1/tokenize): a message that
    leaves no room for Max tokens is refused with the server's words, and given back."""
    _, tokenizer, _ = load_run(runs[1])
    count = len(tokenizer.encode(format_conversation(ALPACA, [], "Repeat sun.")))

    def chats_answered() -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in httpx.get(f"{url}/metrics").text.splitlines()
            if line.startswith("gptkiln_requests_total") and 'route="/v1/chat/completions"' in line
        )

    sent = chats_answered()
    chat_page(browser, url, max_tokens="250", temperature="0")  # context 256
    fill(browser, "chat-input", "Repeat sun.")
    browser.find_element("id", "chat-send").click()
    status = browser.find_element("id", "chat-status")
    wait_for(lambda: status.get_attribute("data-state") == "error")
    error = browser.find_element("id", "chat-error").text
    assert f"the message's {count} tokens plus Max tokens 250 exceed" in error
    assert f"at most {256 - count}" in error
    assert browser.find_element("id", "chat-input").get_attribute("value") == "Repeat sun."
    assert chats_answered() == sent  # the page said it; the server never heard


def test_a_refused_message_takes_no_earlier_turn_out_of_the_conversation(browser, url, runs):
    """A message too long for the context is refused and given back; the turns before it,
    dropped one by one while the page looked for room, are sent again with the next message."""
    chat = Chat(runs[1], greedy())
    first, second = "".join(chat.reply("Repeat sun.")), "".join(chat.reply("Repeat the input."))
    chat_page(browser, url, max_tokens="24", temperature="0")
    assert say(browser, "Repeat sun.") == first
    fill(browser, "chat-input", "x" * 300)  # context 256
    browser.find_element("id", "chat-send").click()
    status = browser.find_element("id", "chat-status")
    wait_for(lambda: status.get_attribute("data-state") == "error")
    assert "more than the model's context" in browser.find_element("id", "chat-error").text
    bubbles = browser.find_elements("css selector", ".msg")
    assert ["forgotten" in b.get_attribute("class") for b in bubbles] == [False, False]
    assert say(browser, "Repeat the input.") == second  # the first turn went with it


def test_the_chat_settings_fit_their_panel(browser, url):
    """The JSON switch's words wrap inside the settings panel: as flex items of their label,
    each piece of text was a column of its own, wider than the panel and the page."""
    chat_page(browser, url, max_tokens="24", temperature="0")
    for width in (1280, 800):
        browser.set_window_size(width, 900)
        label = browser.find_element("css selector", "label[for=chat-json]").rect
        panel = browser.find_element("css selector", "#view-chat .settings").rect
        assert label["x"] + label["width"] <= panel["x"] + panel["width"], width
        assert label["height"] < 80, width  # a few lines, not a word a line
        width_scrolled = browser.execute_script("return document.documentElement.scrollWidth")
        assert width_scrolled <= browser.execute_script("return window.innerWidth"), width


def test_a_64_token_chat_model_answers_with_max_tokens_left_as_the_page_set_it(
    browser, tmp_path, monkeypatch
):
    """Max tokens the person has not set is what fits the conversation: on a 64-token model
    (the README's tour) the page sized it for an empty message, and the first real message
    was refused."""
    from gptkiln.tokenizers import GPT2Tokenizer

    tokenizer = GPT2Tokenizer()
    torch.manual_seed(0)
    config = GPTConfig.from_name("tiny", vocab_size=tokenizer.vocab_size, context_length=64)
    template = {"finetune": {"task": "instruct", "template": ALPACA.to_dict()}}
    run = save_model(GPT(config), tmp_path / "small", tokenizer=tokenizer, extra=template)
    message = "Repeat the word, please."
    count = len(tokenizer.encode(format_conversation(ALPACA, [], message)))
    empty = len(tokenizer.encode(format_conversation(ALPACA, [], "")))
    assert count + min(100, 64 - empty) > 64  # what the page first sized would not fit
    with ServerThread(served_app(run, monkeypatch)) as url:
        browser.get(url)
        wait_for(lambda: "context 64" in browser.find_element("id", "model-info").text)
        wait_for(lambda: browser.find_element("id", "tab-chat").is_displayed())
        browser.find_element("id", "tab-chat").click()
        say(browser, message)  # Max tokens untouched, as a new user leaves it
        assert browser.find_element("id", "chat-status").get_attribute("data-state") == "done"
        sized = browser.find_element("id", "max-tokens").get_attribute("value")
        assert browser.find_element("id", "chat-max-tokens").text == sized  # as fitted
        assert browser.find_element("id", "max-tokens").get_attribute("value") == str(64 - count)


def test_nulls_mean_the_defaults_and_developer_is_system(client, url, runs):
    """OpenAI's nullable fields sent as null take their defaults (agent frameworks send them),
    and a ``developer`` message is the system message under OpenAI's newer name."""
    nulls = dict.fromkeys(
        ("temperature", "top_p", "n", "stream", "logprobs", "presence_penalty",
         "frequency_penalty", "seed", "stop", "stream_options", "response_format"),
    )  # fmt: skip
    body = {"messages": [USER], "max_tokens": 6, **nulls}
    with_nulls = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert with_nulls.status_code == 200, with_nulls.text
    [choice] = with_nulls.json()["choices"]  # n: 1, not streamed, no logprobs
    assert choice["logprobs"] is None and choice["message"]["content"] is not None
    echo = {"prompt": "Repeat", "max_tokens": 0, "echo": None, "temperature": None, "n": None}
    completion = httpx.post(f"{url}/v1/completions", json=echo)
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] == ""  # echo: false

    system = "Answer in French."
    greedy_body = {"max_tokens": 8, "temperature": 0}
    as_system = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": [{"role": "system", "content": system}, USER], **greedy_body},
    ).json()["choices"][0]["message"]["content"]
    as_developer = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": [{"role": "developer", "content": system}, USER], **greedy_body},
    )
    assert as_developer.status_code == 200, as_developer.text
    assert as_developer.json()["choices"][0]["message"]["content"] == as_system


IGNORED = {
    "store": False,
    "metadata": {"run": "a"},
    "service_tier": "auto",
    "prompt_cache_key": "k",
    "safety_identifier": "s",
    "user": "u",
    "reasoning_effort": "low",
    "verbosity": "low",
    "modalities": ["text"],
    "prediction": None,
    "web_search_options": None,
    "logit_bias": {},
}


def test_the_fields_agent_sdks_send_are_taken_and_ignored(url):
    """OpenAI's fields that are no-ops for a local server (what agent SDKs pass through) are
    taken and change nothing; those that would change the answer are a 400 "not supported"
    naming the field, not "unknown field"."""
    body = {"messages": [USER], "max_tokens": 8, "temperature": 0}
    plain = httpx.post(f"{url}/v1/chat/completions", json=body).json()
    sent = httpx.post(f"{url}/v1/chat/completions", json={**body, **IGNORED})
    assert sent.status_code == 200, sent.text
    assert sent.json()["choices"] == plain["choices"]
    for field, value in [
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "sun"}),
        ("web_search_options", {}),
    ]:
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, field: value})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field, r.text
        assert "not supported" in error["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "store": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "store"


def test_ignore_eos_goes_on_past_the_end_of_text(url):
    """vLLM's ``ignore_eos`` on both endpoints: the sequence does not stop at the end-of-text
    ids (`SampleConfig.stop_at_eos`, which the batcher reads)."""
    from gptkiln.serve.parsing import sample_config
    from gptkiln.serve.schemas import ChatCompletionRequest, CompletionRequest

    for model, body in [
        (ChatCompletionRequest, {"messages": [USER]}),
        (CompletionRequest, {"prompt": "Repeat sun."}),
    ]:
        assert sample_config(model.model_validate(body), [[1]], 64).stop_at_eos
        going = model.model_validate({**body, "ignore_eos": True})
        assert not sample_config(going, [[1]], 64).stop_at_eos
    for path, body in [
        ("chat/completions", {"messages": [USER]}),
        ("completions", {"prompt": "R"}),
    ]:
        r = httpx.post(f"{url}/v1/{path}", json={**body, "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        r = httpx.post(f"{url}/v1/{path}", json={**body, "ignore_eos": "yes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos", r.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_end_where_the_content_does(client, stream):
    """A stop string's tokens are not in the content, nor in its logprobs: the scored tokens'
    bytes spell the content."""
    ask = dict(model=NAME, messages=[USER], max_tokens=30, temperature=0, logprobs=True)
    free = client.chat.completions.create(**ask).choices[0].message.content
    stop = free.strip()[2:4]
    ask["stop"] = [stop]
    if stream:
        chunks = [c for c in client.chat.completions.create(**ask, stream=True) if c.choices]
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        scored = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    else:
        got = client.chat.completions.create(**ask).choices[0]
        content, scored = got.message.content, got.logprobs.content
    assert content == free[: free.index(stop)]
    assert b"".join(bytes(t.bytes) for t in scored).decode("utf-8") == content


def test_a_stop_before_any_answer_gives_the_message_back(browser, url, runs):
    """Send and Stop at once: no empty answer is kept as the model's turn (it was, and went
    with every later message); the message is back in the box, as after an error."""
    first = "".join(Chat(runs[1], greedy()).reply("Repeat sun."))
    chat_page(browser, url, max_tokens="24", temperature="0")
    browser.execute_script(
        "document.getElementById('chat-input').value = 'Repeat the input.';"
        "document.getElementById('chat-send').click();"
        "document.getElementById('chat-stop').click();"
    )
    status = browser.find_element("id", "chat-status")
    wait_for(lambda: status.get_attribute("data-state") != "running")
    assert status.get_attribute("data-state") == "stopped"
    assert browser.find_elements("css selector", ".msg") == []
    assert browser.find_element("id", "chat-input").get_attribute("value") == "Repeat the input."
    assert browser.find_element("id", "chat-error").text == ""
    assert say(browser, "Repeat sun.") == first  # alone: no empty turn went before it


def test_a_stopped_answer_shows_the_tokens_it_got(browser, url):
    """The Chat view counts an answer's tokens as they come: it showed 0 beside a stopped
    answer's text, the count coming only with the stream's last chunk (its usage)."""
    chat_page(browser, url, max_tokens="100", temperature="2")
    fill(browser, "seed", "0")
    browser.execute_script(
        "new MutationObserver((changes, observer) => {"
        "  const answer = document.querySelector('.msg.assistant');"
        "  if (answer && answer.textContent.length > 3) {"
        "    document.getElementById('chat-stop').click(); observer.disconnect(); }"
        "}).observe(document.getElementById('chat-log'),"
        "  {subtree: true, childList: true, characterData: true});"
        "document.getElementById('chat-input').value = 'Repeat sun.';"
        "document.getElementById('chat-send').click();"
    )
    status = browser.find_element("id", "chat-status")
    wait_for(lambda: status.get_attribute("data-state") != "running")
    error = browser.find_element("id", "chat-error").text
    assert status.get_attribute("data-state") == "stopped", error
    (answer,) = browser.find_elements("css selector", ".msg.assistant")
    assert len(answer.get_attribute("textContent")) > 3
    assert int(browser.find_element("id", "chat-tokens").text) > 3


def test_the_chat_view_shows_the_max_tokens_its_answers_get(browser, url):
    """Max tokens lives in the Generate view; the Chat view notes it beside the tokens, as the
    page sizes it and as the person sets it."""
    browser.get(url)
    wait_for(lambda: NAME in browser.find_element("id", "model-info").text)
    field = browser.find_element("id", "max-tokens")
    wait_for(lambda: browser.find_element("id", "max-tokens-room").text.startswith("≤"))
    shown = browser.find_element("id", "chat-max-tokens")
    assert shown.get_property("textContent") == field.get_attribute("value")  # sized by the page
    chat_page(browser, url, max_tokens="24", temperature="0")
    assert browser.find_element("id", "chat-max-tokens").text == "24"
