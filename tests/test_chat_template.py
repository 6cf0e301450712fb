"""A model's own chat template (tokenizer_config.json's ``chat_template``): rendered as
``transformers``' ``apply_chat_template`` renders it, text and ids, for templates in the shape of
Llama 3's and Qwen3's; ``gptkiln chat``, ``generate`` and serve's ``/v1/chat/completions`` send
the model that prompt; a broken template is one line. The prompt the model receives is caught
where generation starts; what a tiny random model then says is not looked at."""

from __future__ import annotations

import io
import json
import sys
import warnings
from datetime import datetime

import pytest
import uvicorn
from hf_tokenizer_dirs import write_llama3_dir, write_qwen3_dir
from test_cli import cli

from gptkiln import sampling
from gptkiln.chat_template import ChatTemplate, load_chat_template
from gptkiln.checkpoint import save_model
from gptkiln.config import GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.model import GPT
from gptkiln.tokenizers import load_tokenizer

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Why?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Colour of the sky?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And grass? <|eot_id|> {{ not jinja }}"},
    ],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nFour."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "Six."},  # a tool-less assistant turn last
    ],
    [{"role": "user", "content": '日本語で？ "quotes" & <tags>'}],
]


def auto(directory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(directory)


def hf_ids(hf, messages, add_generation_prompt=True):
    out = hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(params=["llama3", "qwen3"])
def hf_dir(request, tmp_path):
    write = write_llama3_dir if request.param == "llama3" else write_qwen3_dir
    return write(tmp_path / request.param)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendered_text_and_ids_equal_apply_chat_template(hf_dir, add_generation_prompt):
    hf, template = auto(hf_dir), load_chat_template(hf_dir)
    tokenizer = load_tokenizer(hf_dir)
    for messages in CONVERSATIONS:
        want = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        got = template.render(messages, add_generation_prompt=add_generation_prompt)
        assert got == want, messages
        assert tokenizer.encode_templated(got) == hf_ids(hf, messages, add_generation_prompt)


def test_the_template_sees_transformers_helpers_and_special_tokens(tmp_path):
    source = (
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ messages | tojson }}|"
        "{{ messages[0] | tojson(indent=2) }}|{{ strftime_now('%Y') }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}"
        "{% endfor %}|{{ add_generation_prompt }}"
    )
    directory = write_qwen3_dir(tmp_path / "q", template=source)
    messages = [
        {"role": "user", "content": "<b>é & 'x'</b>"},
        {"role": "assistant", "content": "y"},
    ]
    got = load_chat_template(directory).render(messages, add_generation_prompt=False)
    assert got == auto(directory).apply_chat_template(messages, tokenize=False)
    assert "<b>é & 'x'</b>" in got  # not HTML-escaped, not ASCII-escaped: transformers' tojson
    assert str(datetime.now().year) in got and got.startswith("|<|im_end|>|<|endoftext|>|")


def test_raise_exception_and_the_sandbox_are_one_line_errors(tmp_path):
    directory = write_llama3_dir(tmp_path / "l")
    template = load_chat_template(directory)
    with pytest.raises(GptkilnError, match="Only user and assistant roles") as e:
        template.render([{"role": "system", "content": "a"}, {"role": "system", "content": "b"}])
    assert "\n" not in str(e.value)
    sneaky = ChatTemplate("{{ messages.__class__.__mro__ }}", {}, "x")
    with pytest.raises(GptkilnError, match="refused"):
        sneaky.render([{"role": "user", "content": "a"}])


def test_a_named_template_list_and_a_jinja_file_are_read_as_transformers_reads_them(tmp_path):
    directory = write_qwen3_dir(tmp_path / "q")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT{{ messages[0].content }}"},
    ]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "a"}]
    assert load_chat_template(directory).render(messages) == "DEFAULTa"
    (directory / "chat_template.jinja").write_text("FILE{{ messages[0].content }}")
    assert load_chat_template(directory).render(messages) == "FILEa"
    assert auto(directory).apply_chat_template(messages, tokenize=False) == "FILEa"


# -- the commands ------------------------------------------------------------------------------


@pytest.fixture
def chat_run(hf_dir, tmp_path):
    """A tiny random model saved as a run with the directory's tokenizer (and so its template)."""
    tokenizer = load_tokenizer(hf_dir)
    config = GPTConfig.from_name("tiny", vocab_size=tokenizer.vocab_size, context_length=256)
    save_model(GPT(config), tmp_path / "run", tokenizer=tokenizer)
    return tmp_path / "run", auto(hf_dir)


@pytest.fixture
def prompts_seen(monkeypatch):
    """The prompts (token ids) generation is started with; it then gives no tokens."""
    seen: list[list[int]] = []

    def caught(model, prompts, cfg, eot_id=None, use_cache=True, **kw):
        seen.extend(list(p) for p in prompts)
        return iter(())

    monkeypatch.setattr(sampling, "generate_stream", caught)
    return seen


def test_chat_sends_the_conversation_in_the_models_template(
    chat_run, prompts_seen, monkeypatch, capsys
):
    run, hf = chat_run
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi!\nAnd then?\n"))
    code, _, err = cli("chat", run, "--max-new-tokens", 4, capsys=capsys)
    assert code == 0, err
    first = [{"role": "user", "content": "Hi!"}]
    second = [
        *first,
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "And then?"},
    ]
    assert prompts_seen == [hf_ids(hf, first), hf_ids(hf, second)]


def test_chat_says_what_the_model_sees_of_a_message_past_the_context(
    chat_run, prompts_seen, monkeypatch, capsys
):
    """A message longer than the context: the chat's note says what the window holds, Llama 3's
    BOS kept first (as generation keeps it, `sampling.kept_ids`), not "only its last N"."""
    run, hf = chat_run
    long = " ".join(["word"] * 400)  # past the run's context of 256 in any tokenizer
    monkeypatch.setattr(sys, "stdin", io.StringIO(long + "\n"))
    code, _, err = cli("chat", run, "--max-new-tokens", 4, capsys=capsys)
    assert code == 0, err
    note = next(line for line in err.splitlines() if "your message in its template" in line)
    if hf.bos_token == "<|begin_of_text|>":  # Llama 3's, which every text begins with
        assert note.endswith("the model sees <|begin_of_text|> and the last 255"), note
    else:
        assert note.endswith("the model sees the last 256"), note


def test_generate_on_a_chat_model_sends_a_user_message(chat_run, prompts_seen, capsys):
    run, hf = chat_run
    code, _, err = cli("generate", run, "--prompt", "Name a colour.", capsys=capsys)
    assert code == 0 and "has a chat template: each prompt is sent as a user message" in err
    code, _, err = cli(
        "generate", run, "--prompt", "Two", "--input", "words", "--num-samples", 2, capsys=capsys
    )
    assert code == 0, err
    code, _, err = cli("generate", run, "--prompt", "Name a colour.", "--raw", capsys=capsys)
    assert code == 0 and "chat template" not in err
    one = hf_ids(hf, [{"role": "user", "content": "Name a colour."}])
    two = hf_ids(hf, [{"role": "user", "content": "Two\n\nwords"}])
    assert prompts_seen == [one, two, two, hf.encode("Name a colour.")]


def test_serve_chat_completions_use_the_models_template(chat_run, monkeypatch):
    from fastapi.testclient import TestClient

    from gptkiln.serve import app as app_module
    from gptkiln.serve import serve

    run, hf = chat_run
    got, sent = {}, []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: got.setdefault("app", app))
    monkeypatch.setattr("gptkiln.serve.check_can_listen", lambda host, port: None)
    chat_prompt = app_module.chat_prompt

    def caught(*args):
        sent.extend(chat_prompt(*args))
        return sent[-1:]

    monkeypatch.setattr(app_module, "chat_prompt", caught)
    serve(run, model_name="m", max_batch=2, max_queue=4, log_level="warning")
    messages = CONVERSATIONS[2]
    with TestClient(got["app"]) as client:
        r = client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": messages, "max_tokens": 3, "temperature": 0},
        )
    assert r.status_code == 200, r.text
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert sent == [(text, hf_ids(hf, messages))]
    assert r.json()["usage"]["prompt_tokens"] == len(hf_ids(hf, messages))


def test_a_broken_template_is_one_line_exit_2(tmp_path, capsys):
    directory = write_llama3_dir(tmp_path / "l", template="{% for m in messages %}{{ m }")
    tokenizer = load_tokenizer(directory)
    config = GPTConfig.from_name("tiny", vocab_size=tokenizer.vocab_size, context_length=64)
    save_model(GPT(config), tmp_path / "run", tokenizer=tokenizer)
    for command in (["chat"], ["generate", "--prompt", "hi"]):
        code, _, err = cli(command[0], tmp_path / "run", *command[1:], capsys=capsys)
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "chat template is not valid jinja2" in lines[0], err
        assert "tokenizer_config.json" in lines[0]


def test_a_models_generation_config_sets_the_sampling_no_flag_gives(chat_run, monkeypatch, capsys):
    """Qwen3's generation_config.json (do_sample, temperature 0.6, top-k 20, top-p 0.95) is how
    generate and chat sample where no flag says otherwise, as transformers and vLLM take it,
    with a note; a flag given wins; do_sample false is greedy; and the Python API's."""
    from gptkiln.api import complete, stream_text
    from gptkiln.config import SampleConfig
    from gptkiln.config.sample import model_sampling

    run, _ = chat_run
    config_path = run / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    config_path.write_text(json.dumps({**config, **qwen3}))
    assert model_sampling(run) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    for odd, read in [
        ({"do_sample": True}, {"temperature": 1.0}),  # sampled at transformers' temperature 1
        ({"top_k": float("inf"), "top_p": 1.5, "temperature": "hot"}, {}),  # no valid values
        ({"do_sample": False, "temperature": 0.6, "repetition_penalty": 1.1},
         {"temperature": 0.0, "repetition_penalty": 1.1}),  # greedy, still penalised
    ]:  # fmt: skip
        config_path.write_text(json.dumps({**config, **odd}))
        assert model_sampling(run) == read, odd
    config_path.write_text(json.dumps({**config, **qwen3}))
    used = []
    real = sampling.generate_stream

    def seen(model, prompts, cfg, *args, **kwargs):
        used.append((cfg.temperature, cfg.top_k, cfg.top_p))
        return real(model, prompts, cfg, *args, **kwargs)

    monkeypatch.setattr(sampling, "generate_stream", seen)
    base = ["generate", run, "--prompt", "Hi", "--max-new-tokens", 3, "--seed", 1]
    code, _, err = cli(*base, capsys=capsys)
    assert code == 0 and used[-1] == (0.6, 20, 0.95)
    assert "generation_config.json sets it: temperature 0.6, top k 20, top p 0.95" in err
    code, _, err = cli(*base, "--temperature", 0.9, "--top-k", 5, capsys=capsys)
    assert code == 0 and used[-1] == (0.9, 5, 0.95) and "temperature 0.6" not in err
    code, _, err = cli(*base, "--top-k", 0, capsys=capsys)  # 0: the model's top-k set aside
    assert code == 0 and used[-1] == (0.6, None, 0.95), err
    config_path.write_text(json.dumps({**config, "do_sample": False, "temperature": 0.6}))
    code, _, err = cli(*base, capsys=capsys)
    assert code == 0 and used[-1] == (0.0, None, None) and "greedy (do_sample false)" in err
    config_path.write_text(json.dumps(config))  # none set: the command's own defaults
    code, _, err = cli(*base, capsys=capsys)
    assert code == 0 and used[-1] == (0.8, None, None) and "generation_config" not in err
    config_path.write_text(json.dumps({**config, **qwen3}))
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    code, _, err = cli("chat", run, "--max-new-tokens", 3, "--seed", 1, capsys=capsys)
    assert code == 0 and used[-1] == (0.6, 20, 0.95) and "top p 0.95" in err
    # the Python API without a SampleConfig: the same, its keyword arguments as the flags (as
    # transformers' generate takes a model's generation config); a SampleConfig given as it is
    notes = []
    complete(run, "Hi", max_new_tokens=2, seed=1, on_notice=notes.append)
    assert used[-1] == (0.6, 20, 0.95)
    assert any("generation_config.json sets it: temperature 0.6, top_k 20" in n for n in notes)
    complete(run, "Hi", max_new_tokens=2, seed=1, temperature=0.9)
    assert used[-1] == (0.9, 20, 0.95)
    list(stream_text(run, "Hi", max_new_tokens=2, seed=1))
    assert used[-1] == (0.6, 20, 0.95)
    notes.clear()
    complete(run, "Hi", SampleConfig(max_new_tokens=2, seed=1), on_notice=notes.append)
    assert used[-1] == (1.0, None, None) and not any("generation_config" in n for n in notes)
