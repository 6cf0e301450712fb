"""Inspection: the attention weights come from the one model and are the math they should be;
top-k and losses are the model's own; labels are readable; the picture has its panels."""

from __future__ import annotations

import json
import math
import warnings

import matplotlib.figure
import pytest
import torch
import torch.nn.functional as F
from test_attention import copy_teaching_weights
from test_cli import cli

from gptkiln import plots
from gptkiln.checkpoint import save_model
from gptkiln.config import GPTConfig
from gptkiln.inspect import inspect_prompt, pad, token_labels
from gptkiln.model import GPT, CausalSelfAttention
from gptkiln.teaching import MultiHeadAttention
from gptkiln.tokenizers import GPT2Tokenizer, build_char_tokenizer, train_bpe_tokenizer

TEXT = "To be, or not to be: that is the question.\nWhether 'tis nobler in the mind 天下大事"


@pytest.fixture(scope="module")
def char_tokenizer():
    return build_char_tokenizer([TEXT], with_eot=False)


def tiny_model(vocab_size: int, seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig.from_name("tiny", vocab_size=vocab_size, context_length=32, **overrides)
    return GPT(cfg).eval()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, char_tokenizer):
    return save_model(
        tiny_model(char_tokenizer.vocab_size),
        tmp_path_factory.mktemp("inspect") / "run",
        tokenizer=char_tokenizer,
    )


def layer_inputs(model: GPT) -> tuple[list[torch.Tensor], list]:
    """Hooks that keep what each layer's attention is given: its ln_1 output (B, T, C)."""
    inputs: list[torch.Tensor] = []
    hooks = [b.attn.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for b in model.h]
    return inputs, hooks


# -- the weights ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["sdpa", "math"])
def test_weights_are_softmax_of_each_layers_own_queries_and_keys(kernel, char_tokenizer):
    model = tiny_model(char_tokenizer.vocab_size, attention=kernel)
    inputs, hooks = layer_inputs(model)
    result = inspect_prompt(model, char_tokenizer, TEXT[:20])
    for h in hooks:
        h.remove()
    nh, T = model.config.n_head, 20
    assert result.attention.shape == (model.config.n_layer, nh, T, T)
    for layer, (block, x) in enumerate(zip(model.h, inputs)):
        q, k, _ = block.attn.c_attn(x).split(model.config.n_embd, dim=2)  # (1, T, C) each
        q = q.view(T, nh, -1).transpose(0, 1)  # (nh, T, hs)
        k = k.view(T, nh, -1).transpose(0, 1)  # (nh, T, hs)
        scores = q @ k.transpose(1, 2) / math.sqrt(q.size(-1))  # (nh, T, T)
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        expected = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        torch.testing.assert_close(result.attention[layer], expected.detach())


def test_weights_equal_the_teaching_multihead_attention_with_the_same_weights(char_tokenizer):
    # One layer on its own: the book's MultiHeadAttention, its weights copied into c_attn.
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=10, context_length=8, n_layer=1, n_head=4, n_embd=16)
    teach = MultiHeadAttention(16, 16, 8, 0.0, num_heads=4, qkv_bias=True).eval()
    attn = CausalSelfAttention(cfg).eval()
    copy_teaching_weights(teach, attn)
    x = torch.randn(2, 8, 16)
    weights: list[torch.Tensor] = []
    y = attn(x, attentions=weights)
    (w,) = weights
    torch.testing.assert_close(w, teach.attention_weights(x))
    torch.testing.assert_close(y, teach(x), atol=1e-6, rtol=1e-5)

    # Every layer of a whole model, through inspect_prompt: each layer's c_attn copied into a
    # teaching module, given what the layer was given.
    model = tiny_model(char_tokenizer.vocab_size, seed=1)
    inputs, hooks = layer_inputs(model)
    result = inspect_prompt(model, char_tokenizer, TEXT[:24])
    for h in hooks:
        h.remove()
    C, nh = model.config.n_embd, model.config.n_head
    for layer, (block, x) in enumerate(zip(model.h, inputs)):
        teach = MultiHeadAttention(C, C, 32, 0.0, num_heads=nh, qkv_bias=True).eval()
        with torch.no_grad():
            for i, lin in enumerate([teach.W_query, teach.W_key, teach.W_value]):
                lin.weight.copy_(block.attn.c_attn.weight[i * C : (i + 1) * C])
                lin.bias.copy_(block.attn.c_attn.bias[i * C : (i + 1) * C])
            expected = teach.attention_weights(x)[0]  # (nh, T, T)
        torch.testing.assert_close(result.attention[layer], expected)


def test_rows_sum_to_one_and_the_future_gets_nothing(char_tokenizer):
    result = inspect_prompt(tiny_model(char_tokenizer.vocab_size), char_tokenizer, TEXT[:30])
    w = result.attention  # (L, nh, T, T)
    torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))
    rows, cols = torch.tril_indices(30, 30)
    assert torch.all(w.triu(1) == 0) and torch.all(w[..., rows, cols] > 0)


def test_the_switch_changes_no_output_and_works_with_the_kv_cache():
    model = tiny_model(50)
    idx = torch.randint(0, 50, (2, 12))
    weights: list[torch.Tensor] = []
    with torch.no_grad():
        torch.testing.assert_close(model(idx, attentions=weights), model(idx))
        assert [w.shape for w in weights] == [(2, 2, 12, 12)] * 2
        model.setup_cache(2)
        model(idx, start_pos=0)
        cached: list[torch.Tensor] = []
        model(idx[:, :1], start_pos=12, attentions=cached)  # one new token sees 13 keys
    assert [w.shape for w in cached] == [(2, 2, 1, 13)] * 2
    torch.testing.assert_close(cached[0].sum(-1), torch.ones(2, 2, 1))


# -- probabilities and losses ----------------------------------------------------------------
def test_top_k_and_losses_are_the_models_own(char_tokenizer):
    model = tiny_model(char_tokenizer.vocab_size)
    text = TEXT[:25]
    result = inspect_prompt(model, char_tokenizer, text, top_k=4)
    ids = torch.tensor([char_tokenizer.encode(text)])
    with torch.no_grad():
        logits, loss = model(ids[:, :-1], ids[:, 1:])
        probs = torch.softmax(model(ids)[0], dim=-1)  # (T, V)
    for t, position in enumerate(result.positions):
        top = probs[t].topk(4)
        assert [c.id for c in position.top_k] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([c.prob for c in position.top_k]), top.values)
        if t + 1 < len(result.ids):
            p_next = probs[t, ids[0, t + 1]].item()
            assert position.next.id == ids[0, t + 1] and position.next.prob == pytest.approx(p_next)
            assert position.loss == pytest.approx(-math.log(p_next), rel=1e-5)
        else:
            assert position.next is None and position.loss is None
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)  # the training loss, same tokens
    assert result.perplexity == pytest.approx(math.exp(loss.item()), rel=1e-5)
    per_token = F.cross_entropy(logits[0], ids[0, 1:], reduction="none")
    assert [p.loss for p in result.positions[:-1]] == pytest.approx(per_token.tolist(), rel=1e-5)


def test_a_prompt_longer_than_max_tokens_is_cropped_and_says_so(char_tokenizer):
    model = tiny_model(char_tokenizer.vocab_size)
    whole = inspect_prompt(model, char_tokenizer, TEXT[:30], max_tokens=None)
    cropped = inspect_prompt(model, char_tokenizer, TEXT[:30], max_tokens=10)
    assert not whole.cropped and whole.crop_note() is None
    assert cropped.ids == whole.ids[:10] and cropped.prompt_tokens == 30
    assert "first 10" in cropped.crop_note() and "--max-tokens 10" in cropped.crop_note()
    # causal: the first 10 tokens' numbers are those of the whole prompt
    torch.testing.assert_close(cropped.attention, whole.attention[..., :10, :10])
    assert [p.loss for p in cropped.positions[:9]] == pytest.approx(
        [p.loss for p in whole.positions[:9]], rel=1e-5
    )
    long = inspect_prompt(model, char_tokenizer, TEXT, max_tokens=None)  # past the context, 32
    assert len(long.ids) == 32 and "context of 32" in long.crop_note()


def test_json_holds_the_weights_top_k_and_losses(char_tokenizer, tmp_path):
    result = inspect_prompt(tiny_model(char_tokenizer.vocab_size), char_tokenizer, TEXT[:12])
    data = json.loads(result.write_json(tmp_path / "r.json").read_text(encoding="utf-8"))
    torch.testing.assert_close(torch.tensor(data["attention"]), result.attention, atol=1e-6, rtol=0)
    assert [t["id"] for t in data["tokens"]] == result.ids
    assert [t["label"] for t in data["tokens"]][:3] == ["T", "o", "␣"]
    assert data["positions"][0]["top_k"][0]["id"] == result.positions[0].top_k[0].id
    assert data["positions"][0]["next"]["id"] == result.ids[1]
    assert data["positions"][-1]["next"] is None
    assert data["loss"] == pytest.approx(result.loss, abs=1e-6)
    assert (data["n_layer"], data["n_head"], data["cropped"]) == (2, 2, False)


# -- readable tokens -----------------------------------------------------------------------------
def test_every_tokenizer_gives_back_the_bytes_of_its_text():
    text = "Your journey starts\nwith one step, 天下大事 ok"
    bpe = train_bpe_tokenizer([text * 20], 300)
    for tok in (GPT2Tokenizer(), bpe, build_char_tokenizer([text], with_eot=False)):
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8"), tok.kind


def test_labels_show_spaces_newlines_and_the_pieces_of_a_character():
    gpt2 = GPT2Tokenizer()
    ids = gpt2.encode("Your journey\n\t and 中文")
    # GPT-2 writes 文 as two byte pieces: each shows the character, with … where it goes on
    assert token_labels(gpt2, ids) == [
        "Your",
        "␣journey",
        "↵",
        "⇥",
        "␣and",
        "␣",
        "中",
        "文…",
        "…文",
    ]
    char = build_char_tokenizer(["a b\x0bc"], with_eot=False)
    assert token_labels(char, char.encode("a b\x0bc")) == ["a", "␣", "b", "\\x0b", "c"]
    assert token_labels(gpt2, [gpt2.encode("文")[0]]) == ["\\xe6\\x96"]  # a piece on its own


def test_tables_line_up_with_wide_characters():
    assert pad("天下", 6) == "天下  " and pad("abc", 5) == "abc  "
    assert pad("天下大事", 5) == "天下…" and pad("abcdefgh", 5) == "abcd…"


# -- the picture ---------------------------------------------------------------------------------
def panels(fig) -> list:
    return [ax for ax in fig.axes if ax.get_title().startswith("layer")]


def test_the_grid_has_a_panel_per_layer_and_head_or_per_choice(char_tokenizer):
    model = tiny_model(char_tokenizer.vocab_size, n_layer=3, n_head=2)
    result = inspect_prompt(model, char_tokenizer, TEXT[:10])
    figures = plots.attention_figures(result.attention, result.labels)
    ((fig, suffix),) = figures
    assert suffix == "" and len(panels(fig)) == 6
    assert [ax.get_title() for ax in panels(fig)][:3] == [
        "layer 0 · head 0",
        "layer 0 · head 1",
        "layer 1 · head 0",
    ]
    first = panels(fig)[0]
    assert [t.get_text() for t in first.get_yticklabels()] == result.labels  # queries down
    assert first.images[0].get_array().mask[0, 1]  # the future, masked (grey)
    ((fig, _),) = plots.attention_figures(result.attention, result.labels, layers=[2])
    assert [ax.get_title() for ax in panels(fig)] == ["layer 2 · head 0", "layer 2 · head 1"]
    ((fig, _),) = plots.attention_figures(result.attention, result.labels, heads=[1])
    assert [ax.get_title() for ax in panels(fig)] == [f"layer {i} · head 1" for i in range(3)]
    ((fig, _),) = plots.attention_figures(
        result.attention, result.labels, [1], [0], title="run: " + repr(TEXT[:60])
    )
    assert [ax.get_title() for ax in panels(fig)] == ["layer 1 · head 0"]
    fig.canvas.draw()  # one narrow panel: its title lines wrap inside the figure
    box = fig._suptitle.get_window_extent()
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width


def test_a_grid_too_large_for_one_figure_becomes_one_file_per_layer(
    char_tokenizer, tmp_path, monkeypatch
):
    model = tiny_model(char_tokenizer.vocab_size, n_layer=3, n_head=2)
    result = inspect_prompt(model, char_tokenizer, TEXT[:30])
    saved = []
    savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(
        matplotlib.figure.Figure,
        "savefig",
        lambda f, *a, **k: (saved.append(f), savefig(f, *a, **k)),
    )
    notes: list[str] = []
    one = plots.plot_attention(result.attention, result.labels, tmp_path / "a.png")
    assert one == [tmp_path / "a.png"] and len(panels(saved[0])) == 6
    monkeypatch.setattr(plots, "MAX_GRID_INCHES", 8.0)  # 30 tokens: 5.1-inch panels
    files = plots.plot_attention(
        result.attention, result.labels, tmp_path / "a.png", on_notice=notes.append
    )
    assert files == [tmp_path / f"a-layer{i}.png" for i in range(3)]
    assert all(f.read_bytes()[:4] == b"\x89PNG" for f in files)
    assert [len(panels(f)) for f in saved[1:]] == [2, 2, 2]
    assert "one figure per layer" in notes[0]


def glyph_warnings(labels, tmp_path) -> tuple[list[str], list[str]]:
    """Draw a panel of ``labels``; (matplotlib's missing-glyph warnings, notes)."""
    notes: list[str] = []
    weights = torch.softmax(torch.randn(1, 1, len(labels), len(labels)), -1).tril()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plots.plot_attention(weights, labels, tmp_path / "g.png", on_notice=notes.append)
    return [str(w.message) for w in caught if "missing from font" in str(w.message)], notes


def test_without_a_chinese_font_labels_are_escapes_not_boxes(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "cjk_font", lambda: None)
    families, shown, note = plots.label_fonts(["天下", "$5 and $6"])
    assert shown("天下") == "\\u5929\\u4e0b" and shown("$5 and $6") == r"\$5 and \$6"
    assert "fonts-noto-cjk" in note and "天" in note
    missing, notes = glyph_warnings(["大", "事", "␣of"], tmp_path)
    assert missing == [] and len(notes) == 1


def test_with_a_chinese_font_labels_are_drawn_in_it(tmp_path):
    if plots.cjk_font() is None:
        pytest.skip("no CJK font installed (e.g. apt-get install fonts-noto-cjk)")
    families, shown, note = plots.label_fonts(["天下", "ok"])
    assert families[1] == plots.cjk_font()[0] and shown("天下") == "天下" and note is None
    missing, notes = glyph_warnings(["天", "下", "大事", "…文"], tmp_path)
    assert missing == [] and notes == []


# -- the command ---------------------------------------------------------------------------------


def test_inspect_command_prints_the_table_and_writes_the_png_and_json(run_dir, tmp_path, capsys):
    out_png, out_json = tmp_path / "att.png", tmp_path / "att.json"
    code, out, err = cli(
        "inspect", run_dir, "--prompt", "To be, or", "--top-k", "3", "--out", out_png,
        "--json", out_json, capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["pos", "token", "next", "p(next)", "loss"]
    assert lines[1].split()[:2] == ["0", "T"] and lines[3].split()[:3] == ["2", "␣", "b"]
    assert "top-3 next tokens" in lines[0] and "perplexity" in lines[10]
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(out_json.read_text(encoding="utf-8"))
    assert len(data["tokens"]) == 9 and len(data["positions"][0]["top_k"]) == 3
    assert f"wrote {out_png}" in out and f"wrote {out_json}" in out

    code, out, err = cli(
        "inspect", run_dir, "--prompt", "To be, or not", "--position", "-1", "--layer", "1",
        "--head", "0", "--max-tokens", "5", "--out", out_png, capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    assert "inspecting the first 5" in err
    assert out.splitlines()[1].split()[:3] == ["4", "e", "-"]  # only the last position


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--layer", "2"], "--layer 2: there are 2 layers, numbered 0 to 1"),
        (["--head", "-3"], "--head -3: there are 2 heads"),
        (["--position", "9"], "--position 9: there are 2 prompt tokens"),
        (["--top-k", "0"], "--top-k 0: choose 1 to"),
        (["--max-tokens", "0"], "--max-tokens 0: choose at least 1"),
    ],
)
def test_bad_inspect_flags_get_one_line(flags, needle, run_dir, tmp_path, capsys):
    code, out, err = cli(
        "inspect", run_dir, "--prompt", "To", *flags, "--out", tmp_path / "x.png", capsys=capsys
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert out == "" and not (tmp_path / "x.png").exists()  # refused before any output


def test_an_out_that_is_no_png_path_gets_one_line_before_the_model_runs(run_dir, tmp_path, capsys):
    (tmp_path / "adir").mkdir()
    for out, needle in (("a.txt", "give a path ending in .png"), ("adir", "is a directory")):
        code, printed, err = cli(
            "inspect", run_dir, "--prompt", "To", "--out", tmp_path / out, capsys=capsys
        )
        assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
        assert printed == ""  # refused before the table
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]


def test_an_out_or_json_that_cannot_be_written_is_one_line_before_the_model_runs(
    run_dir, tmp_path, capsys
):
    """A folder no file can be made in (``/proc``) is refused before the work, and nothing is
    written (the picture is not left behind a failed --json); a missing folder is made."""
    picture = tmp_path / "a.png"
    for flags in (["--out", "/proc/a.png"], ["--out", picture, "--json", "/proc/a.json"]):
        code, printed, err = cli("inspect", run_dir, "--prompt", "To", *flags, capsys=capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "cannot write in" in err
        assert printed == "" and not picture.exists()
    deep = tmp_path / "new" / "folder" / "a.png"
    code, _, err = cli("inspect", tmp_path / "no-run", "--prompt", "To", "--out", deep,
                       capsys=capsys)  # fmt: skip
    assert code == 2 and not (tmp_path / "new").exists()  # a refusal makes no folder
    picture.write_bytes(b"a file")
    code, _, err = cli("inspect", run_dir, "--prompt", "To", "--out", picture / "a.png",
                       capsys=capsys)  # fmt: skip
    assert code == 2 and f"{picture} is a file, not a folder" in err
    assert cli("inspect", run_dir, "--prompt", "To", "--out", deep, capsys=capsys)[0] == 0
    assert deep.is_file()


def test_an_out_or_json_over_a_runs_file_or_each_other_is_refused(run_dir, tmp_path, capsys):
    """The picture and the JSON never replace a file of the run (its config.json, loss.png)
    or each other."""
    (run_dir / "loss.png").write_bytes(b"\x89PNG, as training plots it")
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    picture = tmp_path / "a.png"
    for flags, needle in (
        (["--out", run_dir / "loss.png"], "a file of the run in"),
        (["--out", picture, "--json", run_dir / "config.json"], "--json"),
        (["--out", picture, "--json", picture], "is --out's picture too"),
    ):
        code, printed, err = cli("inspect", run_dir, "--prompt", "To", *flags, capsys=capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
        assert printed == ""
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def test_an_empty_prompt_or_a_missing_run_gets_one_line(run_dir, tmp_path, capsys):
    code, _, err = cli("inspect", run_dir, "--prompt", "", capsys=capsys)
    assert code == 2 and "prompt is empty" in err
    code, _, err = cli("inspect", tmp_path / "nope", "--prompt", "x", capsys=capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "does not exist" in err


def test_inspect_quantize_int8_shows_the_quantized_model(run_dir, tmp_path, capsys):
    from gptkiln.loading import load_run
    from gptkiln.quantize import quantize_model

    fp32_json, int8_json = tmp_path / "fp32.json", tmp_path / "int8.json"
    common = ["--prompt", "To be, or", "--out", tmp_path / "att.png"]
    code, _, err = cli("inspect", run_dir, *common, "--json", fp32_json, capsys=capsys)
    assert code == 0, err
    code, _, err = cli(
        "inspect", run_dir, *common, "--json", int8_json, "--quantize", "int8", capsys=capsys
    )
    assert code == 0, err
    model, tokenizer, _ = load_run(run_dir)
    expected = inspect_prompt(quantize_model(model), tokenizer, "To be, or").to_dict()
    fp32, int8 = (json.loads(p.read_text(encoding="utf-8")) for p in (fp32_json, int8_json))
    assert int8 == expected and int8["loss"] != fp32["loss"]  # the int8 model's, not fp32's
    assert int8["loss"] == pytest.approx(fp32["loss"], rel=0.02)

    code, out, err = cli("inspect", run_dir, *common, "--quantize", "int4", capsys=capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "'int4'" in err and out == ""
