"""The decode precision is a person's choice (``--precision fp32 | bf16 | int8``), said before
the text, in ``info``, and held: the kernels a precision runs are of that precision only, and a
bf16 run decodes on the CPU over its own bf16 weights (fp32 activations)."""

import pytest
import torch
import torch.nn.functional as F
from test_cli import assert_one_line_error, cli

from gptkiln.api import run_info, stream_text
from gptkiln.config import GPTConfig, SampleConfig
from gptkiln.cpu import library, planned, prepare_for_decoding, ready_for_decoding, specs
from gptkiln.errors import GptkilnError
from gptkiln.model import GPT, Linear
from gptkiln.quantize import quantize_model
from gptkiln.tokenizers import CharTokenizer

GREEDY = SampleConfig(max_new_tokens=6, temperature=0, stop_at_eos=False)


def tiny(dtype=torch.float32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("tiny", vocab_size=64, context_length=24)).to(dtype).eval()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same tiny model saved in fp32 and in bf16 (as `convert hf` keeps a bf16 checkpoint)."""
    from gptkiln.checkpoint import save_model

    tokenizer = CharTokenizer([chr(c) for c in range(32, 95)], with_eot=True)
    root = tmp_path_factory.mktemp("precision")
    return {
        name: save_model(tiny(dtype), root / name, tokenizer=tokenizer)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }


def test_a_model_decodes_at_its_weights_own_precision_unless_told():
    model = tiny()
    assert ready_for_decoding(model, None, "cpu") == "fp32"
    assert ready_for_decoding(tiny(), "bf16", "cpu") == "bf16"
    half = tiny(torch.bfloat16)
    assert ready_for_decoding(half, None, "cpu") == "bf16"
    # on the CPU a bf16 model computes in fp32 over its own weights: the bf16 loop's copies are
    # then exactly the weights it was given
    assert all(p.dtype == torch.float32 for p in half.parameters())
    quantized = quantize_model(tiny())
    assert ready_for_decoding(quantized, None, "cpu") == "int8"
    with pytest.raises(GptkilnError, match="int8 weights, so it decodes at int8"):
        ready_for_decoding(quantized, "fp32", "cpu")
    with pytest.raises(GptkilnError, match="choose one of fp32, bf16, int8"):
        ready_for_decoding(tiny(), "fp16", "cpu")


@pytest.mark.skipif(library.library() is None, reason="no C compiler: no bf16 loop here")
def test_fp32_decoding_never_runs_bf16_copies_and_bf16_decoding_always_does(monkeypatch):
    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")  # conftest's: the suite decodes exactly
    bf16 = specs.BY_NAME["bf16_rows"].kernel
    model = tiny()
    plan = prepare_for_decoding(model, 1, precision="fp32")
    used = {
        k
        for m in model.modules()
        if isinstance(m, Linear)
        for k in planned.few_row_kernels(m).values()
    }
    assert used and bf16 not in used and "bf16_rows" not in plan.kernels[1].values()
    plan.release()
    plan = prepare_for_decoding(model, 1, precision="bf16")
    assert set(plan.kernels[1].values()) == {"bf16_rows"}  # no timing race: always its own


def said_for(precision: str) -> str:
    """The start of the note for ``precision``: what this machine and setting really run."""
    from gptkiln.cpu import specs

    weight = "int8" if precision == "int8" else "float32"
    if precision == "fp32" or specs.precision_for(weight, precision) == precision:
        return f"decoding at {precision}"
    return "decoding at " + ("fp32 (exact): bf16's" if precision == "bf16" else "int8 (int8 w")


def test_the_precision_is_said_first_and_in_info(runs, monkeypatch):
    notices = []
    pieces = stream_text(runs["bf16"], "AB", GREEDY, on_notice=notices.append)
    text = "".join(pieces)
    # the suite's exact kernels: the note says bf16's loop does not run, and what does
    assert len(text) > 0 and notices[0].startswith("decoding at fp32 (exact): bf16's own loop")
    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")
    notices.clear()
    "".join(stream_text(runs["bf16"], "AB", GREEDY, on_notice=notices.append))
    assert notices[0].startswith(said_for("bf16"))
    assert run_info(runs["bf16"]).decodes_at == "bf16"
    assert run_info(runs["fp32"]).decodes_at == "fp32"
    assert "decodes at  fp32 on a CPU" in run_info(runs["fp32"]).summary()


def test_generate_takes_the_precision_flag(runs, capsys):
    for precision in ("fp32", "bf16", "int8"):
        args = ["generate", runs["fp32"], "--prompt", "AB", "--temperature", "0"]
        code, out, err = cli(*args, "--max-new-tokens", 4, "--precision", precision, capsys=capsys)
        assert code == 0 and out.startswith("AB")
        assert err.splitlines()[0].startswith(f"note: {said_for(precision)}")  # first
    code, _, err = cli(
        "generate", runs["fp32"], "--prompt", "AB", "--precision", "fp16", capsys=capsys
    )
    assert code == 2 and "invalid choice" in err
    quantized = runs["fp32"].parent / "int8"
    assert cli("convert", "quantize", runs["fp32"], "--out", quantized, capsys=capsys)[0] == 0
    code, _, err = cli(
        "generate", quantized, "--prompt", "AB", "--precision", "bf16", capsys=capsys
    )
    assert_one_line_error(code, err, "int8 weights, so it decodes at int8")
    code, _, err = cli(  # a float run quantized as it loads: the two flags conflict
        "generate", runs["fp32"], "--prompt", "AB", "--quantize", "int8", "--precision", "fp32",
        capsys=capsys,
    )  # fmt: skip
    assert_one_line_error(code, err, "--quantize int8 makes the weights int8", "drop --quantize")


def test_on_a_gpu_the_precision_asked_is_the_weights_dtype():
    # "meta" stands for a GPU here: any device but the CPU, where no CPU backend decodes
    model = GPT(GPTConfig.from_name("llama3-baby", vocab_size=64, context_length=24))
    model.to("meta")
    assert ready_for_decoding(model, "bf16", "meta") == "bf16"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope_cos.dtype == torch.float32  # RoPE's tables rebuilt in fp32
    assert ready_for_decoding(model, "fp32", "meta") == "fp32"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert ready_for_decoding(model, None, "meta") == "fp32"  # unasked: the weights' own


def _rounding_reference(precision: str, layer, x: torch.Tensor) -> torch.Tensor:
    """``layer``'s product of ``x`` as ``precision`` rounds it, by torch: bf16 weights, or
    q8_0's 8-bit activations times the int8 weights."""
    from gptkiln.cpu import products

    if precision == "bf16":
        return F.linear(x, layer.weight.to(torch.bfloat16).float(), layer.bias)
    return products.dequantize_linear(products.q8_0(x), layer.weight, layer.scale, layer.bias)


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_rounding_precision_rounds_every_forward_alike_whatever_was_tuned_before(
    precision, monkeypatch
):
    """bf16 and int8 round on purpose, and a decoding's prefill rounds as its steps do: before
    any row count is tuned (a first prompt), at a tuned count (a server's bucket, an earlier
    batch) and past the loops' 64 rows alike. Outside a decoding (a perplexity, an inspection,
    a caller's own forward) and inside `exact_kernels` (evaluation) nothing rounds."""
    from gptkiln.cpu import exact_kernels
    from gptkiln.sampling import decoding

    if not specs.available(specs.BY_NAME["bf16_rows" if precision == "bf16" else "q8_rows"]):
        pytest.skip(f"{precision}'s own loop does not run on this machine")
    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")  # conftest's: the suite decodes exactly
    torch.manual_seed(0)
    config = GPTConfig.from_name("tiny", vocab_size=64, context_length=96, n_embd=64)
    model = GPT(config).eval()  # 64 wide: q8_0 rounds whole chunks of two blocks
    if precision == "int8":
        model = quantize_model(model)
    layer = model.h[0].mlp.c_fc
    x, idx = torch.randn(90, 64), torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        exact, exact_logits = layer(x), model(idx)
        rounded = _rounding_reference(precision, layer, x)
    assert (rounded - exact).abs().max() > 1e-3  # the rounding shows at this size

    prepare_for_decoding(model, steps=0, precision=precision)  # untuned, as a first prefill's
    with torch.no_grad(), decoding():
        for rows in (90, 5, 1):
            torch.testing.assert_close(layer(x[:rows]), rounded[:rows], rtol=1e-5, atol=1e-5)
        first = model(idx)
    assert (first - exact_logits).abs().max() > 1e-4
    prepare_for_decoding(model, [1, 5], precision=precision)  # 5 rows tuned: a bucket's
    with torch.no_grad(), decoding():
        torch.testing.assert_close(layer(x[:5]), rounded[:5], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(idx), first, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the same planned model outside a decoding: the weights' numbers
        for rows in (90, 5, 1):
            torch.testing.assert_close(layer(x[:rows]), exact[:rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(idx), exact_logits, rtol=1e-5, atol=1e-5)

    with exact_kernels():  # an evaluation's: every row count back to the weights' own numbers
        prepare_for_decoding(model, steps=0, precision=precision)
        with torch.no_grad(), decoding():
            for rows in (90, 5):
                torch.testing.assert_close(layer(x[:rows]), exact[:rows], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(library.library() is None, reason="no C compiler: no bf16 loop here")
def test_generate_plans_a_rounding_precision_before_its_first_prefill(monkeypatch):
    from gptkiln.api import _decoding
    from gptkiln.sampling import decoding

    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")
    model, plain = tiny(), tiny()
    layer = model.h[0].attn.c_attn
    x = torch.randn(70, layer.in_features)
    _decoding(model, "bf16")  # what generate and chat hand generate_stream
    with torch.no_grad(), decoding():
        torch.testing.assert_close(
            layer(x), _rounding_reference("bf16", layer, x), rtol=1e-5, atol=1e-5
        )
    _decoding(plain, None)  # fp32: nothing rounds, nothing to plan before the first token
    assert getattr(plain, "decode_plan", None) is None


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_generation_leaves_the_models_other_forwards_exact(precision, monkeypatch):
    """The plan stays on the model after a generation (the next one reuses it), but its
    rounding is the decoding's: a perplexity or a forward of the same model after it has the
    weights' own numbers, as before it (an int8 model decodes at int8 unasked)."""
    from gptkiln.api import stream_from_model

    if not specs.available(specs.BY_NAME["bf16_rows" if precision == "bf16" else "q8_rows"]):
        pytest.skip(f"{precision}'s own loop does not run on this machine")
    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=64, context_length=48, n_embd=64)).eval()
    asked = precision
    if precision == "int8":
        model, asked = quantize_model(model), None  # its own precision
    tokenizer = CharTokenizer([chr(c) for c in range(32, 95)], with_eot=True)
    idx = torch.randint(0, 63, (2, 40))
    with torch.no_grad():
        before = model(idx)
    text = "".join(stream_from_model(model, tokenizer, "AB" * 20, GREEDY, precision=asked))
    assert text and getattr(model, "decode_plan", None) is not None  # planned, and kept
    with torch.no_grad():
        torch.testing.assert_close(model(idx), before, rtol=0, atol=1e-6)


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_servers_inspection_is_of_the_weights_own_numbers(precision, monkeypatch):
    """The server's decoding rounds at its precision; an inspection run on its decode thread
    between two steps is no decoding: it shows what `gptkiln inspect` shows."""
    import asyncio

    from gptkiln.inspect import inspect_prompt
    from gptkiln.serve.batcher import Batcher

    if not specs.available(specs.BY_NAME["bf16_rows" if precision == "bf16" else "q8_rows"]):
        pytest.skip(f"{precision}'s own loop does not run on this machine")
    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=64, context_length=96, n_embd=64)).eval()
    if precision == "int8":
        model = quantize_model(model)
    tokenizer = CharTokenizer([chr(c) for c in range(32, 95)], with_eot=True)
    text = "HELLO, WORLD! " * 5
    alone = inspect_prompt(model, tokenizer, text, top_k=3, max_tokens=None)

    async def served():
        batcher = Batcher(model, tokenizer, max_batch=2)
        batcher.precision = precision
        await batcher.start()
        try:
            return await batcher.call(
                lambda: inspect_prompt(model, tokenizer, text, top_k=3, max_tokens=None)
            )
        finally:
            await batcher.stop()

    got = asyncio.run(served())
    losses = [(a.loss, b.loss) for a, b in zip(alone.positions, got.positions, strict=True)]
    assert all(a is None or abs(a - b) < 1e-5 for a, b in losses)
