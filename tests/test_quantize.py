"""Int8 weight-only quantization: the scheme, the model it makes, the runs it saves and loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from gptkiln.checkpoint import save_model
from gptkiln.config import GPTConfig
from gptkiln.cpu import prepare_for_decoding, products, specs, tuner
from gptkiln.errors import GptkilnError
from gptkiln.loading import CONFIG_FILE, WEIGHTS_FILE, load_model, load_run
from gptkiln.model import GPT, Linear
from gptkiln.quantize import (
    Int8Embedding,
    Int8Linear,
    check_quantize,
    dequantize,
    quantization_of,
    quantize_model,
    quantize_per_channel,
)
from gptkiln.sampling import generate

# Logits of the quantized tiny model against its float self: within this share of the float
# logits' largest magnitude. Per-channel int8 rounds each weight by at most scale/2 = absmax/254
# (0.4% of its row's largest); measured on the tiny model below: 0.4-0.7% (tied and untied).
LOGITS_TOLERANCE = 0.02


@pytest.fixture(autouse=True)
def no_compiling(monkeypatch):
    """Generation here tunes among the int8 kernels that need no compiler (`fused_int8`, which
    compiles for a second or more per shape, has its own tests in test_kernels.py)."""
    monkeypatch.setattr(tuner, "_CHOSEN", {})
    real = specs.offered
    int8 = {"dequantize": products.dequantize_linear, "int8pack_mm": products.int8pack_mm}
    monkeypatch.setattr(
        specs,
        "offered",
        lambda weight, precision: int8 if weight == "int8" else real(weight, precision),
    )


def tiny_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig.from_name("tiny", **{"vocab_size": 61, "context_length": 32, **overrides})
    return GPT(config).eval()


# -- the scheme ------------------------------------------------------------------------------
def test_per_channel_int8_is_the_nearest_grid_point_of_each_row():
    torch.manual_seed(0)
    w = torch.randn(24, 40) * torch.logspace(-3, 1, 24)[:, None]  # rows of very different sizes
    w[5] = 0.0  # a row of zeros
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q.shape == (24, 40) and scale.shape == (24,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    nonzero = torch.arange(24) != 5
    torch.testing.assert_close(scale[nonzero], w[nonzero].abs().amax(1) / 127)
    assert torch.equal(q[5], torch.zeros(40, dtype=torch.int8)) and scale[5] == 1 / 127
    err = (dequantize(q, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-5)).all())  # rounded, not truncated


def test_quantizing_on_the_meta_device_costs_nothing_and_keeps_shapes():
    with torch.device("meta"):
        model = quantize_model(GPT(GPTConfig.from_name("gpt2")))
    tensors = list(model.state_dict().values())
    assert all(t.is_meta for t in tensors)
    assert model.h[0].attn.c_attn.weight.dtype == torch.int8
    assert model.h[0].attn.c_attn.scale.shape == (2304,)


# -- the quantized model ---------------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False])
def test_every_linear_and_the_embedding_become_int8_the_rest_stays_float(tied):
    model = quantize_model(tiny_model(tie_embeddings=tied))
    linears = [m for m in model.modules() if isinstance(m, (Linear, torch.nn.Linear))]
    assert linears == []  # none left in float
    assert isinstance(model.wte, Int8Embedding) and isinstance(model.lm_head, Int8Linear)
    assert (model.lm_head.weight is model.wte.weight) is tied
    assert (model.lm_head.scale is model.wte.scale) is tied
    assert model.wpe.weight.dtype == torch.float32 and model.ln_f.weight.dtype == torch.float32
    assert model.h[0].attn.c_attn.bias.dtype == torch.float32
    assert quantization_of(model) == {
        "method": "int8",
        "scheme": "per-channel-symmetric",
        "embedding_and_head": True,
    }
    assert quantize_model(model) is model  # quantized already: left as it is


def test_an_untuned_int8_layer_multiplies_few_rows_without_converting_its_weight(monkeypatch):
    """A prompt's first token comes before any tuning: its few rows go to the int8 loop, which
    reads the int8 weight as it is, rather than to the reference, which makes an fp32 copy of
    it at every call; with autograd, or more rows than the loop takes, the reference runs."""
    import gptkiln.quantize as quantize
    from gptkiln.cpu.library import library

    if library() is None:
        pytest.skip("no C compiler here: the reference is the only product")
    torch.manual_seed(0)
    layer = Int8Linear.from_float(torch.nn.Linear(64, 48))
    reference = products.dequantize_linear
    converted: list[int] = []

    def spy(x, *rest):
        converted.append(x.numel() // x.size(-1))
        return reference(x, *rest)

    monkeypatch.setattr(products, "dequantize_linear", spy)
    monkeypatch.setattr(quantize, "dequantize_linear", spy)
    x = torch.randn(1, 3, 64)
    with torch.no_grad():
        got = layer(x)
        assert not converted
        layer(torch.randn(products.FEW_ROWS + 1, 64))
    assert converted == [products.FEW_ROWS + 1]
    layer(x)  # with autograd
    assert converted == [products.FEW_ROWS + 1, 3]
    want = reference(x, layer.weight, layer.scale, layer.bias)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    # torch.compile cannot trace the loop's ctypes call: a compiled layer keeps the reference
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    with torch.no_grad():
        assert torch.allclose(compiled(x), want, atol=1e-5, rtol=1e-5)
    # off the CPU (as on CUDA) the reference, and the C library is not even built or loaded
    import copy

    monkeypatch.setattr(products, "library", lambda: pytest.fail("library asked for"))
    elsewhere = copy.deepcopy(layer).to("meta")
    with torch.no_grad():
        assert elsewhere(x.to("meta")).shape == (1, 3, 48)


def test_the_head_and_embedding_can_stay_float():
    model = quantize_model(tiny_model(), embedding_and_head=False)
    assert isinstance(model.h[1].mlp.c_fc, Int8Linear)
    assert type(model.wte) is torch.nn.Embedding and type(model.lm_head) is Linear
    assert model.lm_head.weight is model.wte.weight
    assert quantization_of(model)["embedding_and_head"] is False
    assert quantization_of(tiny_model()) is None


@pytest.mark.parametrize("tied", [True, False])
def test_logits_stay_within_the_stated_tolerance_of_fp32(tied):
    model = tiny_model(tie_embeddings=tied)
    idx = torch.randint(0, 61, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(idx)
        got = quantize_model(model)(idx)
    diff = float((got - expected).abs().max() / expected.abs().max())
    assert 0 < diff < LOGITS_TOLERANCE


def test_int8_layers_compute_with_the_dequantized_weights():
    torch.manual_seed(0)
    linear, emb = torch.nn.Linear(16, 12), torch.nn.Embedding(10, 16)
    qlinear, qemb = Int8Linear.from_float(linear), Int8Embedding.from_float(emb)
    x, idx = torch.randn(2, 3, 16, requires_grad=True), torch.tensor([[1, 9, 1]])
    w = dequantize(qlinear.weight, qlinear.scale)
    torch.testing.assert_close(qlinear(x), F.linear(x, w, linear.bias))
    torch.testing.assert_close(qemb(idx), F.embedding(idx, dequantize(qemb.weight, qemb.scale)))
    qlinear(x).sum().backward()  # gradients reach the input (adapters on a frozen int8 model)
    assert x.grad is not None and qlinear.weight.grad is None
    assert not qlinear.weight.requires_grad


@pytest.mark.parametrize("batch", [1, 2])
def test_a_quantized_model_generates_with_the_kv_cache_as_without(batch):
    model = quantize_model(tiny_model())
    prompts = [[1, 2, 3], [4, 5, 6]][:batch]
    prepare = prepare_for_decoding  # the CPU backend, as the commands decode
    cached = generate(model, prompts, max_new_tokens=12, temperature=0, prepare=prepare)
    assert cached == generate(model, prompts, max_new_tokens=12, temperature=0, use_cache=False)
    assert model.h[0].attn.kv_cache is None  # cleared; it was float32 (ln_f's), not int8
    assert set(tuner.chosen()) and all(key[4] == "int8" for key in tuner.chosen())


@pytest.mark.parametrize("preset", ["tiny", "qwen3-baby"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_run_quantizes_to_fp32_norms_and_generates(tmp_path, preset, dtype):
    """Real checkpoints are mostly bf16: the norms and biases that stay float become fp32 with
    the int8 products' outputs, whether quantized on load or saved quantized (as an older
    `convert quantize` saved them, bf16) and loaded; the cache is fp32 (ln_f's dtype)."""
    torch.manual_seed(0)
    config = GPTConfig.from_name(preset, vocab_size=61, context_length=32)
    save_model(GPT(config).to(dtype).eval(), tmp_path / "half")
    on_load = load_model(tmp_path / "half", quantize="int8")
    older = quantize_model(load_model(tmp_path / "half"))
    for tensor in older.parameters():  # as saved before the norms were made fp32
        if tensor.is_floating_point() and tensor.dim() == 1 and tensor.numel() == config.n_embd:
            tensor.data = tensor.data.to(dtype)
    assert any(t.dtype == dtype for t in older.state_dict().values())
    save_model(older, tmp_path / "older")
    for model in (on_load, load_model(tmp_path / "older")):
        floats = [t for t in model.state_dict().values() if t.is_floating_point()]
        assert floats and all(t.dtype == torch.float32 for t in floats)
        ids = generate(model, [1, 2, 3], max_new_tokens=6, temperature=0)
        assert ids == generate(model, [1, 2, 3], max_new_tokens=6, temperature=0, use_cache=False)
        with torch.no_grad():
            assert torch.isfinite(model(torch.tensor([[1, 2, 3]]))).all()


def test_a_bad_quantize_value_is_refused_in_one_line():
    assert check_quantize(None) is None and check_quantize("int8") == "int8"
    for bad in ("int4", "INT8", ""):
        with pytest.raises(GptkilnError, match=f"quantize {bad!r} is not .* choose one of: int8"):
            check_quantize(bad)
    with pytest.raises(GptkilnError, match="'fp8'"):
        load_model("/nonexistent", quantize="fp8")  # checked before anything is read


# -- quantized runs: save and load -----------------------------------------------------------
@pytest.fixture
def float_run(tmp_path: Path) -> Path:
    from gptkiln.tokenizers import load_tokenizer

    model = tiny_model(vocab_size=50257)  # every id of the gpt2 tokenizer
    save_model(model, tmp_path / "float", tokenizer=load_tokenizer("gpt2"))
    return tmp_path / "float"


@pytest.mark.parametrize("tied", [True, False])
def test_quantize_save_load_round_trip_is_exact(tmp_path, tied):
    model = quantize_model(tiny_model(tie_embeddings=tied))
    save_model(model, tmp_path / "q")
    loaded = load_model(tmp_path / "q")
    expected, got = model.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    for name in expected:  # bit for bit, int8 weights and float scales alike
        assert got[name].dtype == expected[name].dtype, name
        assert torch.equal(got[name], expected[name]), name
    assert (loaded.lm_head.weight is loaded.wte.weight) is tied
    assert (loaded.lm_head.scale is loaded.wte.scale) is tied
    idx = torch.randint(0, 61, (2, 10))
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))


def test_the_quantized_format_on_disk(tmp_path):
    save_model(quantize_model(tiny_model()), tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / CONFIG_FILE).read_text())
    assert cfg["format"] == 2
    assert cfg["quantization"] == {
        "method": "int8",
        "scheme": "per-channel-symmetric",
        "embedding_and_head": True,
    }
    with safe_open(tmp_path / "q" / WEIGHTS_FILE, framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("h.0.attn.c_attn.weight").dtype == torch.int8
        assert f.get_tensor("h.0.attn.c_attn.scale").dtype == torch.float32
        assert f.get_tensor("wte.weight").dtype == torch.int8
        assert f.get_tensor("wpe.weight").dtype == torch.float32
    assert "wte.scale" in names and not any(n.startswith("lm_head") for n in names)


def test_quantize_on_load_equals_quantizing_the_loaded_model(float_run):
    on_load = load_model(float_run, quantize="int8")
    after = quantize_model(load_model(float_run))
    a, b = on_load.state_dict(), after.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model, tokenizer, cfg = load_run(float_run, quantize="int8")
    assert quantization_of(model) is not None and "quantization" not in cfg


def _quantized_run(tmp_path: Path, **overrides) -> Path:
    save_model(quantize_model(tiny_model(**overrides)), tmp_path / "q")
    return tmp_path / "q"


def test_a_truncated_quantized_file_is_refused(tmp_path):
    run = _quantized_run(tmp_path)
    weights = run / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(GptkilnError, match="truncated or corrupt"):
        load_model(run)


def test_a_corrupted_header_is_refused(tmp_path):
    run = _quantized_run(tmp_path)
    weights = run / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[8:16] = b"\xff" * 8  # inside the JSON header
    weights.write_bytes(bytes(data))
    with pytest.raises(GptkilnError, match="truncated or corrupt"):
        load_model(run)


@pytest.mark.parametrize(
    "bad, said",
    [
        (float("nan"), r"not finite \(NaN or infinity\): h\.1\.mlp\.c_fc\.scale"),
        (0.0, r"h\.1\.mlp\.c_fc\.scale holds values that are not finite and positive"),
    ],
)
def test_corrupted_scales_are_refused(tmp_path, bad, said):
    run = _quantized_run(tmp_path)
    sd = load_file(run / WEIGHTS_FILE)
    sd["h.1.mlp.c_fc.scale"][3] = bad
    save_file(sd, run / WEIGHTS_FILE)
    with pytest.raises(GptkilnError, match=said):
        load_model(run)


def test_float_weights_under_a_quantized_config_are_refused(tmp_path, float_run):
    run = _quantized_run(tmp_path, vocab_size=50257)  # the float run's shape
    (run / WEIGHTS_FILE).write_bytes((float_run / WEIGHTS_FILE).read_bytes())
    with pytest.raises(
        GptkilnError,
        match=r"records int8 weights: wrong dtype h\.0\.attn\.c_attn\.weight float32 "
        r"\(expected int8\)",
    ):
        load_model(run)


def test_int8_weights_under_a_float_config_are_refused(tmp_path, float_run):
    run = _quantized_run(tmp_path, vocab_size=50257)
    (float_run / WEIGHTS_FILE).write_bytes((run / WEIGHTS_FILE).read_bytes())
    with pytest.raises(GptkilnError, match=r"records no quantization: wrong dtype .* int8"):
        load_model(float_run)


def test_a_quantized_file_of_another_shape_is_refused(tmp_path):
    run = _quantized_run(tmp_path)
    cfg = json.loads((run / CONFIG_FILE).read_text())
    cfg["model"]["n_embd"] = 64
    (run / CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(GptkilnError, match="says n_embd 64, but the weights hold n_embd 32"):
        load_model(run)


def test_scales_of_the_wrong_length_are_refused(tmp_path):
    run = _quantized_run(tmp_path)
    sd = load_file(run / WEIGHTS_FILE)
    sd["h.1.mlp.c_fc.scale"] = sd["h.1.mlp.c_fc.scale"][:-1]
    save_file(sd, run / WEIGHTS_FILE)
    with pytest.raises(GptkilnError, match=r"wrong shape h\.1\.mlp\.c_fc\.scale \(127,\)"):
        load_model(run)


def test_expected_shapes_of_a_quantized_run_are_those_of_the_model_quantized():
    from gptkiln.loading import expected_shapes

    for tied, both in [(True, True), (False, True), (True, False)]:
        config = GPTConfig.from_name("tiny", vocab_size=61, tie_embeddings=tied)
        with torch.device("meta"):
            sd = quantize_model(GPT(config), embedding_and_head=both).state_dict()
        if tied:
            sd.pop("lm_head.weight")
            sd.pop("lm_head.scale", None)
        recorded = {"method": "int8", "scheme": "per-channel-symmetric", "embedding_and_head": both}
        assert expected_shapes(config, recorded) == {k: tuple(v.shape) for k, v in sd.items()}


@pytest.mark.parametrize(
    "recorded",
    [
        {"method": "int4", "scheme": "per-channel-symmetric", "embedding_and_head": True},
        {"method": "int8", "scheme": "per-group", "embedding_and_head": True},
        {"method": "int8", "scheme": "per-channel-symmetric"},
        "int8",
    ],
)
def test_an_unknown_recorded_quantization_is_refused(tmp_path, recorded):
    run = _quantized_run(tmp_path)
    cfg = json.loads((run / CONFIG_FILE).read_text())
    (run / CONFIG_FILE).write_text(json.dumps({**cfg, "quantization": recorded}))
    with pytest.raises(GptkilnError, match="records a quantization gptkiln does not read"):
        load_model(run)


def test_perplexity_quantized_on_load_is_close_to_fp32_and_not_equal(float_run, tmp_path):
    from gptkiln.api import perplexity_of_run

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    fp32 = perplexity_of_run(float_run, text, progress=False)
    int8 = perplexity_of_run(float_run, text, progress=False, quantize="int8")
    assert int8.tokens == fp32.tokens
    assert int8.loss != fp32.loss and int8.loss == pytest.approx(fp32.loss, rel=0.01)


def test_serve_quantize_int8_serves_the_quantized_model(float_run, monkeypatch, capsys):
    """`gptkiln serve RUN --quantize int8` (uvicorn.run caught, its app served on a test port)
    answers with the int8 model: its greedy text is what generate gives quantized."""
    import httpx
    import uvicorn
    from serving import ServerThread

    from gptkiln.api import generate_text
    from gptkiln.cli import main
    from gptkiln.config import SampleConfig

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: apps.append(app))
    monkeypatch.setattr("gptkiln.serve.check_can_listen", lambda host, port: None)
    assert main(["serve", str(float_run), "--quantize", "int8", "--max-batch", "2"]) == 0
    batcher = apps[0].state.batcher
    assert quantization_of(batcher.model)["method"] == "int8"
    with ServerThread(apps[0]) as url:
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": "float", "prompt": "Hello", "max_tokens": 6, "temperature": 0},
            timeout=60,
        )
    assert r.status_code == 200, r.text
    cfg = SampleConfig(max_new_tokens=6, temperature=0)
    int8 = generate_text(float_run, "Hello", cfg, quantize="int8")[len("Hello") :]
    assert r.json()["choices"][0]["text"] == int8


def test_serve_refuses_a_bad_quantize_value_before_it_listens(float_run, monkeypatch, capsys):
    import uvicorn

    from gptkiln.cli import main

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("it served"))
    monkeypatch.setattr("gptkiln.serve.check_can_listen", lambda host, port: None)
    assert main(["serve", str(float_run), "--quantize", "int4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "quantize 'int4'" in err[0] and "int8" in err[0]


def test_info_reads_a_quantized_run(float_run, tmp_path):
    """`gptkiln info` checks a quantized run's headers against its recorded quantization, counts
    the same parameters as the float run (scales are not parameters) and says int8."""
    from gptkiln.api import run_info
    from gptkiln.convert import quantize_run

    quantize_run(float_run, tmp_path / "q")
    fp32, int8 = run_info(float_run), run_info(tmp_path / "q")
    assert fp32.quantization is None and "int8 weights" not in fp32.summary()
    assert int8.quantization == {
        "method": "int8",
        "scheme": "per-channel-symmetric",
        "embedding_and_head": True,
    }
    assert int8.parameters == fp32.parameters
    assert "parameters, int8 weights (per-channel-symmetric)" in int8.summary()
    assert int8.files["model.safetensors"] < fp32.files["model.safetensors"] / 3


def test_convert_quantize_float_head_keeps_the_head_and_embedding_fp32(float_run, tmp_path):
    """`gptkiln convert quantize --float-head`: the blocks' linear layers int8, the (tied) head
    and token embedding fp32, recorded in config.json, and loaded back as that model."""
    from gptkiln.api import run_info
    from gptkiln.cli import main

    q = tmp_path / "q"
    assert main(["convert", "quantize", str(float_run), "--out", str(q), "--float-head"]) == 0
    recorded = json.loads((q / CONFIG_FILE).read_text())["quantization"]
    assert recorded["embedding_and_head"] is False
    loaded = load_model(q)
    assert type(loaded.lm_head) is Linear and loaded.lm_head.weight.dtype == torch.float32
    assert type(loaded.wte) is torch.nn.Embedding
    assert all(isinstance(b.mlp.c_fc, Int8Linear) for b in loaded.h)
    expected = quantize_model(load_model(float_run), embedding_and_head=False)
    idx = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx), expected(idx), rtol=0, atol=0)
    assert ", the head and embedding float" in run_info(q).summary()


def test_a_copy_written_over_a_run_either_replaces_it_whole_or_leaves_it(
    float_run, tmp_path, monkeypatch
):
    """`quantize --overwrite` (as `convert`, `merge-lora`, `download`) writes the new run aside
    and moves it in whole: a write that fails leaves the old run byte for byte, and one that
    lands leaves no file of the old run's tokenizer beside the new one's."""
    import gptkiln.checkpoint as checkpoint_module
    from gptkiln.convert import quantize_run
    from gptkiln.tokenizers import CHAR_VOCAB_FILE, CharTokenizer

    old = tmp_path / "old"
    chars = CharTokenizer([chr(c) for c in range(65, 104)], with_eot=True)
    save_model(tiny_model(vocab_size=40), old, tokenizer=chars)
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    assert CHAR_VOCAB_FILE in before
    write_json = checkpoint_module.write_json

    def full_disk(path, obj):
        if Path(path).name == CONFIG_FILE:
            raise OSError(28, "No space left on device", str(path))
        write_json(path, obj)

    monkeypatch.setattr(checkpoint_module, "write_json", full_disk)
    with pytest.raises(OSError, match="No space"):
        quantize_run(float_run, old, overwrite=True)
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    monkeypatch.setattr(checkpoint_module, "write_json", write_json)
    quantize_run(float_run, old, overwrite=True)
    assert sorted(p.name for p in old.iterdir()) == sorted(p.name for p in float_run.iterdir())
    assert type(load_run(old)[1]).__name__ == "GPT2Tokenizer"


def test_a_copy_into_a_folder_that_holds_no_model_keeps_its_files(float_run, tmp_path):
    """Only a run being replaced loses its tokenizer's files: a folder of prepared data (its
    tokenizer.json) or of the user's own files keeps them."""
    from gptkiln.convert import quantize_run

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    (folder / "generation_config.json").write_text("{}")
    quantize_run(float_run, folder)
    assert (folder / "tokenizer.json").read_text() == "{}"
    assert (folder / "generation_config.json").read_text() == "{}"


def test_a_copy_over_a_run_on_another_filesystem_is_renamed_in_never_copied(
    float_run, tmp_path, monkeypatch
):
    """--out a link to (or a mount of) another disk: the run is staged on that disk, so each
    file moves in by a rename; a copy cut short by a full disk would ruin the file it replaces."""
    import os
    import shutil
    import tempfile

    from gptkiln.convert import quantize_run

    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem (/dev/shm) beside the test's folder")
    target = Path(tempfile.mkdtemp(dir=shm))
    try:
        quantize_run(float_run, target / "run")
        (tmp_path / "link").symlink_to(target / "run")
        renames = []
        real = os.replace

        def replace(src, dst):  # within the run's own folder: no mount between
            src, dst = Path(src), Path(dst)
            renames.append(dst.parent in (src.parent, src.parent.parent))
            renames.append(dst.resolve().is_relative_to(target.resolve()))
            real(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(shutil, "move", lambda *a: pytest.fail("copied across disks"))
        quantize_run(float_run, tmp_path / "link", overwrite=True)
        assert renames and all(renames)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["float", "link"]  # no stage here
        load_run(tmp_path / "link")
    finally:
        shutil.rmtree(target)
