"""Fine-tuning: the book's chapters 6-7 and appendix E, reproduced and checked against its code.

Every model here is built by the tests themselves: a tiny GPT with a character tokenizer (so a
step takes milliseconds) saved as a run, fine-tuned on data the tests write.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import random
import shutil
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from instruction_data import WORDS, instructions
from safetensors.torch import load_file
from test_cli import assert_one_line_error, cli

from gptkiln.api import perplexity_of_run
from gptkiln.checkpoint import pack_tensors, save_model, unpack_tensors
from gptkiln.config import FinetuneConfig, GPTConfig, SampleConfig
from gptkiln.errors import GptkilnError
from gptkiln.finetune import finetune, train_config
from gptkiln.finetune.instruct import collate_instructions
from gptkiln.finetune.lora import LoraSpec, add_lora, lora_parameter_count
from gptkiln.finetune.templates import (
    ALPACA,
    PromptTemplate,
    format_conversation,
    format_example,
    format_messages,
    format_prompt,
)
from gptkiln.loading import load_model, load_run
from gptkiln.model import GPT
from gptkiln.tokenizers import build_char_tokenizer
from gptkiln.train import read_metrics

book_ch06 = pytest.importorskip("llms_from_scratch.ch06", reason="the book's package")
book_ch07 = pytest.importorskip("llms_from_scratch.ch07", reason="the book's package")

CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A tiny base run (random weights, a character tokenizer with end-of-text), and data."""
    root = tmp_path_factory.mktemp("finetune")
    tokenizer = build_char_tokenizer([CHARS], with_eot=True)
    torch.manual_seed(0)
    config = GPTConfig.from_name("tiny", vocab_size=tokenizer.vocab_size, context_length=256)
    save_model(GPT(config), root / "base", tokenizer=tokenizer)
    (root / "instructions.json").write_text(json.dumps(instructions(60)))
    rng = random.Random(1)
    lines = ["text,label"]
    for _ in range(400):
        label = rng.choice(["good", "bad"])
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 4))]
        words.insert(rng.randint(0, len(words)), label)
        lines.append(f"{' '.join(words)},{label}")
    (root / "labelled.csv").write_text("\n".join(lines) + "\n")
    return root


def quick(ft: FinetuneConfig, out: Path, **settings):
    # fp32: "auto" measures bf16 against fp32, and on a busy machine two runs may choose apart
    base = dict(out=str(out), batch_size=4, lr=3e-3, progress=False, sample_tokens=12)
    base["precision"] = "fp32"
    return train_config(ft, **{**base, **settings})


# -- the prompt template ----------------------------------------------------------------------
def test_the_alpaca_template_is_the_books_format_input_and_response():
    for entry in instructions(6):
        book_prompt = book_ch07.format_input(entry) + "\n\n### Response:\n"
        assert format_prompt(ALPACA, entry["instruction"], entry["input"]) == book_prompt
        assert format_example(ALPACA, entry) == book_prompt + entry["output"]
    assert "### Input" not in format_prompt(ALPACA, "Say hi.", "")  # only when there is input


def test_a_conversation_repeats_the_instruction_parts_and_braces_stay_text():
    t = PromptTemplate(
        system="S", instruction="|I:{instruction}", input="|X:{input}", response="|R:"
    )
    assert format_conversation(t, [], "a {input} b") == "S|I:a {input} b|R:"
    assert format_conversation(t, [("q1", "a1")], "q2") == "S|I:q1|R:a1|I:q2|R:"
    assert ALPACA.stop_strings() == ("### Instruction:", "### Input:", "### Response:")
    with pytest.raises(GptkilnError, match="{instruction} once"):
        PromptTemplate(system="", instruction="no placeholder", input="{input}", response="")


def test_chat_messages_are_the_conversation_a_server_will_send():
    t = PromptTemplate(
        system="S", instruction="|I:{instruction}", input="|X:{input}", response="|R:"
    )
    user = lambda text: {"role": "user", "content": text}
    said = [user("q1"), {"role": "assistant", "content": "a1"}, user("q2")]
    assert format_messages(t, said) == format_conversation(t, [("q1", "a1")], "q2")
    assert format_messages(ALPACA, [user("Say hi.")]) == format_prompt(ALPACA, "Say hi.")
    system = [{"role": "system", "content": "Be brief."}, user("q")]
    assert format_messages(t, system) == "Be brief.|I:q|R:"
    for bad in ([], [said[1]], said[:2], [user("q"), user("q")], [{"role": "tool"}], ["hi"]):
        with pytest.raises(GptkilnError, match="messages"):
            format_messages(t, bad)


# -- --show-examples ----------------------------------------------------------------------------
@pytest.mark.parametrize("mask", [False, True], ids=["whole", "mask-prompt"])
def test_show_examples_of_instructions_are_the_collated_targets(work, tmp_path, capsys, mask):
    argv = ["finetune", work / "base", "--data", work / "instructions.json", "--show-examples", 3]
    argv += ["--mask-prompt"] * mask
    code, out, err = cli(*argv, "--json", capsys=capsys)
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 3 and all(set(x) == {"ids", "trained"} for x in lines)
    tokenizer = load_run(work / "base")[1]
    entries = instructions(3)
    texts = [format_example(ALPACA, e) for e in entries]
    ids = tokenizer.encode_ordinary_batch(texts)
    lengths = None
    if mask:
        prompts = [format_prompt(ALPACA, e["instruction"], e["input"]) for e in entries]
        lengths = [len(p) for p in tokenizer.encode_ordinary_batch(prompts)]  # chars: exact
    _, targets = collate_instructions(ids, tokenizer.eot_id, None, lengths)
    for row, line in enumerate(lines):
        n = len(ids[row])
        assert line["ids"] == [*ids[row], tokenizer.eot_id]
        learnt = (targets[row, :n] != -100).tolist()  # the target at t is the token t + 1
        assert line["trained"] == [False, *learnt]
    code, out, err = cli(*argv, capsys=capsys)
    assert code == 0 and out.count("--- example") == 3, err
    response = f"«{entries[0]['output']}<|endoftext|>»" if mask else "### Response:\n"
    assert response in out and not (tmp_path / "never").exists()


# -- instruction batches: the book's custom_collate_fn ------------------------------------------
def _book_and_ours(batch, allowed):
    book = book_ch07.custom_collate_fn(batch, pad_token_id=50256, allowed_max_length=allowed)
    ours = collate_instructions(batch, pad_id=50256, max_length=allowed)
    return book, ours


def test_the_collate_equals_the_books_custom_collate_fn():
    from gptkiln.tokenizers import load_tokenizer

    tokenizer = load_tokenizer("gpt2")
    data = instructions(24, seed=3) + [
        {"instruction": "Say a long thing. " * 20, "input": "x y z " * 30, "output": "ok"}
    ]
    dataset = book_ch07.InstructionDataset(data, tokenizer)  # the book's encoding ...
    texts = [format_example(ALPACA, e) for e in data]
    assert tokenizer.encode_ordinary_batch(texts) == dataset.encoded_texts  # ... is ours
    items = [dataset[i] for i in range(len(data))]
    for start in range(0, len(items), 5):
        for allowed in (None, 1024, 40):
            (bx, by), (ox, oy) = _book_and_ours(items[start : start + 5], allowed)
            assert torch.equal(bx, ox) and torch.equal(by, oy)
    # the shape of it: the first padding token is a target, the rest are -100
    x, y = collate_instructions([[5, 6, 7], [8]], pad_id=0)
    assert x.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert y.tolist() == [[6, 7, 0], [0, -100, -100]]


def test_the_collate_equals_the_books_on_its_own_1100_entries(tmp_path):
    from conftest import SHARED_DATA

    path = SHARED_DATA / "instruction-data.json"
    if not path.exists():
        pytest.skip(f"{path} (the book's data) is not here: only the book's own entries need it")
    from gptkiln.finetune.data import read_instructions
    from gptkiln.tokenizers import load_tokenizer

    data = read_instructions(path)
    assert len(data) == 1100
    dataset = book_ch07.InstructionDataset(data, load_tokenizer("gpt2"))
    items = [dataset[i] for i in range(len(data))]
    for start in range(0, len(items), 8):
        (bx, by), (ox, oy) = _book_and_ours(items[start : start + 8], 1024)
        assert torch.equal(bx, ox) and torch.equal(by, oy)


def test_a_masked_prompt_that_fills_the_context_is_dropped_not_a_nan(work, tmp_path, capsys):
    """With --mask-prompt, an entry whose prompt fills the context has no token to learn: it
    is dropped and counted (a batch of only such entries was a NaN loss, "training
    diverged"), --show-examples says so, and the judge's test split is of the entries kept;
    when every entry is such, one line."""
    from gptkiln.finetune.judging import test_entries

    entries = instructions(40)
    for i in (0, 5, 36):  # their prompts alone are past the context
        entries[i] = {**entries[i], "input": "moon " * 60}  # 300 characters: past 256
    data = tmp_path / "long.json"
    data.write_text(json.dumps(entries))
    ft = FinetuneConfig(base=str(work / "base"), data=str(data), mask_prompt=True)
    result = finetune(ft, quick(ft, tmp_path / "run", max_steps=12, batch_size=1))
    err = capsys.readouterr().err
    assert "note: 3 of 40 entries dropped: with --mask-prompt their prompt fills" in err
    assert math.isfinite(result.val_loss)
    info = json.loads((tmp_path / "run" / "config.json").read_text())["finetune"]
    assert info["dropped"] == [0, 5, 36] and sum(info["split"].values()) == 37
    kept = [e for i, e in enumerate(entries) if i not in (0, 5, 36)]
    test = kept[info["split"]["train"] : info["split"]["train"] + info["split"]["test"]]
    assert [output for _, output in test_entries(tmp_path / "run", None)] == [
        e["output"] for e in test
    ]
    argv = ["finetune", work / "base", "--data", data, "--mask-prompt", "--show-examples", 1]
    code, out, _ = cli(*argv, capsys=capsys)
    assert code == 0 and out.startswith("--- example 1: dropped, its prompt fills the context")
    data.write_text(json.dumps([{**e, "input": "moon " * 60} for e in entries]))
    code, _, err = cli(
        "finetune",
        work / "base",
        "--data",
        data,
        "--mask-prompt",
        "--out",
        tmp_path / "r",
        capsys=capsys,
    )
    assert_one_line_error(code, err, "no entry's prompt leaves a response token", "256 tokens")


def test_mask_prompt_leaves_only_the_response_as_targets():
    x, y = collate_instructions([[1, 2, 3, 4, 5], [6, 7, 8]], pad_id=0, prompt_lengths=[3, 1])
    assert y.tolist() == [[-100, -100, 4, 5, 0], [7, 8, 0, -100, -100]]
    assert x.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]


# -- LoRA: the book's count, peft's placement -------------------------------------------------
def _book_lora_count() -> int:
    """The book's appendix E, counted on its own model: GPT_CONFIG_124M, a 2-class head,
    everything frozen, then replace_linear_with_lora(model, rank=16, alpha=16)."""
    from llms_from_scratch.appendix_e import replace_linear_with_lora
    from llms_from_scratch.ch04 import GPTModel

    cfg = {
        "vocab_size": 50257,
        "context_length": 1024,
        "emb_dim": 768,
        "n_heads": 12,
        "n_layers": 12,
        "drop_rate": 0.0,
        "qkv_bias": True,
    }
    with torch.device("meta"):
        model = GPTModel(cfg)
        model.out_head = torch.nn.Linear(768, 2)
        model.requires_grad_(False)
        replace_linear_with_lora(model, rank=16, alpha=16)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_lora_parameter_counts_are_the_books_and_the_formulas():
    config = GPTConfig.from_name("gpt2", tie_embeddings=False, num_classes=2)
    book = _book_lora_count()
    assert book == 2_666_528  # the figure printed in the book
    counts = {}
    for qkv in ("split", "fused"):
        with torch.device("meta"):
            model = GPT(config)
        spec = LoraSpec(rank=16, alpha=16.0, qkv=qkv, head=True)
        add_lora(model, spec)
        counts[qkv] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert counts[qkv] == lora_parameter_count(config, spec)
    assert counts["split"] == book  # an adapter per query, key and value block: the book's
    C, L, r = 768, 12, 16
    assert counts["split"] == 18 * r * C * L + r * (C + 2)
    assert counts["fused"] == 16 * r * C * L + r * (C + 2) == 2_371_616  # HF's placement


def test_a_padded_heads_adapter_is_counted_at_its_rows():
    """``--lora-head`` on a base with a padded vocabulary: the head's adapter spans every row
    of the head (peft adapts the layer as it is), and the count says so."""
    config = GPTConfig.from_name("tiny", vocab_size=61, padded_vocab_size=128, tie_embeddings=False)
    model = GPT(config)
    spec = LoraSpec(rank=4, alpha=8.0, head=True)
    add_lora(model, spec)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == lora_parameter_count(config, spec)
    assert model.lm_head.lora_B["default"].weight.shape == (128, 4)


def test_split_adapters_compute_what_the_books_three_adapters_compute():
    from llms_from_scratch.appendix_e import LinearWithLoRA

    torch.manual_seed(0)
    config = GPTConfig.from_name("tiny", vocab_size=40)
    model = GPT(config)
    r, alpha, C = 4, 6.0, config.n_embd
    add_lora(model, LoraSpec(rank=r, alpha=alpha, qkv="split"))
    layer = model.h[0].attn.c_attn
    torch.nn.init.normal_(layer.lora_B["default"].weight)  # B starts at 0: give it values
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # (3r, C), (3C, r)
    base = layer.get_base_layer()
    book = []
    for i in range(3):  # the book's W_query, W_key, W_value, each with its own LoRALayer
        linear = torch.nn.Linear(C, C)
        linear.weight.data = base.weight[i * C : (i + 1) * C].detach().clone()
        linear.bias.data = base.bias[i * C : (i + 1) * C].detach().clone()
        adapted = LinearWithLoRA(linear, r, alpha / r)  # the book's alpha multiplies directly
        adapted.lora.A.data = A[i * r : (i + 1) * r].detach().T.clone()  # (C, r)
        adapted.lora.B.data = B[i * C : (i + 1) * C].detach().T.clone()  # (r, C)
        book.append(adapted)
    x = torch.randn(2, 5, C)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), torch.cat([m(x) for m in book], dim=-1))


# -- instruction fine-tuning, full and LoRA -----------------------------------------------------
@pytest.fixture(scope="module")
def instruct_run(work):
    ft = FinetuneConfig(base=str(work / "base"), data=str(work / "instructions.json"))
    result = finetune(ft, quick(ft, work / "instruct", epochs=3, eval_interval=5))
    return work / "instruct", result


def test_instruction_tuning_learns_and_writes_a_run(instruct_run):
    run, result = instruct_run
    rows = read_metrics(run / "metrics.csv")
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] - 0.5  # it learns the format
    assert (run / "loss.png").is_file() and (run / "model.safetensors").is_file()
    info = json.loads((run / "config.json").read_text())["finetune"]
    assert info["template"] == ALPACA.to_dict() and info["split"] == {
        "train": 51,
        "val": 3,
        "test": 6,
    }
    assert result.sample.startswith("### Instruction:\n")  # the held-out entry's response


def test_generate_formats_with_the_stored_template_as_chat_does(instruct_run, capsys):
    from gptkiln.api import stream_from_model, stream_text
    from gptkiln.chat import Chat
    from gptkiln.config import SampleConfig

    run, _ = instruct_run
    cfg = SampleConfig(max_new_tokens=20, temperature=0)
    got = "".join(stream_text(run, "Repeat the input.", cfg, input="cat"))
    model, tokenizer, _ = load_run(run)
    prompt = format_prompt(ALPACA, "Repeat the input.", "cat")
    stops = dataclasses.replace(cfg, stop=ALPACA.stop_strings())
    assert got == "".join(stream_from_model(model, tokenizer, prompt, stops))
    chat = Chat(run, SampleConfig(max_new_tokens=20, temperature=0))
    assert chat.prompt("Repeat sun.") == format_prompt(ALPACA, "Repeat sun.")
    first = "".join(chat.reply("Repeat sun."))
    assert first == "".join(stream_text(run, "Repeat sun.", cfg))  # generate and chat agree
    code, out, _ = cli(
        "generate",
        run,
        "--prompt",
        "Repeat sun.",
        "--max-new-tokens",
        20,
        "--temperature",
        0,
        capsys=capsys,
    )
    assert code == 0 and out == first + "\n"  # the response alone, not the template


def test_generate_batches_format_an_instruction_tuned_runs_prompts_too(instruct_run, capsys):
    # several prompts (and --json) take api.complete's batch path: the same template, stop
    # strings and response alone as one streamed prompt; the JSON keeps the prompt as given
    import json

    from gptkiln.api import stream_text
    from gptkiln.config import SampleConfig

    run, _ = instruct_run
    cfg = SampleConfig(max_new_tokens=20, temperature=0)
    prompts = ["Repeat the input.", "Repeat sun."]
    alone = ["".join(stream_text(run, p, cfg, input="cat")) for p in prompts]
    flags = ["--input", "cat", "--max-new-tokens", 20, "--temperature", 0]
    code, out, _ = cli(
        "generate",
        run,
        "--prompt",
        prompts[0],
        "--prompt",
        prompts[1],
        *flags,
        "--json",
        capsys=capsys,
    )
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["prompt"] for r in rows] == prompts
    assert [r["text"] for r in rows] == alone
    code, out, _ = cli(
        "generate", run, "--prompt", prompts[0], "--prompt", prompts[1], *flags, capsys=capsys
    )
    assert code == 0 and "### Instruction" not in out and all(a in out for a in alone)
    code, out, err = cli(
        "generate", run, "--prompt", "a", "--prompt", "b", "--raw", "--input", "cat", capsys=capsys
    )
    assert_one_line_error(code, err, "--input", "--raw")


def test_chat_plain_mode_resets_exits_and_survives_ctrl_c(instruct_run, monkeypatch, capsys):
    from gptkiln.chat import Chat, run_chat
    from gptkiln.config import SampleConfig

    run, _ = instruct_run
    chat = Chat(run, SampleConfig(max_new_tokens=12, temperature=0))
    alone = "".join(chat.reply("Repeat dog."))
    chat.reset()
    out = io.StringIO()
    run_chat(chat, interactive=False, stdin=io.StringIO("Repeat cat.\n\nRepeat dog.\n"), stdout=out)
    assert len(chat.turns) == 2 and chat.turns[0][0] == "Repeat cat."
    assert "### Instruction:\nRepeat dog." in chat.prompt("x")  # the history goes in the prompt
    stdin = io.StringIO("Repeat cat.\n/reset\nRepeat dog.\n/exit\nRepeat sun.\n")
    out = io.StringIO()
    run_chat(chat, interactive=False, stdin=stdin, stdout=out)
    assert len(chat.turns) == 1 and out.getvalue().endswith(alone + "\n")  # asked afresh
    # Ctrl-C during a response stops it; the chat goes on with the next message
    import gptkiln.api

    real = gptkiln.api.stream_from_model

    def interrupted(*args, **kwargs):
        yield from list(real(*args, **kwargs))[:1]
        raise KeyboardInterrupt

    monkeypatch.setattr(gptkiln.api, "stream_from_model", interrupted)
    chat.reset()
    out = io.StringIO()
    run_chat(chat, interactive=False, stdin=io.StringIO("Repeat cat.\nRepeat dog.\n"), stdout=out)
    assert out.getvalue().count("[stopped]") == 2 and len(chat.turns) == 2
    # the command: stdin not a terminal, so plain
    monkeypatch.setattr(gptkiln.api, "stream_from_model", real)
    monkeypatch.setattr("sys.stdin", io.StringIO("Repeat dog.\n"))
    code, out, _ = cli("chat", run, "--max-new-tokens", 12, capsys=capsys)
    assert code == 0 and out == alone + "\n"
    assert len(alone) >= 3
    stop = alone[1:3]  # chat takes generate's --stop: the response ends before it
    monkeypatch.setattr("sys.stdin", io.StringIO("Repeat dog.\n"))
    code, out, _ = cli("chat", run, "--max-new-tokens", 12, "--stop", stop, capsys=capsys)
    assert code == 0 and out == alone[: alone.index(stop)] + "\n"


def test_chat_jsonl_takes_messages_with_newlines_and_gives_each_response_as_one_line(
    instruct_run, monkeypatch, capsys
):
    """``--jsonl``: a message of several lines in (a JSON string or a user message object), each
    response out whole as one JSON line, so a script knows where a response of several lines
    ends; a line that is no message is one error naming its line."""
    import json

    from gptkiln.chat import Chat

    run, _ = instruct_run
    cfg = SampleConfig(max_new_tokens=12, temperature=0)
    chat = Chat(run, cfg)
    first = "".join(chat.reply("Repeat cat.\nRepeat dog."))
    second = "".join(chat.reply("Repeat sun."))
    lines = [json.dumps("Repeat cat.\nRepeat dog."), "",
             json.dumps({"role": "user", "content": "Repeat sun."})]  # fmt: skip
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    code, out, _ = cli("chat", run, "--max-new-tokens", 12, "--jsonl", capsys=capsys)
    assert code == 0, out
    replies = [json.loads(line) for line in out.splitlines()]
    assert replies == [{"role": "assistant", "content": first},
                       {"role": "assistant", "content": second}]  # fmt: skip
    for bad in ("Repeat cat.", '{"role": "system", "content": "x"}', "[1, 2]"):
        monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps("Hi") + "\n" + bad + "\n"))
        code, out, err = cli("chat", run, "--max-new-tokens", 2, "--jsonl", capsys=capsys)
        assert code == 2 and "stdin line 2: not a JSON string or user message" in err, err
        assert len(out.splitlines()) == 1  # the first message was answered
    for empty in ('""', '{"role": "user", "content": " "}'):  # a script would wait for a reply
        monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps("Hi") + "\n" + empty + "\n"))
        code, out, err = cli("chat", run, "--max-new-tokens", 2, "--jsonl", capsys=capsys)
        assert code == 2 and "stdin line 2: an empty message" in err, err
        assert len(out.splitlines()) == 1
    # every text is a message (a line out each); the commands are objects
    chat.reset()
    alone = "".join(chat.reply("Repeat sun."))
    lines = ['"/reset"', '{"command": "reset"}', json.dumps("Repeat sun."),
             '{"command": "exit"}', '"Repeat cat."']  # fmt: skip
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    code, out, err = cli("chat", run, "--max-new-tokens", 12, "--jsonl", capsys=capsys)
    replies = [json.loads(line)["content"] for line in out.splitlines()]
    assert code == 0 and len(replies) == 2 and replies[1] == alone, (out, err)
    strict = io.TextIOWrapper(io.BytesIO(b'"Hi \xff there"\n'), encoding="utf-8")
    monkeypatch.setattr("sys.stdin", strict)
    code, out, err = cli("chat", run, "--max-new-tokens", 2, "--jsonl", capsys=capsys)
    assert code == 2 and "stdin line 1: not valid UTF-8" in err and out == "", err


def test_chat_keeps_the_latest_turns_that_fit_the_context(instruct_run):
    from gptkiln.chat import Chat
    from gptkiln.config import SampleConfig

    run, _ = instruct_run
    turns = [("Hi.", "hi"), ("Yo.", "yo")]
    # the character tokenizer: one token a character, in a context of 256
    lengths = [len(format_conversation(ALPACA, turns[2 - k :], "Go.")) for k in (0, 1, 2)]
    for kept in (2, 1, 0):
        for max_new, fits in [(256 - lengths[kept], kept), (256 - lengths[kept] + 1, kept - 1)]:
            chat = Chat(run, SampleConfig(max_new_tokens=max_new, temperature=0))
            chat.turns = list(turns)
            expected = format_conversation(ALPACA, turns[2 - max(fits, 0) :], "Go.")
            assert chat.prompt("Go.") == expected, (max_new, fits)


def test_chat_notes_a_message_past_the_context_and_refuses_bytes_not_utf8(instruct_run):
    import io

    from gptkiln.chat import Chat, run_chat
    from gptkiln.config import SampleConfig
    from gptkiln.errors import GptkilnError

    run, _ = instruct_run
    chat = Chat(run, SampleConfig(max_new_tokens=200, temperature=0))
    said = []
    chat.on_notice = said.append
    chat.prompt("Go. " * 20)  # fits the context (256); only the window slides as it answers
    assert said == []
    chat.prompt("Go. " * 80)  # its template alone is past the context
    assert len(said) == 1 and "the model sees the last 256" in said[0], said
    bad = io.StringIO("Hi \udcff there\n")  # how Python keeps a byte that is not UTF-8
    with pytest.raises(GptkilnError, match="not valid UTF-8"):
        run_chat(chat, interactive=False, stdin=bad, stdout=io.StringIO())
    strict = io.TextIOWrapper(io.BytesIO(b"Hi \xff there\n"), encoding="utf-8")  # a UTF-8 locale
    with pytest.raises(GptkilnError, match="not valid UTF-8"):
        run_chat(chat, interactive=False, stdin=strict, stdout=io.StringIO())


def test_chat_says_what_it_decodes_at_and_that_earlier_turns_are_left_out_once(
    instruct_run, monkeypatch, capsys
):
    """As generate does; and a conversation that outgrows the context says so once, not at
    every turn."""
    from gptkiln.chat import Chat
    from gptkiln.config import SampleConfig

    run, _ = instruct_run
    monkeypatch.setattr("sys.stdin", io.StringIO("Repeat dog.\nRepeat cat.\n"))
    code, _, err = cli("chat", run, "--max-new-tokens", 4, capsys=capsys)
    assert code == 0 and err.count("note: decoding at fp32") == 1, err
    chat = Chat(run, SampleConfig(max_new_tokens=1000, temperature=0))
    said = []
    chat.on_notice = said.append
    chat.turns = [("Hi.", "hi")]  # 183 characters with the next message: more than 128 left
    assert chat.prompt("Go.") == format_conversation(ALPACA, [], "Go.")
    chat.turns = [("Hi.", "hi")] * 3
    chat.prompt("Go.")
    assert len(said) == 1 and "outgrown the model's context of 256" in said[0], said
    said.clear()  # the window's note comes with another count at each long turn: said once
    chat.note_once("the prompt's 54 tokens and up to 200 new ones pass the context of 256")
    chat.note_once("the prompt's 55 tokens and up to 200 new ones pass the context of 256")
    assert len(said) == 1


@pytest.fixture(scope="module")
def lora_runs(work):
    """A LoRA run trained 8 steps at once, and one trained 4 steps then resumed to 8."""
    ft = FinetuneConfig(base=str(work / "base"), data=str(work / "instructions.json"), lora_rank=4)
    settings = dict(max_steps=8, eval_interval=4, checkpoint_interval=4, sample_interval=100)
    whole = finetune(ft, quick(ft, work / "lora", **settings))
    finetune(ft, quick(ft, work / "lora-resumed", **{**settings, "max_steps": 4}))
    finetune(ft, quick(ft, work / "lora-resumed", **settings), resume=True)
    return work / "lora", work / "lora-resumed", whole


def test_lora_keeps_the_base_bit_for_bit_and_saves_small_adapters(work, lora_runs):
    run, _, result = lora_runs
    base = load_file(work / "base" / "model.safetensors")
    assert not (run / "model.safetensors").exists()  # no copy of the base: a reference to it
    ref = json.loads((run / "config.json").read_text())["base_weights"]
    assert ref["path"] == str((work / "base").resolve()) and ref["relative"] == "../base"
    assert [f["name"] for f in ref["files"]] == ["model.safetensors"]
    frozen = load_model(run, adapters=False).state_dict()
    for name, tensor in base.items():
        assert torch.equal(frozen[name], tensor), name  # the frozen base, unchanged
    adapters = load_file(run / "adapter.safetensors")
    assert adapters and all("lora_" in name for name in adapters)
    assert any(t.abs().sum() > 0 for n, t in adapters.items() if "lora_B" in n)  # it trained
    config = load_model(run).config
    assert sum(t.numel() for t in adapters.values()) == lora_parameter_count(
        config, LoraSpec(rank=4, alpha=8.0)
    )  # the adapters alone: 4,608 numbers beside the base's 41,376
    rows = read_metrics(run / "metrics.csv")
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]


def test_the_base_in_memory_is_unchanged_after_lora_training(work):
    from gptkiln.finetune.instruct import InstructionTuning
    from gptkiln.train import Trainer

    ft = FinetuneConfig(base=str(work / "base"), data=str(work / "instructions.json"), lora_rank=2)
    cfg = quick(ft, work / "lora-memory", max_steps=3, sample_interval=100)
    trainer = Trainer(cfg, task=lambda ctx: InstructionTuning(ctx, ft))
    trainer.fit()
    trainer.close()
    base = load_file(work / "base" / "model.safetensors")
    model = trainer.task.model
    frozen = {
        n.replace(".base_layer", ""): p for n, p in model.named_parameters() if "lora_" not in n
    }
    for name, tensor in base.items():
        assert torch.equal(frozen[name], tensor), name
        assert not frozen[name].requires_grad


def test_merged_equals_unmerged_and_exports_to_hugging_face(work, lora_runs, capsys):
    from gptkiln.finetune.instruct import InstructionTuning
    from gptkiln.train import Trainer

    run, _, _ = lora_runs
    ft = FinetuneConfig(base=str(work / "base"), data=str(work / "instructions.json"), lora_rank=4)
    trainer = Trainer(
        quick(ft, run, max_steps=8), resume=True, task=lambda ctx: InstructionTuning(ctx, ft)
    )
    trainer.close()
    unmerged = trainer.task.model.eval()  # the adapters beside the frozen base (peft layers)
    assert any("lora_A" in n for n, _ in unmerged.named_parameters())
    merged = load_model(run)  # the adapters merged into the weights, plain layers
    assert not any("lora" in n for n, _ in merged.named_parameters())
    x = torch.randint(0, merged.config.vocab_size, (2, 30))
    with torch.no_grad():
        assert (unmerged(x) - merged(x)).abs().max() < 1e-5
        assert (load_model(run, adapters=False)(x) - merged(x)).abs().max() > 1e-3
    code, out, err = cli("convert", "merge-lora", run, "--out", work / "merged", capsys=capsys)
    assert code == 0, err
    with torch.no_grad():
        assert torch.equal(load_model(work / "merged")(x), merged(x))
    info = json.loads((work / "merged" / "config.json").read_text())["finetune"]
    assert info["lora"] is None and info["template"] == ALPACA.to_dict()
    code, _, err = cli(
        "convert", "merge-lora", work / "merged", "--out", work / "m2", capsys=capsys
    )
    assert_one_line_error(code, err, "no LoRA adapters")


@pytest.mark.slow
def test_a_process_that_imports_loading_alone_loads_a_lora_run_merged(lora_runs, tmp_path):
    """Loading imports no feature: the package's __init__, which runs before any of its modules,
    registers fine-tuning's load step (`gptkiln.load_steps`), so importing `gptkiln.loading`
    and nothing else still merges a LoRA run's adapters (fine-tuning is imported by that load)."""
    run, _, _ = lora_runs
    code = (
        "import sys, torch\n"
        "from safetensors.torch import save_file\n"
        "from gptkiln.loading import load_model\n"
        "assert not [m for m in sys.modules if m.startswith('gptkiln.finetune')], 'too early'\n"
        f"model = load_model({str(run)!r})\n"
        "assert 'gptkiln.finetune.lora' in sys.modules\n"
        "with torch.no_grad():\n"
        "    logits = model(torch.arange(24).reshape(2, 12))\n"
        f"save_file({{'logits': logits}}, {str(tmp_path / 'logits.safetensors')!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    x = torch.arange(24).reshape(2, 12)
    with torch.no_grad():
        merged, base = load_model(run)(x), load_model(run, adapters=False)(x)
    logits = load_file(tmp_path / "logits.safetensors")["logits"]
    assert torch.equal(logits, merged) and not torch.allclose(logits, base, atol=1e-3)


def test_a_lora_run_whose_config_records_quantization_is_one_line(lora_runs, tmp_path, capsys):
    run, _, _ = lora_runs
    q = tmp_path / "q"
    assert cli("convert", "quantize", run, "--out", q, capsys=capsys)[0] == 0  # merged, int8
    shutil.copy(run / "adapter.safetensors", q)
    cfg = json.loads((q / "config.json").read_text())
    cfg["finetune"]["lora"] = json.loads((run / "config.json").read_text())["finetune"]["lora"]
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(GptkilnError, match="records quantization, but a LoRA run's base is float"):
        load_model(q)
    code, _, err = cli("generate", q, "--prompt", "a", "--max-new-tokens", "2", capsys=capsys)
    assert_one_line_error(code, err, "LoRA run's base is float")
    cfg["finetune"] = "lora"
    (q / "config.json").write_text(json.dumps(cfg))
    code, _, err = cli("generate", q, "--prompt", "a", "--max-new-tokens", "2", capsys=capsys)
    assert_one_line_error(code, err, "'finetune' is 'lora'", "restore it")


def test_merged_gpt2_run_exports_to_hugging_face(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from gptkiln.tokenizers import load_tokenizer

    tokenizer = load_tokenizer("gpt2")
    torch.manual_seed(0)
    save_model(GPT(GPTConfig.from_name("tiny")), tmp_path / "base", tokenizer=tokenizer)
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(e) for e in instructions(24)))
    ft = FinetuneConfig(base=str(tmp_path / "base"), data=str(tmp_path / "d.jsonl"), lora_rank=2)
    finetune(ft, quick(ft, tmp_path / "lora", max_steps=2, sample_interval=100))
    assert (
        cli(
            "convert", "merge-lora", tmp_path / "lora", "--out", tmp_path / "merged", capsys=capsys
        )[0]
        == 0
    )
    assert (
        cli("convert", "to-hf", tmp_path / "merged", "--out", tmp_path / "hf", capsys=capsys)[0]
        == 0
    )
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    merged = load_model(tmp_path / "merged")
    x = torch.randint(0, 50257, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, merged(x), atol=1e-4, rtol=1e-4)


def test_a_lora_run_finds_its_moved_base_and_refuses_a_changed_or_missing_one(
    work, lora_runs, tmp_path, capsys
):
    """The base is found at its recorded path, else beside the run as it was (both moved
    together); a base changed in content is one line, and so is one that is gone. A base
    touched but unchanged loads (its checksum is read again)."""
    from safetensors.torch import save_file

    run = lora_runs[0]
    x = torch.randint(0, 60, (1, 16))
    with torch.no_grad():
        expected = load_model(run)(x)
    moved = tmp_path / "moved"
    shutil.copytree(work / "base", moved / "base")
    shutil.copytree(run, moved / "lora")
    config = json.loads((moved / "lora" / "config.json").read_text())
    config["base_weights"]["path"] = str(tmp_path / "gone")  # only ../base finds it now
    (moved / "lora" / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        assert torch.equal(load_model(moved / "lora")(x), expected)
    weights = moved / "base" / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # touched: a new time, the same bytes
    with torch.no_grad():
        assert torch.equal(load_model(moved / "lora")(x), expected)
    sd = load_file(weights)
    sd["wte.weight"][0, 0] += 1
    save_file(sd, weights, metadata={"format": "pt"})
    code, _, err = cli("generate", moved / "lora", "--prompt", "a", capsys=capsys)
    assert_one_line_error(code, err, "has changed since the run was trained")
    shutil.rmtree(moved / "base")
    code, _, err = cli("generate", moved / "lora", "--prompt", "a", capsys=capsys)
    assert_one_line_error(code, err, "gone (moved or deleted)", "base_weights.path")


def test_a_resumed_lora_run_ends_where_an_uninterrupted_one_does(lora_runs):
    whole, resumed, _ = lora_runs
    a, b = load_file(whole / "adapter.safetensors"), load_file(resumed / "adapter.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name

    def rows(run):  # the speed is the only column that may differ
        return [{**r, "tokens_per_s": None} for r in read_metrics(run / "metrics.csv")]

    assert rows(whole) == rows(resumed) and [r["step"] for r in rows(whole)] == [4, 8]


def test_a_lora_runs_optimizer_state_is_packed_losslessly(lora_runs):
    run = lora_runs[0]
    state = torch.load(run / "trainer_state.pt", weights_only=True)
    moments = [m for s in state["optimizer"]["state"].values() for m in s.values()]
    packed = [m for m in moments if isinstance(m, dict)]
    assert packed and all(m["dtype"] == "float32" for m in packed)
    assert sum(sum(p.numel() for p in m["zlib_byte_planes"]) for m in packed) < 0.9 * sum(
        4 * torch.Size(m["shape"]).numel() for m in packed
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_tensors_come_back_bit_for_bit(dtype):
    torch.manual_seed(0)
    moments = (torch.randn(64, 40) * 1e-3).to(dtype)
    moments[0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), 0.0]).to(dtype)
    tree = {"state": {0: {"exp_avg": moments, "step": torch.tensor(3.0)}}, "lr": [1e-3]}
    packed = pack_tensors(tree)
    assert isinstance(packed["state"][0]["exp_avg"], dict)  # packed, the small step kept
    back = unpack_tensors(packed)
    assert back["lr"] == [1e-3] and torch.equal(back["state"][0]["step"], torch.tensor(3.0))
    assert back["state"][0]["exp_avg"].dtype == dtype
    as_bits = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(back["state"][0]["exp_avg"].view(as_bits), moments.view(as_bits))


def test_resume_refuses_other_settings_or_data(work, lora_runs, tmp_path):
    _, resumed, _ = lora_runs
    ft = FinetuneConfig(base=str(work / "base"), data=str(work / "instructions.json"), lora_rank=8)
    with pytest.raises(GptkilnError, match="lora_rank 4 then, 8 now"):
        finetune(ft, quick(ft, resumed, max_steps=10), resume=True)
    changed = tmp_path / "instructions.json"
    changed.write_text(json.dumps(instructions(60, seed=9)))
    ft = FinetuneConfig(base=str(work / "base"), data=str(changed), lora_rank=4)
    with pytest.raises(GptkilnError, match="the contents of --data"):
        finetune(ft, quick(ft, resumed, max_steps=10), resume=True)


# -- classification ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def classifier(work):
    ft = FinetuneConfig(
        base=str(work / "base"),
        data=str(work / "labelled.csv"),
        task="classify",
        train_layers="all",
    )
    settings = dict(batch_size=8, epochs=4, lr=1e-3, eval_interval=20)
    result = finetune(ft, quick(ft, work / "classify", **settings))
    return work / "classify", result


def test_a_tiny_model_learns_a_synthetic_classification(classifier):
    run, result = classifier
    last = result.history[-1]
    assert last["val_accuracy"] >= 0.95 and last["test_accuracy"] >= 0.95
    rows = read_metrics(run / "metrics.csv")
    assert set(rows[0]) >= {"train_accuracy", "val_accuracy", "test_accuracy", "test_loss"}
    assert rows[-1]["val_loss"] < rows[0]["val_loss"]
    assert (run / "accuracy.png").is_file()
    info = json.loads((run / "config.json").read_text())["finetune"]
    assert info["classes"] == ["bad", "good"] and info["split"] == {
        "train": 280,
        "val": 40,
        "test": 80,
    }


def test_accuracy_and_loss_equal_the_books_functions(work, classifier):
    from gptkiln.finetune.classify import classification_metrics, pad_texts

    run, _ = classifier
    model, tokenizer, cfg = load_run(run)
    info = cfg["finetune"]
    lines = (work / "labelled.csv").read_text().splitlines()[1:81]
    texts, labels = zip(*(line.rsplit(",", 1) for line in lines), strict=True)
    x = pad_texts(tokenizer.encode_ordinary_batch(list(texts)), info["max_length"], info["pad_id"])
    y = torch.tensor([info["classes"].index(label) for label in labels])
    even = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 80, 8)]  # batches of one size
    loss, accuracy = classification_metrics(model, even)
    assert accuracy == book_ch06.calc_accuracy_loader(even, model, "cpu")
    assert loss == pytest.approx(book_ch06.calc_loss_loader(even, model, "cpu"), rel=1e-6)
    ragged = [(x[i : i + 12], y[i : i + 12]) for i in range(0, 80, 12)]  # the last has 8
    assert classification_metrics(model, ragged)[1] == book_ch06.calc_accuracy_loader(
        ragged, model, "cpu"
    )
    # the book averages the batches' means; ours counts each example once
    means = [classification_metrics(model, [b])[0] for b in ragged]
    assert book_ch06.calc_loss_loader(ragged, model, "cpu") == pytest.approx(
        sum(means) / len(means), rel=1e-6
    )


def test_classify_prints_the_label_and_probabilities(classifier, capsys):
    from gptkiln.finetune.classify import classify

    run, _ = classifier
    predictions = classify(run, ["sun good cat", "bad moon rain"])
    assert [p.label for p in predictions] == ["good", "bad"]
    assert sum(predictions[0].probabilities.values()) == pytest.approx(1.0)
    code, out, _ = cli("classify", run, "--text", "sun good cat", capsys=capsys)
    label, probs = out.strip().split("\t")
    probs = dict(kv.split("=") for kv in probs.split())
    assert code == 0 and label == "good" and list(probs) == ["bad", "good"]
    assert float(probs["good"]) > 0.9 and float(probs["good"]) + float(
        probs["bad"]
    ) == pytest.approx(1, abs=2e-3)
    inspect = ["inspect", run, "--prompt", "x", "--out", run.parent / "x.png"]
    for argv in (["generate", run, "--prompt", "x"], inspect):
        code, _, err = cli(*argv, capsys=capsys)
        assert_one_line_error(code, err, "classifier", "gptkiln classify")
    with pytest.raises(GptkilnError, match="classifier"):
        perplexity_of_run(run, run.parent / "labelled.csv")
    code, _, err = cli("convert", "to-hf", run, "--out", run.parent / "hf-cls", capsys=capsys)
    assert_one_line_error(code, err, "classifier")


def test_train_layers_last_n_freezes_all_but_the_last_blocks_norm_and_head(work):
    from gptkiln.finetune.classify import Classification
    from gptkiln.train import Trainer

    ft = FinetuneConfig(base=str(work / "base"), data=str(work / "labelled.csv"), task="classify")
    assert ft.train_layers == "last-1"  # the book's default
    trainer = Trainer(
        quick(ft, work / "last-1", max_steps=2), task=lambda ctx: Classification(ctx, ft)
    )
    trainer.close()
    trained = {n for n, p in trainer.task.model.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith(("h.1.", "ln_f.", "score.")) for n in trained)
    assert {"score.weight", "ln_f.weight", "h.1.mlp.c_fc.weight"} <= trained


def test_classification_with_lora_on_the_head_trains_only_adapters(work):
    ft = FinetuneConfig(
        base=str(work / "base"),
        data=str(work / "labelled.csv"),
        task="classify",
        lora_rank=4,
        lora_head=True,
    )
    finetune(ft, quick(ft, work / "cls-lora", max_steps=3, eval_interval=3))
    adapters = load_file(work / "cls-lora" / "adapter.safetensors")
    assert "score.lora_A.default.weight" in adapters and "score.weight" not in adapters
    ft = dataclasses.replace(ft, lora_head=False)
    finetune(ft, quick(ft, work / "cls-lora-head", max_steps=3, eval_interval=3))
    adapters = load_file(work / "cls-lora-head" / "adapter.safetensors")
    assert "score.weight" in adapters  # a new head trains in full
    from gptkiln.finetune.classify import classify

    assert classify(work / "cls-lora-head", ["good"])[0].label in ("good", "bad")


# -- bad data: one line, exit 2 -----------------------------------------------------------------
BAD_INSTRUCTIONS = [
    ("a.json", "[{]", "not valid JSON"),
    ("a.json", '{"instruction": "x"}', "not a list"),
    ("a.json", "[]", "holds no entries"),
    ("a.json", '[{"instruction": "x", "input": "", "output": "y"}, 7]', "entry 2 of 2"),
    ("a.json", '[{"instruction": "x", "input": ""}]', 'no "output"'),
    ("a.json", '[{"instruction": "x", "input": 3, "output": "y"}]', '"input" is a JSON int'),
    ("a.json", '[{"instruction": " ", "input": "", "output": "y"}]', '"instruction" is empty'),
    ("a.jsonl", '{"instruction": "x", "output": "y"}\n{oops\n', "line 2"),
    ("a.jsonl", '{"instruction": "x\ty", "output": "y"}\n', "raw line break or tab inside"),
    ("a.jsonl", '{"instruction": "x", "output": "y\n', "Unterminated string starting, column"),
    ("a.txt", "hello", "unsupported file type"),
    ("a.csv", "text,label\nhi,1\n", "for labelled texts pass --task classify"),
    ("a.json", b"[\x00\x01]", "binary"),
    ("a.json", '[{"instruction": "caf\xe9"}]'.encode("latin-1"), "not UTF-8"),
]


@pytest.mark.parametrize("name, content, needle", BAD_INSTRUCTIONS)
def test_a_bad_instruction_file_is_one_line(name, content, needle, work, tmp_path, capsys):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, _, err = cli(
        "finetune", work / "base", "--data", path, "--out", tmp_path / "r", capsys=capsys
    )
    assert_one_line_error(code, err, str(path), needle)
    assert not (tmp_path / "r" / "model.safetensors").exists()


BAD_LABELLED = [
    ("a.csv", "words,label\nhi,x\n", "no column 'text'"),
    ("a.csv", "text,label\nhi,x\nho,x\n", "every label is 'x'"),
    ("a.csv", "text,label\nhi,x,extra\n", "line 2: 3 fields"),
    ("a.csv", "text,label\nhi,x\n ,y\n", "line 3: the text"),
    ("a.tsv", "text\tlabel\nhi\tx\nho\t\n", "line 3: the label"),
    ("a.jsonl", '{"text": "hi", "label": "x"}\n{"text": "ho"}\n', "line 2: no 'label'"),
    ("a.jsonl", '{"text": "hi", "label": "x"}\n{"text": "ho", "label": [1]}\n', "line 2"),
]


@pytest.mark.parametrize("name, content, needle", BAD_LABELLED)
def test_a_bad_labelled_file_is_one_line(name, content, needle, work, tmp_path, capsys):
    path = tmp_path / name
    path.write_text(content)
    code, _, err = cli(
        "finetune",
        work / "base",
        "--task",
        "classify",
        "--data",
        path,
        "--out",
        tmp_path / "r",
        capsys=capsys,
    )
    assert_one_line_error(code, err, str(path), needle)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--lora-rank", "-1"], "--lora-rank must be >= 0"),
        (["--train-layers", "some"], "--train-layers must be all, last-N"),
        (["--lora-rank", "4", "--train-layers", "all"], "drop one of them"),
        (["--lora-rank", "0", "--train-layers", "lora"], "--lora-rank 0 means no LoRA"),
        (["--lora-head"], "needs --lora-rank"),
        (["--lora-rank", "4", "--lora-head"], "shares its weights"),
        (["--val-fraction", "0.6", "--test-fraction", "0.5"], "leave entries"),
        (["--val-fraction", "0.001"], "no validation entry"),
        (["--train-layers", "last-9"], "has 2 blocks"),
        (["--template", "nope"], "bundled"),
        (["--batch-size", "100"], "fewer than one step"),
        # what only another task or LoRA reads is refused, not ignored
        (["--beta", "0.5"], "--beta is for --task dpo"),
        (["--dpo-loss", "ipo"], "--dpo-loss is for --task dpo"),
        (["--max-length", "32"], "--max-length is for --task classify or chat or dpo"),
        (["--text-column", "body"], "--text-column is for --task classify"),
        (["--lora-alpha", "8"], "--lora-alpha shapes LoRA adapters: it needs --lora-rank"),
        (["--lora-qkv", "fused"], "--lora-qkv shapes LoRA adapters"),
        # a bad value is named by its flag, not the field it sets
        (["--task", "dpo", "--beta", "0"], "--beta must be a number > 0"),
        (["--task", "chat", "--max-length", "0"], "--max-length must be a whole number >= 1"),
    ],
)
def test_bad_finetune_settings_are_one_line(flags, needle, work, tmp_path, capsys):
    code, _, err = cli(
        "finetune",
        work / "base",
        "--data",
        work / "instructions.json",
        "--out",
        tmp_path / "r",
        *flags,
        capsys=capsys,
    )
    assert_one_line_error(code, err, needle)


@pytest.mark.parametrize("task", ["instruct", "classify", "chat", "dpo"])
def test_a_base_whose_tokenizer_outgrows_its_model_is_one_line(task, work, tmp_path, capsys):
    """Token ids the base has no embedding for (tokenizer files that are not the model's) are
    one line before training, in every task, not an IndexError in the first step."""
    tokenizer = build_char_tokenizer([CHARS], with_eot=True)
    config = GPTConfig.from_name("tiny", vocab_size=8, context_length=64)
    save_model(GPT(config), tmp_path / "base", tokenizer=tokenizer)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]
    data = {
        "instruct": (work / "instructions.json"),
        "classify": (work / "labelled.csv"),
        "chat": [{"messages": chat}] * 20,
        "dpo": [{"prompt": "hi", "chosen": "ho", "rejected": "hum"}] * 20,
    }[task]
    if isinstance(data, list):
        (tmp_path / "data.json").write_text(json.dumps(data))
        data = tmp_path / "data.json"
    code, _, err = cli(
        "finetune",
        tmp_path / "base",
        "--task",
        task,
        "--data",
        data,
        "--out",
        tmp_path / "r",
        capsys=capsys,
    )
    assert_one_line_error(code, err, "beyond the model's 8", "do not belong to this model")
    assert not (tmp_path / "r" / "model.safetensors").exists()


def test_a_base_without_a_row_for_its_end_of_text_is_one_line(work, tmp_path, capsys):
    """The end-of-text that ends each example (and pads) is checked too, not only the data's
    ids: a model one row short of its tokenizer was an IndexError in the first step."""
    tokenizer = build_char_tokenizer([CHARS], with_eot=True)
    assert tokenizer.eot_id == tokenizer.vocab_size - 1
    config = GPTConfig.from_name("tiny", vocab_size=tokenizer.vocab_size - 1, context_length=64)
    save_model(GPT(config), tmp_path / "base", tokenizer=tokenizer)
    code, _, err = cli(
        "finetune", tmp_path / "base", "--data", work / "instructions.json", "--out",
        tmp_path / "r", capsys=capsys,
    )  # fmt: skip
    assert_one_line_error(code, err, f"gave id {tokenizer.eot_id:,}", "do not belong")


def test_chat_and_classify_refuse_runs_of_the_other_kind(work, instruct_run, classifier, capsys):
    code, _, err = cli("chat", work / "base", capsys=capsys)
    assert_one_line_error(code, err, "not instruction-tuned", "gptkiln finetune")
    code, _, err = cli("classify", instruct_run[0], "--text", "x", capsys=capsys)
    assert_one_line_error(code, err, "not a classifier")
    code, _, err = cli(
        "finetune",
        work / "base",
        "--data",
        work / "instructions.json",
        "--out",
        work / "base",
        capsys=capsys,
    )
    assert_one_line_error(code, err, "already holds a model")


def test_serve_refuses_a_classifier_in_one_line(classifier, capsys, monkeypatch):
    # checked once the model is loaded, before the server listens (were it not, the test ends
    # at the server's start instead of serving forever)
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("it served a classifier"))
    monkeypatch.setattr("gptkiln.serve.check_can_listen", lambda host, port: None)
    code, _, err = cli("serve", classifier[0], capsys=capsys)
    assert_one_line_error(code, err, "is a classifier", "gptkiln classify")


def test_info_reads_a_lora_runs_step_off_its_adapters_and_a_first_save_cut_short_is_named(
    lora_runs, tmp_path
):
    """Its base's weights (here saved by save_model: no step) are not the run's; and a first
    save stopped before adapter.safetensors (config.json is written first) is nothing to
    resume, said in one line that names --overwrite, for a plain start and a resume alike."""
    import shutil

    from gptkiln.api import run_info
    from gptkiln.run_guard import check_run_dir_for_training

    run, _, _ = lora_runs
    info = run_info(run)
    assert info.resumable and info.steps_done == 8, info.resume_note
    cut = tmp_path / "cut"
    shutil.copytree(run, cut)
    (cut / "adapter.safetensors").unlink()
    for resume in (False, True):
        with pytest.raises(GptkilnError, match="first checkpoint that was cut short.*--overwrite"):
            check_run_dir_for_training(cut, resume=resume, overwrite=False)


def test_a_lora_run_fine_tunes_again_in_full_and_with_dpo(work, lora_runs, tmp_path, capsys):
    """A LoRA run's merged weights load frozen: a full fine-tune of it trains every parameter
    again (it trained none: "element 0 of tensors does not require grad"), and full DPO from it
    keeps its reference's files, the base's base and the adapters, by paths from the run."""
    lora, _, _ = lora_runs
    ft = FinetuneConfig(base=str(lora), data=str(work / "instructions.json"))
    result = finetune(ft, quick(ft, tmp_path / "full", max_steps=2))
    assert math.isfinite(result.val_loss)
    assert "parameters train (100.00%)" in capsys.readouterr().err
    pairs = [
        {"prompt": e["instruction"], "chosen": e["output"], "rejected": "no"}
        for e in instructions(20)
    ]
    (tmp_path / "pairs.json").write_text(json.dumps(pairs))
    dpo = FinetuneConfig(base=str(lora), data=str(tmp_path / "pairs.json"), task="dpo")
    finetune(dpo, quick(dpo, tmp_path / "dpo", max_steps=1))
    info = json.loads((tmp_path / "dpo" / "config.json").read_text())["finetune"]
    names = [f["name"] for f in info["reference_weights"]["files"]]
    assert names[-1] == "adapter.safetensors" and names[0].startswith("../")


def test_full_dpo_from_a_lora_run_resumes_after_the_lora_runs_base_moved(work, tmp_path):
    """Full DPO's reference check follows the LoRA run it started from to wherever that run
    now finds its base (moved, and its base_weights path set, as the LoRA run's own message
    says): the same files, so the resume goes on; changed adapters are refused."""
    import shutil

    shutil.copytree(work / "base", tmp_path / "pre")
    data = str(work / "instructions.json")
    lora = FinetuneConfig(base=str(tmp_path / "pre"), data=data, lora_rank=4)
    finetune(lora, quick(lora, tmp_path / "lora", max_steps=1))
    pairs = [
        {"prompt": e["instruction"], "chosen": e["output"], "rejected": "no"}
        for e in instructions(20)
    ]
    (tmp_path / "pairs.json").write_text(json.dumps(pairs))
    dpo = FinetuneConfig(base=str(tmp_path / "lora"), data=str(tmp_path / "pairs.json"), task="dpo")
    settings = dict(checkpoint_interval=1, eval_interval=1)
    finetune(dpo, quick(dpo, tmp_path / "dpo", max_steps=1, **settings))
    (tmp_path / "models").mkdir()
    shutil.move(tmp_path / "pre", tmp_path / "models" / "pre")
    config = json.loads((tmp_path / "lora" / "config.json").read_text())
    config["base_weights"]["path"] = str(tmp_path / "models" / "pre")
    config["base_weights"]["relative"] = "../models/pre"
    (tmp_path / "lora" / "config.json").write_text(json.dumps(config))
    finetune(dpo, quick(dpo, tmp_path / "dpo", max_steps=2, **settings), resume=True)
    adapters = tmp_path / "lora" / "adapter.safetensors"
    adapters.write_bytes(adapters.read_bytes()[:-4] + b"\x00\x00\x80\x3f")  # one weight now 1.0
    with pytest.raises(GptkilnError, match="reference, the base .* has changed since"):
        finetune(dpo, quick(dpo, tmp_path / "dpo", max_steps=3, **settings), resume=True)


def test_resume_keeps_the_runs_own_loop_settings_where_no_flag_is_given(work, tmp_path, capsys):
    """An interrupted fine-tuning goes on as it was set: ``--resume`` takes the run's recorded
    lr, batch and cadence for every loop flag not given (not the fine-tuning defaults)."""
    out = tmp_path / "ft"
    base = ["finetune", work / "base", "--data", work / "instructions.json", "--out", out]
    loop = ["--lr", "3e-3", "--batch-size", "4", "--eval-interval", "2", "--sample-tokens", "0",
            "--no-progress"]  # fmt: skip
    assert cli(*base, *loop, "--max-steps", 2, capsys=capsys)[0] == 0
    code, _, err = cli(*base, "--resume", "--max-steps", 4, "--no-progress", capsys=capsys)
    assert code == 0, err
    rows = read_metrics(out / "metrics.csv")
    assert [r["step"] for r in rows] == [2, 4]  # every 2 steps, as it was (the default: 10)
    assert [r["lr"] for r in rows] == [3e-3, 3e-3]  # its lr (the default: 5e-5)
    recorded = json.loads((out / "config.json").read_text())["train"]
    assert recorded["batch_size"] == 4 and recorded["lr"] == 3e-3
    before = (out / "metrics.csv").read_bytes(), (out / "trainer_state.pt").read_bytes()
    code, printed, err = cli(*base, "--resume", "--max-steps", 2, capsys=capsys)
    assert code == 0 and "nothing to train" in err and "at step 4 of 2" in err
    assert "done" not in printed and "sample" not in printed + err  # nor evaluated, sampled
    assert before == ((out / "metrics.csv").read_bytes(), (out / "trainer_state.pt").read_bytes())


def test_resume_keeps_the_runs_own_fine_tuning_settings_where_no_flag_is_given(
    work, tmp_path, capsys
):
    """What the run learns (--mask-prompt, LoRA's rank and alpha) is the run's too: a bare
    ``--resume`` goes on with them, and a flag that differs is refused, naming both."""
    out = tmp_path / "ft"
    base = ["finetune", work / "base", "--data", work / "instructions.json", "--out", out]
    quiet = ["--sample-tokens", "0", "--no-progress"]
    lora = ["--train-layers", "lora", "--lora-rank", "2", "--lora-alpha", "4"]
    assert cli(*base, "--mask-prompt", *lora, *quiet, "--max-steps", 2, capsys=capsys)[0] == 0
    code, _, err = cli(*base, "--resume", *quiet, "--max-steps", 3, capsys=capsys)
    assert code == 0, err
    saved = json.loads((out / "config.json").read_text())["finetune"]["config"]
    assert saved["mask_prompt"] is True and saved["lora_rank"] == 2 and saved["lora_alpha"] == 4
    assert [r["step"] for r in read_metrics(out / "metrics.csv")][-1] == 3
    code, _, err = cli(*base, "--resume", "--lora-rank", "4", *quiet, "--max-steps", 4,
                       capsys=capsys)  # fmt: skip
    assert_one_line_error(code, err, "lora_rank 2 then, 4 now")


def test_a_template_file_is_found_on_resume_from_anywhere_and_other_training_is_named(
    work, tmp_path, capsys, monkeypatch
):
    """``--template tpl.json`` typed relative is recorded as found, so a bare ``--resume`` from
    another directory reads it; a resume that asks for another kind of training is refused
    naming it, not a setting of the run's (its LoRA rank 0) that the other would not take."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir(), elsewhere.mkdir()
    template = {"system": "Do it.", "instruction": "\nQ: {instruction}", "input": " {input}",
                "response": "\nA: "}  # fmt: skip
    (home / "tpl.json").write_text(json.dumps(template))
    out = tmp_path / "ft"
    base = ["finetune", work / "base", "--data", work / "instructions.json", "--out", out]
    quiet = ["--sample-tokens", "0", "--no-progress"]
    monkeypatch.chdir(home)
    code, _, err = cli(*base, "--template", "tpl.json", "--mask-prompt", *quiet,
                       "--max-steps", 2, capsys=capsys)  # fmt: skip
    assert code == 0, err
    saved = json.loads((out / "config.json").read_text())["finetune"]["config"]
    assert saved["template"] == str((home / "tpl.json").resolve())
    monkeypatch.chdir(elsewhere)
    code, _, err = cli(*base, "--resume", *quiet, "--max-steps", 3, capsys=capsys)
    assert code == 0, err
    code, _, err = cli(*base, "--resume", "--train-layers", "lora", *quiet, "--max-steps", 4,
                       capsys=capsys)  # fmt: skip
    assert_one_line_error(
        code,
        err,
        "fine-tuned with --train-layers all, and this resume asks for --train-layers lora",
    )
    assert "lora_rank" not in err


def test_one_entry_is_refused_without_advice_it_cannot_follow(work, tmp_path, capsys):
    entries = json.loads((work / "instructions.json").read_text())
    one = tmp_path / "one.json"
    one.write_text(json.dumps(entries[:1]))
    code, _, err = cli(
        "finetune", work / "base", "--data", one, "--out", tmp_path / "r", capsys=capsys
    )
    assert_one_line_error(code, err, "1 entry: fine-tuning needs 2 at least")
    assert "--val-fraction" not in err  # no fraction below 1 gives one entry two splits
