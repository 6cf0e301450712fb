"""Chat fine-tuning: conversations rendered by the model's own chat template (the real ones of
Qwen3-0.6B, Llama 3.1 Instruct and SmolLM3, in tests/chat_templates), loss on the assistant's
turns exactly, the template kept in the run; ``--show-examples``; bad data in one line.

The models are tiny and random, built by the tests; the tokenizers are written offline
(`hf_tokenizer_dirs`)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from hf_tokenizer_dirs import write_llama3_dir, write_qwen3_dir
from test_cli import assert_one_line_error, cli

from gptkiln.chat_template import CHAT_TEMPLATE_FILE, load_chat_template
from gptkiln.checkpoint import save_model
from gptkiln.config import FinetuneConfig, GPTConfig
from gptkiln.finetune import finetune, train_config
from gptkiln.finetune.chat import ConversationEncoder, collate_examples, fit_length
from gptkiln.finetune.templates import conversation_pieces
from gptkiln.model import GPT
from gptkiln.tokenizers import build_char_tokenizer, load_tokenizer
from gptkiln.train import read_metrics

TEMPLATES = Path(__file__).parent / "chat_templates"
QWEN3 = (TEMPLATES / "qwen3-0.6b.jinja").read_text(encoding="utf-8")
LLAMA3 = (TEMPLATES / "llama-3.1-8b-instruct.jinja").read_text(encoding="utf-8")
SMOLLM3 = (TEMPLATES / "smollm3-3b.jinja").read_text(encoding="utf-8")

MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "It is 5."},
    {"role": "user", "content": "And 4 plus 4?"},
    {"role": "assistant", "content": "It is 8."},
]


def conversations(n: int) -> list[dict]:
    out = []
    for i in range(n):
        a, b = i % 7, i % 5
        out.append(
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"It is {a + b}."},
                    {"role": "user", "content": "Thanks!"},
                    {"role": "assistant", "content": "You are welcome."},
                ]
            }
        )
    return out


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A tiny random Qwen3 with the real Qwen3-0.6B chat template, saved as a run, and data."""
    root = tmp_path_factory.mktemp("chat")
    tokenizer = load_tokenizer(write_qwen3_dir(root / "tokenizer", template=QWEN3))
    torch.manual_seed(0)
    config = GPTConfig.from_name("qwen3-baby", vocab_size=tokenizer.vocab_size, n_layer=2)
    save_model(GPT(config), root / "base", tokenizer=tokenizer)
    write_jsonl(root / "chat.jsonl", conversations(40))
    return root


def quick(ft: FinetuneConfig, out: Path, **settings):
    base = dict(out=str(out), batch_size=4, lr=3e-3, progress=False, precision="fp32")
    return train_config(ft, **{**base, "sample_tokens": 8, **settings})


# -- the trained spans of real templates ----------------------------------------------------------
@pytest.mark.parametrize(
    "source, eos, last_turn",
    [
        (QWEN3, "<|im_end|>", "<think>\n\n</think>\n\nIt is 8.<|im_end|>"),
        (LLAMA3, "<|eot_id|>", "It is 8.<|eot_id|>"),
        (SMOLLM3, "<|im_end|>", "It is 8.<|im_end|>"),
    ],
    ids=["qwen3-0.6b", "llama-3.1", "smollm3"],
)
def test_the_trained_spans_of_real_templates_are_the_assistant_turns(source, eos, last_turn):
    """Each assistant turn from the end of its header to its end-of-turn token, nothing else;
    the untrained pieces are the rest of the text transformers renders."""
    from gptkiln.chat_template import ChatTemplate

    template = ChatTemplate(source, {"bos_token": "<|begin_of_text|>", "eos_token": eos})
    pieces = conversation_pieces(template, MULTI_TURN, eos)
    assert [t for t, trained in pieces if trained] == [f"It is 5.{eos}", last_turn]
    whole = template.render(MULTI_TURN, add_generation_prompt=False)
    assert "".join(t for t, _ in pieces) == whole
    untrained = "".join(t for t, trained in pieces if not trained)
    assert "assistant" in untrained and "Be brief." in untrained  # headers and the rest: not


@pytest.mark.parametrize("name", ["qwen3", "llama3", "smollm3"])
def test_piecewise_ids_are_transformers_ids_of_the_whole_conversation(name, tmp_path):
    """Encoding the pieces one by one gives the ids transformers' apply_chat_template(tokenize=
    True) gives for the whole conversation (the boundaries are where its tokens end)."""
    transformers = pytest.importorskip("transformers")
    if name == "llama3":
        directory = write_llama3_dir(tmp_path / name, template=LLAMA3)
    else:
        directory = write_qwen3_dir(tmp_path / name, template=QWEN3 if name == "qwen3" else SMOLLM3)
    tokenizer = load_tokenizer(directory)
    encoder = ConversationEncoder(load_chat_template(directory), tokenizer)
    example = encoder.encode(MULTI_TURN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoTokenizer.from_pretrained(directory)
    out = hf.apply_chat_template(MULTI_TURN, tokenize=True, add_generation_prompt=False)
    assert example.ids == list(out["input_ids"] if hasattr(out, "keys") else out)
    trained_text = tokenizer.decode([i for i, t in zip(example.ids, example.trained) if t])
    eos = hf.eos_token
    assert trained_text.startswith("It is 5." + eos) and trained_text.endswith("It is 8." + eos)


def test_collate_learns_the_trained_tokens_only_and_cut_keeps_whole_turns(work):
    from gptkiln.finetune.chat import Example

    example = Example([10, 11, 12, 13, 14, 15, 16], [False, False, True, True, False, True, True])
    x, y = collate_examples([example, Example([1, 2, 3], [False, True, True])], pad_id=0)
    assert x.tolist() == [[10, 11, 12, 13, 14, 15], [1, 2, 0, 0, 0, 0]]
    assert y.tolist() == [[-100, 12, 13, -100, 15, 16], [2, 3, -100, -100, -100, -100]]
    assert fit_length(example, 7) is example
    assert fit_length(example, 6).ids == [10, 11, 12, 13]  # after the first turn, not mid-turn
    assert fit_length(example, 3) is None  # the first answer does not fit: dropped


# -- training -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_run(work):
    ft = FinetuneConfig(base=str(work / "base"), data=str(work / "chat.jsonl"), task="chat")
    result = finetune(ft, quick(ft, work / "chat", max_steps=12, eval_interval=6))
    return work / "chat", result


def test_a_tiny_qwen3_learns_its_assistant_turns_and_keeps_the_template(work, chat_run):
    run, result = chat_run
    rows = read_metrics(run / "metrics.csv")
    assert rows[-1]["val_loss"] < rows[0]["val_loss"]
    assert (run / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8") == QWEN3
    info = json.loads((run / "config.json").read_text())["finetune"]
    assert info["task"] == "chat" and info["template"] is None
    assert load_chat_template(run).source == QWEN3  # what chat and serve render with


def test_the_trained_tokens_are_exactly_the_assistant_turns(work):
    tokenizer = load_tokenizer(work / "base")
    encoder = ConversationEncoder(load_chat_template(work / "base"), tokenizer)
    example = encoder.encode(MULTI_TURN)
    runs, run = [], []
    for i, t in zip(example.ids, example.trained):
        if t:
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    runs += [run] if run else []
    assert [tokenizer.decode(r) for r in runs] == [
        "It is 5.<|im_end|>",
        "<think>\n\n</think>\n\nIt is 8.<|im_end|>",
    ]


def test_chat_talks_to_the_run_in_its_template(chat_run, capsys, monkeypatch):
    from gptkiln import sampling

    run, _ = chat_run
    seen = []
    real = sampling.generate_stream

    def spy(model, prompts, *args, **kwargs):
        seen.append(list(prompts[0]))
        return real(model, prompts, *args, **kwargs)

    monkeypatch.setattr(sampling, "generate_stream", spy)
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("What is 1 plus 1?\n"))
    code, out, err = cli("chat", run, "--plain", "--max-new-tokens", "4", capsys=capsys)
    assert code == 0, err
    tokenizer = load_tokenizer(run)
    expected = "<|im_start|>user\nWhat is 1 plus 1?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(seen[0]) == expected


def test_sharegpt_conversations_train_as_their_messages_do(work, tmp_path):
    sharegpt = []
    for record in conversations(3):
        turns = [
            {"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": c}
            for m in record["messages"]
            for c in [m["content"]]
        ]
        sharegpt.append({"conversations": turns})
    from gptkiln.finetune.data import read_conversations

    ours, fmt = read_conversations(write_jsonl(tmp_path / "s.jsonl", sharegpt))
    assert fmt == "sharegpt"
    assert ours == [r["messages"] for r in conversations(3)]
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(conversations(3)), tmp_path / "c.parquet")
    ours, fmt = read_conversations(tmp_path / "c.parquet")
    assert fmt == "messages" and ours == [r["messages"] for r in conversations(3)]


def test_a_model_without_a_template_trains_on_chatml_and_keeps_it(tmp_path, capsys):
    tokenizer = build_char_tokenizer(["".join(map(chr, range(32, 127))) + "\n"], with_eot=True)
    torch.manual_seed(0)
    config = GPTConfig.from_name("tiny", vocab_size=tokenizer.vocab_size, context_length=128)
    save_model(GPT(config), tmp_path / "base", tokenizer=tokenizer)
    data = write_jsonl(tmp_path / "c.jsonl", conversations(20))
    ft = FinetuneConfig(base=str(tmp_path / "base"), data=str(data), task="chat")
    finetune(ft, quick(ft, tmp_path / "run", max_steps=2))
    template = load_chat_template(tmp_path / "run")
    assert template is not None and "<|im_start|>" in template.source
    prompt = template.render([{"role": "user", "content": "Hi"}])
    assert prompt == "<|im_start|>user\nHi<|endoftext|>\n<|im_start|>assistant\n"
    code, out, err = cli(
        "finetune", tmp_path / "base", "--task", "chat", "--data", data, "--show-examples", 1,
        capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    # the first answer; the conversation is cut after it to fit the context (128), as training
    # cuts it
    assert "«It is 0.<|endoftext|>»" in out and "You are welcome" not in out


# -- --show-examples -----------------------------------------------------------------------------
def test_show_examples_marks_the_trained_text_and_writes_nothing(work, tmp_path, capsys):
    data = work / "chat.jsonl"
    argv = ["finetune", work / "base", "--task", "chat", "--data", data, "--show-examples", 2]
    code, out, err = cli(*argv, "--out", tmp_path / "never", capsys=capsys)
    assert code == 0, err
    assert out.count("--- example") == 2  # as training cuts them to the context (64)
    assert "<|im_start|>assistant\n«It is 0.<|im_end|>»" in out
    assert not (tmp_path / "never").exists()  # nothing trained, nothing written
    code, out, err = cli(*argv, "--json", capsys=capsys)
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 2 and set(lines[0]) == {"ids", "trained"}
    encoder = ConversationEncoder(load_chat_template(work / "base"), load_tokenizer(work / "base"))
    first = fit_length(encoder.encode(conversations(1)[0]["messages"]), 65)
    assert lines[0] == {"ids": first.ids, "trained": first.trained}


def test_max_length_cuts_at_a_turn_and_says_so_first(work, tmp_path, capsys):
    ft = FinetuneConfig(
        base=str(work / "base"), data=str(work / "chat.jsonl"), task="chat", max_length=60
    )
    finetune(ft, quick(ft, tmp_path / "run", max_steps=1))
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith("chat data: 40 conversations (messages format)")
    assert "40 cut at a turn boundary and 0 dropped" in first and "60 tokens" in first
    argv = ["finetune", work / "base", "--task", "chat", "--data", work / "chat.jsonl"]
    code, out, err = cli(*argv, "--max-length", 60, "--show-examples", 1, "--json", capsys=capsys)
    shown = json.loads(out)  # --show-examples shows the example as training cuts it
    assert code == 0 and 0 < len(shown["ids"]) <= 61 and shown["trained"][-1]
    code, out, err = cli(*argv, "--max-length", 3, "--show-examples", 1, capsys=capsys)
    assert "--- example 1: dropped, its first answer ends past 3 tokens" in out
    assert "example 2" not in out and "39 more examples dropped, not shown" in out
    assert code == 2 and "no example fits" in err  # as training refuses it


# -- bad input ------------------------------------------------------------------------------------
EMPTY_ANSWER = {"role": "assistant", "content": ""}


@pytest.mark.parametrize(
    "records, needle",
    [
        ([{"messages": [{"role": "robot", "content": "hi"}]}], "role 'robot'"),
        ([{"text": "hi"}], "no messages or conversations"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], "no assistant message"),
        ([{"conversations": [{"from": "bot", "value": "x"}]}], "from 'bot'"),
        ([{"messages": [{"role": "user", "content": 3}]}], "not text"),
        (
            [
                {
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": ""},
                    ]
                }
            ],
            "messages[1] is an assistant's message with no text",
        ),
    ],
)
def test_bad_conversations_are_one_line(work, tmp_path, capsys, records, needle):
    data = write_jsonl(tmp_path / "bad.jsonl", records)
    code, _, err = cli(
        "finetune", work / "base", "--task", "chat", "--data", data, "--out", tmp_path / "o",
        capsys=capsys,
    )  # fmt: skip
    assert_one_line_error(code, err, needle, "line 1")
    assert not (tmp_path / "o").exists()


def test_a_max_length_past_the_context_is_one_line(work, tmp_path, capsys):
    code, _, err = cli(
        "finetune", work / "base", "--task", "chat", "--data", work / "chat.jsonl",
        "--max-length", 65, "--out", tmp_path / "o", capsys=capsys,
    )  # fmt: skip
    assert_one_line_error(code, err, "--max-length 65", "context is 64 tokens")


def test_a_template_that_refuses_the_conversation_is_one_line(work, tmp_path, capsys):
    strict = tmp_path / "strict.jinja"
    strict.write_text("{{ raise_exception('only one message, please') }}", encoding="utf-8")
    code, _, err = cli(
        "finetune", work / "base", "--task", "chat", "--data", work / "chat.jsonl",
        "--template", strict, "--show-examples", 1, capsys=capsys,
    )  # fmt: skip
    assert_one_line_error(code, err, "only one message, please")


def test_an_hf_dataset_folder_reads_as_its_file_does(tmp_path):
    pytest.importorskip("datasets")
    from gptkiln.finetune.data import read_conversations

    (tmp_path / "ds").mkdir()
    write_jsonl(tmp_path / "ds" / "train.jsonl", conversations(3))
    ours, fmt = read_conversations(f"hf:{tmp_path / 'ds'}")
    assert fmt == "messages" and ours == [r["messages"] for r in conversations(3)]


def test_a_run_saved_with_a_setting_its_task_never_read_still_resumes(work, tmp_path):
    """Before a chat run refused --beta (a dpo setting), one could be saved with it: its resume
    compares only what the task reads, so the run still continues."""
    ft = FinetuneConfig(base=str(work / "base"), data=str(work / "chat.jsonl"), task="chat")
    finetune(ft, quick(ft, tmp_path / "run", max_steps=1))
    path = tmp_path / "run" / "config.json"
    saved = json.loads(path.read_text())
    saved["finetune"]["config"].update(beta=0.2, lora_alpha=8.0, text_column="body")
    path.write_text(json.dumps(saved))
    result = finetune(ft, quick(ft, tmp_path / "run", max_steps=2), resume=True)
    assert result.steps == 2


def test_a_prompt_template_example_begins_as_its_prompt_is_encoded_to_generate(tmp_path):
    """On a tokenizer that begins every text with an id (Llama 3's BOS), an instruction
    example (`encode_entries`) and a conversation in a prompt template (`ConversationEncoder`,
    --task chat or dpo on an instruction-tuned run) begin with it, untrained, as `generate`,
    `chat` and `serve` encode the prompt; with --mask-prompt the prompt's length counts it."""
    from gptkiln.finetune.instruct import encode_entries
    from gptkiln.finetune.templates import format_prompt, load_template
    from gptkiln.tokenizers import encode_prompt

    tokenizer = load_tokenizer(write_llama3_dir(tmp_path / "llama"))
    bos = tokenizer.encode("")[0]
    template = load_template("alpaca")
    entry = {"instruction": "Name a colour.", "input": "", "output": "Red."}
    ft = FinetuneConfig(base="b", data="d.json", mask_prompt=True)
    (ids,), (prompt_len,) = encode_entries(ft, tokenizer, template, [entry])
    prompt = encode_prompt(tokenizer, format_prompt(template, entry["instruction"]))
    assert ids[0] == bos and ids[: len(prompt)] == prompt and prompt_len == len(prompt)
    assert tokenizer.decode(ids[prompt_len:]) == "Red."
    messages = [{"role": "user", "content": "Name a colour."}]
    example = ConversationEncoder(template, tokenizer).encode(
        [*messages, {"role": "assistant", "content": "Red."}]
    )
    assert example.ids[: len(prompt)] == prompt and not any(example.trained[: len(prompt)])
    gpt2 = load_tokenizer("gpt2")  # none: its texts begin with their own ids
    (plain,), _ = encode_entries(ft, gpt2, template, [entry])
    assert plain == gpt2.encode(format_prompt(template, entry["instruction"]) + "Red.")


def test_a_base_model_whose_eos_is_not_its_templates_turn_end_is_chat_tuned_to_that_end(
    tmp_path, capsys
):
    """Qwen3-Base's tokenizer names ``<|endoftext|>`` its EOS while its template ends turns
    with ``<|im_end|>``: a chat fine-tuning trains each answer to end with ``<|im_end|>`` (as
    transformers' template writes it) and the run stops there (its generation config's
    eos_token_id gains it, as TRL's ``eos_token`` does); the base itself is unchanged."""
    directory = write_qwen3_dir(tmp_path / "tokenizer", template=QWEN3)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(
        json.dumps({**config, "eos_token": "<|endoftext|>"})
    )
    base_tokenizer = load_tokenizer(directory)
    specials, im_end = base_tokenizer.special_ids, base_tokenizer.encode_templated("<|im_end|>")[0]
    for name in ("generation_config.json", "config.json"):  # their EOS: <|endoftext|> alone
        (directory / name).write_text(json.dumps({"eos_token_id": base_tokenizer.eot_id}))
    base_tokenizer = load_tokenizer(directory)
    assert im_end not in base_tokenizer.stop_ids and im_end in specials
    torch.manual_seed(0)
    config = GPTConfig.from_name("qwen3-baby", vocab_size=base_tokenizer.vocab_size, n_layer=2)
    save_model(GPT(config), tmp_path / "base", tokenizer=base_tokenizer)
    data = write_jsonl(tmp_path / "chat.jsonl", conversations(40))
    ft = FinetuneConfig(base=str(tmp_path / "base"), data=str(data), task="chat")
    encoder = ConversationEncoder(load_chat_template(directory), base_tokenizer)
    example = encoder.encode(MULTI_TURN)
    trained = base_tokenizer.decode([i for i, t in zip(example.ids, example.trained) if t])
    assert trained.endswith("It is 8.<|im_end|>") and "<|endoftext|>" not in trained
    finetune(ft, quick(ft, tmp_path / "chat", max_steps=2, eval_interval=2))
    assert "ends each turn with '<|im_end|>', not the tokenizer's EOS" in capsys.readouterr().err
    run_tokenizer = load_tokenizer(tmp_path / "chat")
    assert run_tokenizer.stop_ids == (base_tokenizer.eot_id, im_end)
    assert load_tokenizer(tmp_path / "base").stop_ids == (base_tokenizer.eot_id,)


def test_a_conversation_the_template_cannot_split_is_named_by_its_line(work, tmp_path, capsys):
    records = conversations(5)
    records[3]["messages"].insert(3, {"role": "assistant", "content": "And again."})  # 2 in a row
    data = write_jsonl(tmp_path / "two.jsonl", records)
    code, _, err = cli(
        "finetune", work / "base", "--task", "chat", "--data", data, "--show-examples", "1",
        capsys=capsys,
    )  # fmt: skip
    assert_one_line_error(code, err, f"{data} line 4: ", "assistant turn")
