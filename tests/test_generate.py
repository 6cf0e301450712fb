"""`gptkiln generate` beyond one prompt: batches, samples per prompt, stop strings, penalties,
prompt files and JSON output; and `api.complete`, the library function behind them."""

import io
import json
import string
import sys

import pytest
import torch
from test_cli import assert_one_line_error, cli

import gptkiln.sampling
from gptkiln.api import complete, generate_text, stream_text
from gptkiln.config import GPTConfig, SampleConfig
from gptkiln.model import GPT
from gptkiln.tokenizers import CharTokenizer

CHARS = sorted(" " + string.digits + string.ascii_letters)
PROMPTS = ["The cat", "ab", "", "x y z"]  # unequal lengths (left padding); "" starts from EOT


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run of an untied tiny model (a tied fresh one repeats its last token) whose char
    tokenizer has letters, digits, a space and end-of-text: 64 ids. Its head is scaled up: a
    fresh model's next-token distribution is so flat that seeded draws come out the same
    whatever the prompt, which would hide a row sampling another row's distribution."""
    from gptkiln.checkpoint import save_model

    tokenizer = CharTokenizer(CHARS, with_eot=True)
    torch.manual_seed(0)
    config = GPTConfig.from_name("tiny", vocab_size=64, context_length=24, tie_embeddings=False)
    model = GPT(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    path = tmp_path_factory.mktemp("generate") / "run"
    save_model(model, path, tokenizer=tokenizer)
    return path


def texts(samples):
    return [(s.text, s.token_ids, s.finish_reason) for s in samples]


def test_a_batch_of_prompts_gives_what_each_prompt_gives_alone(run):
    for cfg in (
        SampleConfig(max_new_tokens=12, temperature=0),
        SampleConfig(max_new_tokens=12, temperature=1.0, top_k=20, seed=7),
        SampleConfig(max_new_tokens=12, temperature=0.9, presence_penalty=1.5, seed=3),
    ):
        batch = complete(run, PROMPTS, cfg)
        alone = [complete(run, [p], cfg)[0] for p in PROMPTS]
        assert texts(batch) == texts(alone)
        assert [(s.prompt_index, s.prompt, s.index) for s in batch] == [
            (i, p, 0) for i, p in enumerate(PROMPTS)
        ]
        assert len({s.text for s in batch}) == len(PROMPTS)  # the rows are not one row repeated
        for s, p in zip(batch, PROMPTS):  # what stream_text (one prompt, the terminal) gives
            assert generate_text(run, p, cfg) == p + s.text
        chunked = complete(run, PROMPTS, cfg, batch_size=3)  # 4 rows: a batch of 3, then 1
        assert texts(chunked) == texts(batch)


def test_complete_tells_each_batch_as_it_ends(run):
    """``on_batch``: each batch's samples as soon as it is done (before the next one starts),
    the same as those returned, so a caller keeps them before the rest are (`gptkiln judge`)."""
    cfg = SampleConfig(max_new_tokens=6, temperature=0)
    told, generated = [], []
    real = gptkiln.sampling.generate_stream

    def counted(model, prompts, *a, **k):  # the batches generated so far, when one is told
        generated.append(len(prompts))
        return real(model, prompts, *a, **k)

    def on_batch(samples):
        told.append((len(generated), samples))

    with pytest.MonkeyPatch.context() as m:
        m.setattr(gptkiln.sampling, "generate_stream", counted)
        samples = complete(run, PROMPTS, cfg, batch_size=3, num_samples=2, on_batch=on_batch)
    assert generated == [3, 3, 2]  # 8 rows
    assert [(after, len(batch)) for after, batch in told] == [(1, 3), (2, 3), (3, 2)]
    assert texts([s for _, batch in told for s in batch]) == texts(samples)
    assert [(s.prompt_index, s.index) for _, batch in told for s in batch][:3] == [
        (0, 0), (0, 1), (1, 0)
    ]  # fmt: skip


def test_sample_j_of_a_prompt_is_drawn_with_seed_plus_j(run):
    cfg = SampleConfig(max_new_tokens=10, temperature=1.0, seed=40)
    samples = complete(run, PROMPTS[:2], cfg, num_samples=3)
    assert [(s.prompt_index, s.index, s.seed) for s in samples] == [
        (i, j, 40 + j) for i in range(2) for j in range(3)
    ]
    for s in samples:
        seeded = SampleConfig(max_new_tokens=10, temperature=1.0, seed=40 + s.index)
        assert texts([s]) == texts(complete(run, [s.prompt], seeded))
    assert len({s.text for s in samples[:3]}) == 3  # each sample of a prompt is its own draw
    unseeded = complete(run, ["ab"], SampleConfig(max_new_tokens=4), num_samples=2)
    assert [s.seed for s in unseeded] == [None, None]


def test_stop_strings_end_the_text_right_before_them(run):
    greedy = SampleConfig(max_new_tokens=16, temperature=0)
    full = complete(run, ["The cat"], greedy)[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 16
    stop = full.text[5:7]  # two characters from its middle
    cut = full.text[: full.text.index(stop)]
    stopped = complete(run, ["The cat", "ab"], SampleConfig(**{**greedy.__dict__, "stop": [stop]}))
    assert stopped[0].text == cut and stopped[0].finish_reason == "stop"
    assert stopped[0].token_ids == full.token_ids[: len(cut) + len(stop)]  # to the stop's end
    other = complete(run, ["ab"], greedy)[0]  # the other row ends at its own stop, or its length
    assert stopped[1].text == other.text.split(stop)[0]


def test_an_end_of_text_that_ends_a_sample_is_its_last_token_id(run, monkeypatch):
    """token_ids as transformers' generate and vLLM give them: the end-of-text id that ended a
    sample is its last id (its text is none)."""
    tokenizer = CharTokenizer(CHARS, with_eot=True)
    a, eot = tokenizer.encode("a")[0], tokenizer.eot_id
    picks = iter([a, a, eot])  # the sampler's picks, scripted: "a", "a", then end-of-text
    real = gptkiln.sampling.sample_rows

    def scripted(logits, *args, **kwargs):
        logits = torch.full_like(logits, -1e9)
        logits[:, next(picks)] = 0
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(gptkiln.sampling, "sample_rows", scripted)
    (sample,) = complete(run, ["ab"], SampleConfig(max_new_tokens=8, temperature=0))
    assert (sample.text, sample.token_ids, sample.finish_reason) == ("aa", [a, a, eot], "stop")


def test_bad_arguments_of_complete_are_one_error_each(run):
    from gptkiln.errors import GptkilnError

    for kwargs, needle in [
        (dict(num_samples=0), "num_samples must be a whole number >= 1, got 0"),
        (dict(batch_size=0), "batch_size must be a whole number >= 1"),
        (dict(prompts=[]), "no prompts"),
        (dict(cfg=SampleConfig(seed=2**63 - 1), num_samples=2), "past 2**63 - 1"),
    ]:
        with pytest.raises(GptkilnError, match=needle.replace("*", r"\*")):
            complete(run, kwargs.pop("prompts", ["ab"]), **kwargs)
    with pytest.raises(GptkilnError, match="tokenizer"):
        complete(GPT(GPTConfig.from_name("tiny", vocab_size=64)), ["ab"])


def test_complete_takes_a_model_and_its_tokenizer(run):
    from gptkiln.loading import load_run

    model, tokenizer, _ = load_run(run)
    model.train()
    cfg = SampleConfig(max_new_tokens=8, temperature=0)
    assert texts(complete(model, PROMPTS, cfg, tokenizer=tokenizer)) == texts(
        complete(run, PROMPTS, cfg)
    )
    assert model.training  # left as it was given


def test_one_text_is_one_prompt_not_its_characters(run):
    cfg = SampleConfig(max_new_tokens=4, temperature=0)
    assert texts(complete(run, "The cat", cfg)) == texts(complete(run, ["The cat"], cfg))


def test_the_text_functions_take_sample_settings_as_keywords_and_refuse_ids(run):
    """As generate(): ``max_new_tokens=4`` is SampleConfig(max_new_tokens=4); token ids given
    where text is wanted are one line naming generate()."""
    from gptkiln.errors import GptkilnError

    cfg = SampleConfig(max_new_tokens=4, temperature=0)
    assert texts(complete(run, "ab", max_new_tokens=4, temperature=0)) == texts(
        complete(run, "ab", cfg)
    )
    assert "".join(stream_text(run, "ab", max_new_tokens=4, temperature=0)) == "".join(
        stream_text(run, "ab", cfg)
    )
    assert generate_text(run, "ab", max_new_tokens=4, temperature=0) == generate_text(
        run, "ab", cfg
    )
    with pytest.raises(GptkilnError, match=r"complete\(\) has no setting max_new"):
        complete(run, "ab", max_new=4)
    with pytest.raises(GptkilnError, match=r"complete\(\) takes text, and prompt 2 is a list; "
                       r"for token ids use gptkiln.generate"):  # fmt: skip
        complete(run, ["ab", [1, 2, 3]])
    with pytest.raises(GptkilnError, match=r"stream_text\(\) takes text, and the prompt is a"):
        next(stream_text(run, [1, 2, 3]))


def test_cli_prints_each_sample_after_a_separator_line(run, capsys):
    args = ["generate", run, "--max-new-tokens", "8", "--seed", "5", "--temperature", "1"]
    code, out, err = cli(*args, "--prompt", "ab", "--prompt", "The cat", "--num-samples", "2",
                         capsys=capsys)  # fmt: skip
    assert code == 0, err
    cfg = SampleConfig(max_new_tokens=8, seed=5, temperature=1.0)
    expected = complete(run, ["ab", "The cat"], cfg, num_samples=2)
    blocks = [
        f"--- prompt {s.prompt_index + 1} of 2, sample {s.index + 1} of 2 (seed {s.seed}) ---\n"
        f"{s.prompt}{s.text}\n"
        for s in expected
    ]
    assert out == "".join(blocks)
    code, out, _ = cli(*args, "--prompt", "ab", "--num-samples", "2", capsys=capsys)
    assert out.splitlines()[0] == "--- sample 1 of 2 (seed 5) ---"
    code, out, _ = cli(*args, "--prompt", "ab", "--prompt", "x", capsys=capsys)
    assert out.splitlines()[0] == "--- prompt 1 of 2 (seed 5) ---"


def test_cli_json_lines_hold_every_field(run, capsys):
    code, out, err = cli(
        "generate", run, "--prompt", "The cat", "--prompt", "", "--num-samples", "2",
        "--max-new-tokens", "9", "--seed", "1", "--temperature", "0.8", "--top-p", "0.9",
        "--json", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    cfg = SampleConfig(max_new_tokens=9, seed=1, temperature=0.8, top_p=0.9)
    assert rows == [s.to_dict() for s in complete(run, ["The cat", ""], cfg, num_samples=2)]
    tokenizer = CharTokenizer(CHARS, with_eot=True)
    for row in rows:
        assert set(row) == {"prompt_index", "prompt", "index", "seed", "text", "token_ids",
                            "finish_reason"}  # fmt: skip
        assert tokenizer.decode(row["token_ids"]) == row["text"]  # no stop strings here
        assert row["finish_reason"] == ("length" if len(row["token_ids"]) == 9 else "stop")
    assert [(r["prompt_index"], r["index"], r["seed"]) for r in rows] == [
        (0, 0, 1), (0, 1, 2), (1, 0, 1), (1, 1, 2)
    ]  # fmt: skip
    code, out, _ = cli(  # one prompt with --json: one line too, not the terminal stream
        "generate", run, "--prompt", "ab", "--max-new-tokens", "4", "--temperature", "0",
        "--json", "--stop", rows[0]["text"][:1] or "q", capsys=capsys,
    )  # fmt: skip
    assert len(out.splitlines()) == 1 and json.loads(out)["prompt"] == "ab"


def test_cli_stop_and_penalties_reach_the_sampler(run, capsys):
    greedy = SampleConfig(max_new_tokens=16, temperature=0)
    full = complete(run, ["ab"], greedy)[0].text
    stop = full[6:8]
    args = ["generate", run, "--prompt", "ab", "--max-new-tokens", "16", "--temperature", "0"]
    code, out, _ = cli(*args, "--stop", "@@", "--stop", stop, capsys=capsys)
    assert out == "ab" + full[: full.index(stop)] + "\n"  # the single prompt still streams
    code, out, _ = cli(*args, "--frequency-penalty", "2", "--presence-penalty", "1", capsys=capsys)
    penalties = dict(frequency_penalty=2.0, presence_penalty=1.0)
    penalised = complete(run, ["ab"], SampleConfig(**{**greedy.__dict__, **penalties}))[0].text
    assert out == "ab" + penalised + "\n" and penalised != full


def test_prompts_from_a_file_or_standard_input(run, tmp_path, capsys, monkeypatch):
    args = ["--max-new-tokens", "6", "--temperature", "0", "--json"]
    _, expected, _ = cli("generate", run, "--prompt", "ab", "--prompt", " The cat", *args,
                         capsys=capsys)  # fmt: skip
    prompts = tmp_path / "prompts.txt"
    # blank lines skipped, spaces kept, CRLF, and a BOM (a Windows editor's) is no text
    prompts.write_bytes(b"\xef\xbb\xbfab\r\n\n   \n The cat\n")
    code, out, err = cli("generate", run, "--prompt-file", prompts, *args, capsys=capsys)
    assert code == 0, err
    assert out == expected and len(out.splitlines()) == 2
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ab\n The cat")))
    code, out, err = cli("generate", run, "--prompt-file", "-", *args, capsys=capsys)
    assert code == 0, err
    assert out == expected


def test_one_prompt_streams_to_the_terminal_as_it_is_generated(run, capsys, monkeypatch):
    steps = []
    real = gptkiln.sampling.generate_stream

    def counted(*a, **k):
        for token in real(*a, **k):
            steps.append(1)
            yield token

    writes = []

    class Terminal(io.StringIO):
        def write(self, text):
            writes.append((len(steps), text))
            return super().write(text)

    monkeypatch.setattr(gptkiln.sampling, "generate_stream", counted)
    monkeypatch.setattr(sys, "stdout", Terminal())
    code = cli("generate", run, "--prompt", "ab", "--max-new-tokens", "12", "--temperature",
               "0", "--stop", "@@", capsys=capsys)[0]  # fmt: skip
    assert code == 0
    at = [n for n, text in writes if text]
    assert len(set(at)) >= 5 and at == sorted(at)  # pieces written while tokens still came
    assert at[0] < 12


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--prompt-file", "{tmp}/missing.txt"], ["missing.txt", "no such file"]),
        (["--prompt-file", "{tmp}/empty.txt"], ["empty.txt", "holds no prompt"]),
        (["--prompt-file", "{tmp}/blank.txt"], ["blank.txt", "holds no prompt"]),
        (["--prompt-file", "{tmp}/latin.txt"], ["latin.txt", "not UTF-8"]),
        (["--prompt-file", "{tmp}/bom.txt"], ["bom.txt", "byte 7 is not UTF-8"]),
        (["--prompt-file", "{tmp}"], ["is a directory"]),
        (["--prompt", "ab", "--num-samples", "0"], ["--num-samples must be", "got 0"]),
        (["--prompt", "ab", "--stop", ""], ["stop", "non-empty"]),
        (["--prompt", "ab", "--presence-penalty", "3"], ["--presence-penalty", "[-2, 2]"]),
        (["--prompt", "ab", "--batch-size", "0"], ["--batch-size must be"]),
        (["--prompt", "ab", "--prompt-file", "{tmp}/blank.txt"], ["not allowed with"]),
        ([], ["--prompt", "--prompt-file", "required"]),
    ],
)
def test_bad_generate_input_is_one_line(argv, needles, run, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    (tmp_path / "latin.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfcaf\xe9\n".replace(b"\xe9", b"e\xe9"))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, out, err = cli("generate", run, *argv, capsys=capsys)
    assert_one_line_error(code, err, *needles)
    assert out == ""


def test_stream_text_is_unchanged_by_the_batch_path(run):
    cfg = SampleConfig(max_new_tokens=10, temperature=0)
    pieces = list(stream_text(run, "ab", cfg))
    assert len(pieces) > 1 and "".join(pieces) == complete(run, ["ab"], cfg)[0].text
