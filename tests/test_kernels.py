"""Few-row decoding kernels: each equals F.linear, the spec table says what each rounds, and the
tuner picks the fastest correct one among the kernels of the decode precision."""

import time

import pytest
import torch
import torch.nn.functional as F

from gptkiln.config import GPTConfig, SampleConfig
from gptkiln.cpu import planned, prepare_for_decoding, products, specs, tuner
from gptkiln.model import GPT, Linear
from gptkiln.sampling import decoding, generate, generate_stream


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    """Every test tunes from scratch (the process-wide choices would carry over), timing every
    row count (no default per feature set: `test_one_row_takes_its_default_without_timing`)."""
    monkeypatch.setattr(tuner, "_CHOSEN", {})
    monkeypatch.setattr(tuner, "DEFAULTS", {})


@pytest.mark.parametrize("features", ["avx512", "generic"])
def test_one_row_takes_its_default_without_timing(features, monkeypatch):
    """A first use decodes at once: one row at an exact precision takes the feature set's
    default (the library's loop on AVX-512) without timing a candidate; elsewhere it times."""
    monkeypatch.setattr(tuner, "DEFAULTS", {("avx512", "float32"): "mine"})
    monkeypatch.setattr(tuner, "features", lambda: features)
    offering(monkeypatch, float32={"linear": F.linear, "mine": products.weight_rows})
    timed = []
    monkeypatch.setattr(tuner, "_fastest", lambda found, *a: timed.append(1) or "linear")
    model = tiny_model()
    picked = tuner.tune_decoding(model, rows=1, one_call=False)
    assert set(picked.values()) == ({"mine"} if features == "avx512" else {"linear"})
    assert bool(timed) == (features != "avx512")
    timed.clear()
    tuner.tune_decoding(model, rows=2, one_call=False)  # more rows: timed as before
    assert timed
    monkeypatch.setattr(tuner, "_CHOSEN", {})
    offering(
        monkeypatch, float32={"linear": F.linear, "mine": lambda x, w, b: F.linear(x, w, b) + 1}
    )
    assert set(tuner.tune_decoding(tiny_model(), rows=1, one_call=False).values()) == {"linear"}


def test_the_feature_set_is_the_librarys():
    from gptkiln.cpu.library import library

    lib = library()
    expected = "none" if lib is None else ("avx512" if lib.gk_avx512() else "generic")
    assert tuner.features() == expected


def offering(monkeypatch, float32=None, int8=None):
    """The tuner offered these kernels (name -> kernel) for each weight kind instead."""
    real = specs.offered

    def offered(weight, precision):
        found = {"float32": float32, "int8": int8}[weight]
        return real(weight, precision) if found is None else found

    monkeypatch.setattr(specs, "offered", offered)


@pytest.mark.parametrize("name", sorted(specs.offered("float32", "fp32")))
@pytest.mark.parametrize("n_out", [96, 97])  # divisible by the blocks; odd, as GPT-2's 50257
@pytest.mark.parametrize("rows", [1, 5])
def test_every_kernel_is_f_linear(name, n_out, rows):
    torch.manual_seed(0)
    kernel = specs.offered("float32", "fp32")[name]
    w, b, x = torch.randn(n_out, 32), torch.randn(n_out), torch.randn(rows, 1, 32)
    for bias in (b, None):
        got = kernel(x, w, bias)
        assert got.shape == (rows, 1, n_out)
        # laid out as F.linear's: SDPA on heads cut from a strided q/k/v leaves its fused path
        assert got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, w, bias))


@pytest.mark.parametrize("blocks", [2, 3, 4, 8])
@pytest.mark.parametrize("n_out", [50, 3])  # 3 < blocks: nothing to cut, F.linear
def test_row_blocks_cover_every_output_once(blocks, n_out):
    torch.manual_seed(0)
    w, b, x = torch.randn(n_out, 16), torch.randn(n_out), torch.randn(3, 16)
    for kernel in (products.weight_rows, products.input_rows):
        torch.testing.assert_close(kernel(x, w, b, blocks), F.linear(x, w, b))


def slow(seconds: float, wrong: bool = False, fails: bool = False):
    """A kernel that takes ``seconds`` per call; ``wrong`` adds 1 to the result."""

    def kernel(x, w, b):
        if fails:
            raise RuntimeError("not on this CPU")
        time.sleep(seconds)
        return F.linear(x, w, b) + (1.0 if wrong else 0.0)

    return kernel


def test_the_fastest_correct_kernel_wins():
    layers = [Linear(8, 12) for _ in range(3)]
    found = {
        "linear": slow(0.004),
        "fast_but_wrong": slow(0.0, wrong=True),
        "cannot_run": slow(0.0, fails=True),
        "medium": slow(0.002),
        "fastest": slow(0.001),
    }
    assert tuner._fastest(found, layers, rows=2, repeats=2) == "fastest"
    del found["fastest"]
    assert tuner._fastest(found, layers, rows=2, repeats=2) == "medium"


def test_a_compiled_kernel_must_win_clearly():
    """`fused` (inductor) costs every process that uses it seconds of compiling (a 2-token
    `generate` of an int8 run: 7.3 s against 1.8 s for 1 token): it must take at most
    `INDUCTOR_MARGIN` of the fastest other kernel's time."""
    layers = [Linear(8, 12) for _ in range(2)]
    assert specs.BY_NAME["fused"].inductor
    close = {"linear": slow(0.02), "fused": slow(0.009), "onednn": slow(0.010)}
    assert tuner._fastest(close, layers, rows=1, repeats=2) == "onednn"  # 10%: not clear
    clearly = {"linear": slow(0.02), "fused": slow(0.004), "onednn": slow(0.010)}
    assert tuner._fastest(clearly, layers, rows=1, repeats=2) == "fused"


def test_f_linear_keeps_a_near_tie():
    layers = [Linear(8, 12)]
    found = {"linear": slow(0.010), "barely_faster": slow(0.0099)}  # 1% faster: noise
    assert tuner._fastest(found, layers, rows=1, repeats=2) == "linear"


def tiny_model(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("tiny", vocab_size=61, context_length=32, **kw)).eval()


def test_tuning_hands_every_linear_its_kernel_once_per_shape_and_rows(monkeypatch):
    model = tiny_model()
    timed = []
    offering(monkeypatch, float32={"linear": F.linear, "mine": slow(0.0)})

    def fastest(found, layers, rows, repeats, clock):
        timed.append((tuple(layers[0].weight.shape), rows, len(layers)))
        return "mine"

    monkeypatch.setattr(tuner, "_fastest", fastest)
    chosen = tuner.tune_decoding(model, rows=3)
    n_layer, c = model.config.n_layer, model.config.n_embd
    assert chosen == {
        (3 * c, c): "mine",
        (c, c): "mine",
        (4 * c, c): "mine",
        (c, 4 * c): "mine",
        (61, c): "mine",
    }
    # one timing per shape, over all the layers of that shape
    assert sorted(timed) == sorted(
        [
            ((3 * c, c), 3, n_layer),
            ((c, c), 3, n_layer),
            ((4 * c, c), 3, n_layer),
            ((c, 4 * c), 3, n_layer),
            ((61, c), 3, 1),
        ]
    )
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(set(planned.few_row_kernels(m)) == {3} for m in linears)
    tuner.tune_decoding(model, rows=3)  # tuned already in this process: nothing timed
    assert len(timed) == 5
    tuner.tune_decoding(model, rows=products.FEW_ROWS + 1)  # too many rows: not tuned
    assert len(timed) == 5 and all(set(planned.few_row_kernels(m)) == {3} for m in linears)
    threads = torch.get_num_threads()
    assert tuner.chosen() == {(*shape, 3, threads, "float32"): "mine" for shape in chosen}


def test_a_tuned_linear_uses_its_kernel_only_for_those_rows_and_without_autograd():
    layer = Linear(8, 12)
    calls = []

    def counted(x, w, b):
        calls.append(x.shape)
        return F.linear(x, w, b)

    planned.give_kernel(layer, 2, counted)
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        layer(torch.randn(1, 2, 8))  # 2 rows in another shape: the same product
        layer(torch.randn(3, 8))  # 3 rows: not tuned
    assert calls == [(2, 8), (1, 2, 8)]
    layer(x).sum().backward()  # autograd: always F.linear
    assert len(calls) == 2 and layer.weight.grad is not None


def test_only_cpu_fp32_plain_weights_are_tuned():
    model = tiny_model().to(torch.bfloat16)
    assert tuner.tune_decoding(model, rows=1) == {}


def force(monkeypatch, name: str) -> None:
    """Make the tuner choose ``name`` wherever it is offered (the first candidate elsewhere)."""

    def fastest(found, *args):
        return name if name in found else next(iter(found))

    monkeypatch.setattr(tuner, "_fastest", fastest)
    monkeypatch.setattr(tuner, "_time_step", lambda *a: "layers")  # nor the one-call step


@pytest.mark.parametrize("batch", [1, 3])
def test_generation_tunes_and_gives_the_untuned_tokens(batch, monkeypatch, tmp_path):
    model = tiny_model()
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8]][:batch]
    cfg = SampleConfig(max_new_tokens=20, temperature=0)
    # every candidate in turn, forced: the same greedy tokens as plain F.linear
    reference = None  # "linear" comes first: F.linear itself
    for name in specs.offered("float32", "fp32"):
        monkeypatch.setattr(tuner, "_CHOSEN", {})
        monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path / name))  # nor the last one's, on disk
        force(monkeypatch, name)
        tokens = generate(model, prompts, cfg, prepare=prepare_for_decoding)
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert all(planned.few_row_kernels(m)[batch] is not None for m in linears)
        assert set(tuner.chosen().values()) == {name}
        reference = reference or tokens
        assert tokens == reference, name
    monkeypatch.setattr(tuner, "_CHOSEN", {})
    monkeypatch.setattr(tuner, "_fastest", lambda *a: pytest.fail("timed"))
    one = list(
        generate_stream(
            model,
            prompts,
            SampleConfig(max_new_tokens=1, temperature=0),
            prepare=prepare_for_decoding,
        )
    )
    assert len(one) == 1 and tuner._CHOSEN == {}  # one token: no decode step, nothing tuned


def test_tuning_leaves_the_global_random_state_alone():
    model = tiny_model()
    state = torch.get_rng_state()
    tuner.tune_decoding(model, rows=2)
    assert tuner.chosen() and torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("name", sorted(specs.offered("float32", "fp32")))
def test_a_tuned_model_can_still_be_sent_to_another_process(name, monkeypatch):
    import pickle  # what multiprocessing does with a module handed to a spawned worker

    model = tiny_model()
    force(monkeypatch, name)
    prepare = prepare_for_decoding
    generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=3, temperature=0, prepare=prepare)
    again = pickle.loads(pickle.dumps(model))
    x = torch.randn(2, model.config.n_embd)
    with torch.no_grad():
        torch.testing.assert_close(again.lm_head(x), model.lm_head(x))


# -- the int8 family -------------------------------------------------------------------------
def int8_layer(n_out: int, n_in: int, bias: bool = True, seed: int = 0):
    from gptkiln.quantize import Int8Linear

    torch.manual_seed(seed)
    return Int8Linear.from_float(torch.nn.Linear(n_in, n_out, bias=bias))


EXACT_INT8 = sorted(specs.offered("int8", "exact"))


@pytest.mark.parametrize("name", EXACT_INT8)
@pytest.mark.parametrize("rows, bias", [(1, True), (3, False)])  # each a compile for "fused"
def test_every_int8_kernel_is_the_dequantized_product(name, rows, bias):
    kernel = specs.offered("int8", "exact")[name]
    layer = int8_layer(97, 32, bias)  # 97: odd, as GPT-2's 50257
    x = torch.randn(rows, 1, 32)
    w = layer.weight.float() * layer.scale[:, None]
    got = kernel(x, layer.weight, layer.scale, layer.bias)
    assert got.shape == (rows, 1, 97) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, layer.bias))


def test_the_fused_int8_kernel_refuses_more_rows_than_it_keeps_accumulators_for():
    layer = int8_layer(8, 16)
    x = torch.randn(products.FUSED_INT8_MAX_ROWS + 1, 16)
    with pytest.raises(RuntimeError, match="at most"):
        products.fused_int8(x, layer.weight, layer.scale, layer.bias)


def test_int8_layers_are_tuned_among_int8_kernels_only(monkeypatch):
    from gptkiln.quantize import quantize_model

    model = quantize_model(tiny_model())
    fast_but_wrong = lambda x, q, s, b: products.dequantize_linear(x, q, s, b) + 1.0  # noqa: E731
    found = {
        "dequantize": lambda *a: (time.sleep(0.004), products.dequantize_linear(*a))[1],
        "fast_but_wrong": fast_but_wrong,
        "cannot_run": lambda x, q, s, b: slow(0.0, fails=True)(x, q, b),
        "fast": lambda *a: (time.sleep(0.001), products.dequantize_linear(*a))[1],
    }
    monkeypatch.setattr(
        specs,
        "offered",
        lambda weight, precision: (
            found if weight == "int8" else pytest.fail("a float kernel was offered")
        ),
    )
    picked = tuner.tune_decoding(model, rows=2)
    assert set(picked.values()) == {"fast"} and len(picked) == 5
    assert all(key[4] == "int8" for key in tuner.chosen())
    assert planned.few_row_kernels(model.h[0].mlp.c_fc)[2] is found["fast"]
    assert planned.few_row_kernels(model.lm_head)[2] is found["fast"]


def test_quantized_generation_gives_the_same_tokens_with_every_int8_kernel(monkeypatch, tmp_path):
    from gptkiln.quantize import Int8Linear, quantize_model

    model = quantize_model(tiny_model())
    batch, prompts = 2, [[1, 2, 3, 4], [5, 6, 7]]  # "fused" compiles for 2 rows, 5 shapes
    cfg = SampleConfig(max_new_tokens=12, temperature=0)
    reference = None  # "dequantize" comes first: the reference product
    for name in EXACT_INT8:
        monkeypatch.setattr(tuner, "_CHOSEN", {})
        monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path / name))  # nor the last one's, on disk
        force(monkeypatch, name)
        tokens = generate(model, prompts, cfg, prepare=prepare_for_decoding)
        int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
        assert all(planned.few_row_kernels(m)[batch] is specs.BY_NAME[name].kernel for m in int8)
        reference = reference or tokens
        assert tokens == reference, name


def test_a_tuned_quantized_model_can_still_be_sent_to_another_process(monkeypatch):
    import pickle

    from gptkiln.quantize import quantize_model

    model = quantize_model(tiny_model())
    monkeypatch.setattr(tuner, "_fastest", lambda *a: "fused")
    prepare = prepare_for_decoding
    generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=3, temperature=0, prepare=prepare)
    again = pickle.loads(pickle.dumps(model))
    x = torch.randn(2, model.config.n_embd)
    with torch.no_grad():
        torch.testing.assert_close(again.lm_head(x), model.lm_head(x))


# -- int8 activations (the dynamic quantized linear) -------------------------------------------
def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


@pytest.mark.parametrize("n_out, n_in, rows, bias", [(97, 64, 1, True), (768, 3072, 3, False)])
def test_the_dynamic_int8_kernel_is_the_dequantized_product_within_its_tolerance(
    n_out, n_in, rows, bias
):
    layer = int8_layer(n_out, n_in, bias)
    x = torch.randn(rows, 1, n_in)
    expected = products.dequantize_linear(x, layer.weight, layer.scale, layer.bias)
    got = products.dynamic_int8(x, layer.weight, layer.scale, layer.bias)
    assert got.shape == (rows, 1, n_out)
    # 7-bit activations: 1-2% of the norm, within the tolerance; not float rounding.
    assert 1e-4 < relative_error(got, expected) < tuner.ACTIVATION_TOLERANCE


def test_the_dynamic_int8_kernel_quantizes_each_row_on_its_own_grid():
    layer = int8_layer(64, 128)
    big, small = torch.randn(1, 128) * 100, torch.randn(1, 128) * 0.01
    together = products.dynamic_int8(torch.cat([big, small]), layer.weight, layer.scale, None)
    expected = products.dequantize_linear(small, layer.weight, layer.scale, None)
    # On the big row's grid (steps of ~2), the small row would round to zeros: 100% error.
    assert relative_error(together[1:], expected) < tuner.ACTIVATION_TOLERANCE


def test_the_dynamic_int8_kernel_packs_once_and_again_when_the_weight_changes():
    layer = int8_layer(16, 32)
    x = torch.randn(2, 32)
    first = products.dynamic_int8(x, layer.weight, layer.scale, layer.bias)
    packed = products._packed(layer.weight, layer.scale, layer.bias)
    assert products._packed(layer.weight, layer.scale, layer.bias) is packed  # kept
    with torch.no_grad():
        layer.weight.neg_()  # in place: the packed copy is stale
    again = products.dynamic_int8(x, layer.weight, layer.scale, layer.bias)
    assert products._packed(layer.weight, layer.scale, layer.bias) is not packed
    torch.testing.assert_close(again - layer.bias, -(first - layer.bias), rtol=0.05, atol=0.05)


def test_a_kernel_quantizing_activations_is_held_to_its_tolerance_and_no_other_is():
    expected = torch.randn(4, 50)
    near = expected + 0.01 * expected.norm() / 50**0.5 * torch.randn(4, 50) / 2  # ~0.5%
    assert tuner._agrees("dynamic", near, expected)
    assert not tuner._agrees("fused", near, expected)  # an exact kernel: rounding only
    far = expected + 0.1 * torch.randn(4, 50) * expected.std()
    assert not tuner._agrees("dynamic", far, expected)
    assert not tuner._agrees("dynamic", expected * float("nan"), expected)


# -- bf16 products for fp32 weights ------------------------------------------------------------
def test_the_bf16_kernel_is_f_linear_within_its_tolerance_and_keeps_one_copy():
    w, b = torch.randn(97, 64), torch.randn(97)
    x = torch.randn(3, 1, 64)
    got = products.bf16_linear(x, w, b)
    expected = F.linear(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (3, 1, 97)
    # bf16's 8-bit mantissa: ~0.3% of the norm; more than float rounding, within the tolerance
    assert 1e-4 < relative_error(got, expected) < tuner.ACTIVATION_TOLERANCE
    copy = products._BF16[id(w)][2]
    assert copy.dtype == torch.bfloat16
    products.bf16_linear(x, w, None)
    assert products._BF16[id(w)][2] is copy  # made once
    w.neg_()  # in place: the copy is stale
    assert relative_error(products.bf16_linear(x, w, None), F.linear(x, w)) < 0.01
    assert products._BF16[id(w)][2] is not copy


@pytest.mark.skipif(
    __import__("gptkiln.cpu.library").cpu.library.library() is None,
    reason="no C compiler: no one-call step to choose",
)
def test_the_tuner_times_a_whole_step_where_the_products_chose_other_kernels(monkeypatch, tmp_path):
    """Where the products alone were timed fastest with another kernel, the one-call step
    (which needs the loops) may still win: a whole step is timed both ways, once per machine."""
    import gptkiln.sampling as sampling

    greedy = SampleConfig(max_new_tokens=6, temperature=0, stop_at_eos=False)
    reference = sampling.generate(tiny_model(), [[1, 2, 3]], greedy)  # untuned: no backend
    model = tiny_model()
    monkeypatch.setattr(tuner, "_fastest", lambda found, *a: next(iter(found)))  # F.linear
    timed = []
    monkeypatch.setattr(tuner, "_time_step", lambda *a: timed.append(1) or "layers")
    prepare = prepare_for_decoding
    assert generate(model, [[1, 2, 3]], greedy, prepare=prepare) == reference
    assert timed and (getattr(model, "decode_blocks", None) is None or not model.decode_blocks.rows)
    assert planned.few_row_kernels(model.h[0].mlp.c_fc)[1] is F.linear

    model = tiny_model()
    monkeypatch.setattr(tuner, "_CHOSEN", {})
    monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path / "another-machine"))
    real = tuner._time_step
    monkeypatch.setattr(tuner, "_time_step", lambda *a: real(*a) and "native")
    assert generate(model, [[1, 2, 3]], greedy, prepare=prepare) == reference
    assert model.decode_blocks.rows == {1}
    blocks = [m for b in model.h for m in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj)]
    assert all(planned.few_row_kernels(m)[1] is products.few_rows_linear for m in blocks)
    assert planned.few_row_kernels(model.lm_head)[1] is F.linear  # the head keeps its own choice

    model = tiny_model()
    monkeypatch.setattr(tuner, "_CHOSEN", {})  # another process: the choice from the disk
    monkeypatch.setattr(tuner, "_time_step", lambda *a: pytest.fail("timed again"))
    assert generate(model, [[1, 2, 3]], greedy, prepare=prepare) == reference
    assert model.decode_blocks.rows == {1}


def test_a_server_tuning_rows_at_their_own_positions_times_no_whole_step(monkeypatch):
    model = tiny_model()
    model.setup_cache(1, 16)
    monkeypatch.setattr(tuner, "_fastest", lambda found, *a: next(iter(found)))  # F.linear
    monkeypatch.setattr(tuner, "_time_step", lambda *a: pytest.fail("timed a whole step"))
    tuner.tune_decoding(model, rows=1, one_call=False)
    assert planned.few_row_kernels(model.h[0].mlp.c_fc)[1] is F.linear  # the products' own choice


# -- the spec table and the decode precisions --------------------------------------------------
def test_the_spec_table_says_what_each_kernel_rounds_copies_compiles_and_runs_in_one_call():
    assert specs.inexact() == {"bf16_rows", "q8_rows", "dynamic", "bf16"}
    assert set(tuner.COPIES) == {s.name for s in specs.SPECS if s.copies}
    assert {s.name for s in specs.SPECS if s.inductor} == {"fused"}
    loops = {s.name: s.loop for s in specs.SPECS if s.loop is not None}
    assert loops == {"few_rows": 0, "int8_rows": 1, "q8_rows": 2, "bf16_rows": 3}
    assert len(specs.BY_NAME) == len(specs.SPECS)  # one name, one kernel


@pytest.mark.parametrize("weight, precision", [("float32", "fp32"), ("int8", "exact")])
def test_the_tuner_times_only_exact_kernels_at_fp32_and_for_exact_int8(weight, precision):
    found = specs.offered(weight, precision)
    assert next(iter(found)) == specs.REFERENCE[weight]
    assert all(specs.BY_NAME[name].exact for name in found)


def test_a_precision_chooses_its_kernels_and_the_exact_setting_keeps_the_weights_own(monkeypatch):
    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")  # conftest's: the suite decodes exactly
    assert "bf16_rows" not in specs.offered("float32", "fp32")  # fp32 never rounds the weights
    for precision in specs.PRECISIONS:  # and no precision a person chooses offers these two
        for weight in ("float32", "int8"):
            assert not {"dynamic", "bf16"} & set(specs.offered(weight, precision))
    if specs.available(specs.BY_NAME["bf16_rows"]):
        assert list(specs.offered("float32", "bf16")) == ["linear", "bf16_rows"]
    with specs.exact_kernels():
        assert specs.precision_for("float32", "bf16") == "fp32"
        assert specs.precision_for("int8", "int8") == "exact"


def test_a_precision_of_its_own_takes_its_kernel_without_a_timing_race(monkeypatch):
    """bf16 and q8_0 round on purpose: the tuner takes the precision's kernel wherever it agrees
    with the reference within its tolerance, and times nothing, so two machines (or two first
    runs) decode the same tokens."""
    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")
    model = tiny_model()
    monkeypatch.setattr(tuner, "_fastest", lambda *a: pytest.fail("timed"))
    rounded = lambda x, w, b: F.linear(x, w.to(torch.bfloat16).float(), b)  # noqa: E731
    offering(monkeypatch, float32={"linear": F.linear, "bf16_rows": rounded})
    picked = tuner.tune_decoding(model, rows=1, precision="bf16")
    assert set(picked.values()) == {"bf16_rows"}
    wrong = lambda x, w, b: F.linear(x, w, b) * 2  # noqa: E731
    monkeypatch.setattr(tuner, "_CHOSEN", {})
    offering(monkeypatch, float32={"linear": F.linear, "bf16_rows": wrong})
    assert set(tuner.tune_decoding(model, rows=2, precision="bf16").values()) == {"linear"}
    # that fallback was this model's: the next model of the same shapes (in this process or
    # another) has its own weights checked again and takes the kernel: nothing of it was kept
    offering(monkeypatch, float32={"linear": F.linear, "bf16_rows": rounded})
    assert set(tuner.tune_decoding(model, rows=2, precision="bf16").values()) == {"bf16_rows"}
    from gptkiln.cache import decode_kernel_choices

    products = [k for k in decode_kernel_choices().entries() if k.startswith("float32 ")]
    assert not [k for k in products if "bf16_rows" in k]


def test_the_tuner_reads_the_clock_it_is_given(monkeypatch, tmp_path):
    model = tiny_model()
    clock = [0.0]  # a clock the kernels advance: the choice hangs on no real timing

    def taking(seconds):
        def kernel(x, w, b):
            clock[0] += seconds
            return F.linear(x, w, b)

        return kernel

    offering(monkeypatch, float32={"linear": taking(1.0), "quick": taking(0.5)})
    picked = tuner.tune_decoding(model, rows=1, clock=lambda: clock[0])
    assert set(picked.values()) == {"quick"}
    monkeypatch.setattr(tuner, "_CHOSEN", {})
    monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path / "elsewhere"))
    offering(monkeypatch, float32={"linear": taking(1.0), "quick": taking(0.99)})  # a near tie
    picked = tuner.tune_decoding(model, rows=1, clock=lambda: clock[0])
    assert set(picked.values()) == {"linear"}


def test_a_plan_drops_what_rounds_and_gives_the_model_back(monkeypatch):
    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")
    if not specs.available(specs.BY_NAME["bf16_rows"]):
        pytest.skip("no C compiler: no bf16 loop to give")
    model = tiny_model()
    plan = prepare_for_decoding(model, 1, precision="bf16")
    assert plan.precision == "bf16" and set(plan.kernels[1].values()) == {"bf16_rows"}
    assert "bf16 decode" in plan.describe()
    with torch.no_grad(), decoding():  # a decode step of one row (a rounding kernel runs in
        model(torch.zeros(1, 1, dtype=torch.long))  # a decoding only): the layers' bf16 copies
    # (made at first use: where this process had chosen the shape before, preparing read none)
    assert products._BF16_ROWS  # its copies, held while the plan has them
    plan.drop_inexact()
    assert plan.kernels[1] == {}
    assert not any(
        id(m.weight) in products._BF16_ROWS for m in model.modules() if isinstance(m, Linear)
    )
    plan.release()
    assert all(not getattr(m, "few_row_kernels", None) for m in model.modules())
    with pytest.raises(ValueError, match="precision"):
        prepare_for_decoding(model, 1, precision="fp16")


def test_a_rounding_precision_takes_one_kernel_at_every_row_count(monkeypatch):
    """bf16 and q8_0 round on purpose: whether a layer takes the precision's kernel is checked
    on the same rows whatever the batch, so a seeded sample alone and in a batch of two run the
    same arithmetic (one row's error alone was noise: it took q8_0 at two rows, not at one)."""
    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")
    model = tiny_model()

    def rounded(x, w, b):  # near the reference on many rows, too far on one alone
        y = F.linear(x, w.to(torch.bfloat16).float(), b)
        return y * 1.5 if x.reshape(-1, x.size(-1)).size(0) == 1 else y

    offering(monkeypatch, float32={"linear": F.linear, "bf16_rows": rounded})
    one = tuner.tune_decoding(model, rows=1, precision="bf16", one_call=False)
    two = tuner.tune_decoding(model, rows=2, precision="bf16", one_call=False)
    assert set(one.values()) == set(two.values()) == {"bf16_rows"}
