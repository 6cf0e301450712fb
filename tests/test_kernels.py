"""Few-row decoding kernels: each equals F.linear, and the tuner picks the fastest correct one."""

import time
import weakref

import pytest
import torch
import torch.nn.functional as F

import gptkiln.kernels as kernels
from gptkiln.config import GPTConfig, SampleConfig
from gptkiln.model import GPT, Linear
from gptkiln.sampling import generate, generate_stream


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    """Every test tunes from scratch (the process-wide choices would carry over)."""
    monkeypatch.setattr(kernels, "_CHOSEN", {})


@pytest.mark.parametrize("name", sorted(kernels.candidates()))
@pytest.mark.parametrize("n_out", [96, 97])  # divisible by the blocks; odd, as GPT-2's 50257
@pytest.mark.parametrize("rows", [1, 5])
def test_every_kernel_is_f_linear(name, n_out, rows):
    torch.manual_seed(0)
    kernel = kernels.candidates()[name]
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
    for kernel in (kernels.weight_rows, kernels.input_rows):
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
    assert kernels._fastest(found, layers, rows=2, repeats=2) == "fastest"
    del found["fastest"]
    assert kernels._fastest(found, layers, rows=2, repeats=2) == "medium"


def test_a_kernel_quantizing_activations_must_win_clearly_except_against_a_compiled_one():
    """`dynamic` (int8 activations) needs `QUANTIZING_MARGIN` against an exact kernel, and
    `fused` needs it against `dynamic`: it costs every process that uses it seconds of inductor
    (a 2-token `generate` of an int8 run: 7.3 s against 1.8 s for 1 token)."""
    layers = [Linear(8, 12) for _ in range(2)]
    assert "fused" in kernels.COMPILED and "dynamic" in kernels.QUANTIZING_ACTIVATIONS
    exact = {"linear": slow(0.02), "onednn": slow(0.010), "dynamic": slow(0.009)}
    assert kernels._fastest(exact, layers, rows=1, repeats=2) == "onednn"  # 10%: not clear
    compiled = {"linear": slow(0.02), "fused": slow(0.009), "dynamic": slow(0.010)}
    assert kernels._fastest(compiled, layers, rows=1, repeats=2) == "dynamic"  # 10%: not clear
    clearly = {"linear": slow(0.02), "onednn": slow(0.010), "dynamic": slow(0.004)}
    assert kernels._fastest(clearly, layers, rows=1, repeats=2) == "dynamic"
    slower = {"linear": slow(0.02), "fused": slow(0.004), "dynamic": slow(0.010)}
    assert kernels._fastest(slower, layers, rows=1, repeats=2) == "fused"


def test_f_linear_keeps_a_near_tie():
    layers = [Linear(8, 12)]
    found = {"linear": slow(0.010), "barely_faster": slow(0.0099)}  # 1% faster: noise
    assert kernels._fastest(found, layers, rows=1, repeats=2) == "linear"


def tiny_model(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("tiny", vocab_size=61, context_length=32, **kw)).eval()


def test_tuning_hands_every_linear_its_kernel_once_per_shape_and_rows(monkeypatch):
    model = tiny_model()
    timed = []
    monkeypatch.setattr(kernels, "candidates", lambda: {"linear": F.linear, "mine": slow(0.0)})

    def fastest(found, layers, rows, repeats):
        timed.append((tuple(layers[0].weight.shape), rows, len(layers)))
        return "mine"

    monkeypatch.setattr(kernels, "_fastest", fastest)
    chosen = kernels.tune_decoding(model, rows=3)
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
    assert all(set(m.few_row_kernels) == {3} for m in linears)
    kernels.tune_decoding(model, rows=3)  # tuned already in this process: nothing timed
    assert len(timed) == 5
    kernels.tune_decoding(model, rows=kernels.FEW_ROWS + 1)  # too many rows: not tuned
    assert len(timed) == 5 and all(set(m.few_row_kernels) == {3} for m in linears)
    threads = torch.get_num_threads()
    assert kernels.chosen() == {(*shape, 3, threads, "float32"): "mine" for shape in chosen}


def test_a_tuned_linear_uses_its_kernel_only_for_those_rows_and_without_autograd():
    layer = Linear(8, 12)
    calls = []

    def counted(x, w, b):
        calls.append(x.shape)
        return F.linear(x, w, b)

    layer.few_row_kernels[2] = counted
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
    assert kernels.tune_decoding(model, rows=1) == {}


def force(monkeypatch, name: str) -> None:
    """Make the tuner choose ``name`` wherever it is offered (the first candidate elsewhere),
    and, if it copies the weights, take it whatever the number of steps."""

    def fastest(found, *args):
        return name if name in found else next(iter(found))

    def copies_pay(found, chosen, *args):
        return {
            "kernel": chosen,
            "without_copies": next(n for n in found if n not in kernels._QUANTIZING_KERNELS),
            "copy_seconds": 0.0,
            "step_seconds_saved": 1.0,
        }

    monkeypatch.setattr(kernels, "_fastest", fastest)
    monkeypatch.setattr(kernels, "_copy_costs", copies_pay)
    monkeypatch.setattr(kernels, "_time_step", lambda *a: "layers")  # nor the one-call step


@pytest.mark.parametrize("batch", [1, 3])
def test_generation_tunes_and_gives_the_untuned_tokens(batch, monkeypatch, tmp_path):
    model = tiny_model()
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8]][:batch]
    cfg = SampleConfig(max_new_tokens=20, temperature=0)
    # every candidate in turn, forced: the same greedy tokens as plain F.linear
    reference = None  # "linear" comes first: F.linear itself
    for name in kernels.candidates():
        monkeypatch.setattr(kernels, "_CHOSEN", {})
        monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path / name))  # nor the last one's, on disk
        force(monkeypatch, name)
        tokens = generate(model, prompts, cfg)
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert all(m.few_row_kernels[batch] is not None for m in linears)
        assert set(kernels.chosen().values()) == {name}
        reference = reference or tokens
        assert tokens == reference, name
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    monkeypatch.setattr(kernels, "_fastest", lambda *a: pytest.fail("timed"))
    one = list(generate_stream(model, prompts, SampleConfig(max_new_tokens=1, temperature=0)))
    assert len(one) == 1 and kernels._CHOSEN == {}  # one token: no decode step, nothing tuned


def test_tuning_leaves_the_global_random_state_alone():
    model = tiny_model()
    state = torch.get_rng_state()
    kernels.tune_decoding(model, rows=2)
    assert kernels.chosen() and torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("name", sorted(kernels.candidates()))
def test_a_tuned_model_can_still_be_sent_to_another_process(name, monkeypatch):
    import pickle  # what multiprocessing does with a module handed to a spawned worker

    model = tiny_model()
    force(monkeypatch, name)
    generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=3, temperature=0)  # 2 rows, as above
    again = pickle.loads(pickle.dumps(model))
    x = torch.randn(2, model.config.n_embd)
    with torch.no_grad():
        torch.testing.assert_close(again.lm_head(x), model.lm_head(x))


# -- the int8 family -------------------------------------------------------------------------
def int8_layer(n_out: int, n_in: int, bias: bool = True, seed: int = 0):
    from gptkiln.quantize import Int8Linear

    torch.manual_seed(seed)
    return Int8Linear.from_float(torch.nn.Linear(n_in, n_out, bias=bias))


EXACT_INT8 = sorted(set(kernels.int8_candidates()) - kernels.QUANTIZING_ACTIVATIONS)


@pytest.mark.parametrize("name", EXACT_INT8)
@pytest.mark.parametrize("rows, bias", [(1, True), (3, False)])  # each a compile for "fused"
def test_every_int8_kernel_is_the_dequantized_product(name, rows, bias):
    kernel = kernels.int8_candidates()[name]
    layer = int8_layer(97, 32, bias)  # 97: odd, as GPT-2's 50257
    x = torch.randn(rows, 1, 32)
    w = layer.weight.float() * layer.scale[:, None]
    got = kernel(x, layer.weight, layer.scale, layer.bias)
    assert got.shape == (rows, 1, 97) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, layer.bias))


def test_the_fused_int8_kernel_refuses_more_rows_than_it_keeps_accumulators_for():
    layer = int8_layer(8, 16)
    x = torch.randn(kernels.FUSED_INT8_MAX_ROWS + 1, 16)
    with pytest.raises(RuntimeError, match="at most"):
        kernels.fused_int8(x, layer.weight, layer.scale, layer.bias)


def test_int8_layers_are_tuned_among_int8_kernels_only(monkeypatch):
    from gptkiln.quantize import quantize_model

    model = quantize_model(tiny_model())
    fast_but_wrong = lambda x, q, s, b: kernels.dequantize_linear(x, q, s, b) + 1.0  # noqa: E731
    found = {
        "dequantize": lambda *a: (time.sleep(0.004), kernels.dequantize_linear(*a))[1],
        "fast_but_wrong": fast_but_wrong,
        "cannot_run": lambda x, q, s, b: slow(0.0, fails=True)(x, q, b),
        "fast": lambda *a: (time.sleep(0.001), kernels.dequantize_linear(*a))[1],
    }
    monkeypatch.setattr(kernels, "int8_candidates", lambda: found)
    monkeypatch.setattr(kernels, "candidates", lambda: pytest.fail("a float kernel was offered"))
    picked = kernels.tune_decoding(model, rows=2)
    assert set(picked.values()) == {"fast"} and len(picked) == 5
    assert all(key[4] == "int8" for key in kernels.chosen())
    assert model.h[0].mlp.c_fc.few_row_kernels[2] is found["fast"]
    assert model.lm_head.few_row_kernels[2] is found["fast"]


def test_quantized_generation_gives_the_same_tokens_with_every_int8_kernel(monkeypatch, tmp_path):
    from gptkiln.quantize import Int8Linear, quantize_model

    model = quantize_model(tiny_model())
    batch, prompts = 2, [[1, 2, 3, 4], [5, 6, 7]]  # "fused" compiles for 2 rows, 5 shapes
    cfg = SampleConfig(max_new_tokens=12, temperature=0)
    reference = None  # "dequantize" comes first: the reference product
    for name in [n for n in kernels.int8_candidates() if n in EXACT_INT8]:
        monkeypatch.setattr(kernels, "_CHOSEN", {})
        monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path / name))  # nor the last one's, on disk
        force(monkeypatch, name)
        tokens = generate(model, prompts, cfg)
        int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
        assert all(m.few_row_kernels[batch] is kernels.int8_candidates()[name] for m in int8)
        reference = reference or tokens
        assert tokens == reference, name


def test_a_tuned_quantized_model_can_still_be_sent_to_another_process(monkeypatch):
    import pickle

    from gptkiln.quantize import quantize_model

    model = quantize_model(tiny_model())
    monkeypatch.setattr(kernels, "_fastest", lambda *a: "fused")
    generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=3, temperature=0)  # 2 rows, as above
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
    expected = kernels.dequantize_linear(x, layer.weight, layer.scale, layer.bias)
    got = kernels.dynamic_int8(x, layer.weight, layer.scale, layer.bias)
    assert got.shape == (rows, 1, n_out)
    # 7-bit activations: 1-2% of the norm, within the tolerance; not float rounding.
    assert 1e-4 < relative_error(got, expected) < kernels.ACTIVATION_TOLERANCE


def test_the_dynamic_int8_kernel_quantizes_each_row_on_its_own_grid():
    layer = int8_layer(64, 128)
    big, small = torch.randn(1, 128) * 100, torch.randn(1, 128) * 0.01
    together = kernels.dynamic_int8(torch.cat([big, small]), layer.weight, layer.scale, None)
    expected = kernels.dequantize_linear(small, layer.weight, layer.scale, None)
    # On the big row's grid (steps of ~2), the small row would round to zeros: 100% error.
    assert relative_error(together[1:], expected) < kernels.ACTIVATION_TOLERANCE


def test_the_dynamic_int8_kernel_packs_once_and_again_when_the_weight_changes():
    layer = int8_layer(16, 32)
    x = torch.randn(2, 32)
    first = kernels.dynamic_int8(x, layer.weight, layer.scale, layer.bias)
    packed = kernels._packed(layer.weight, layer.scale, layer.bias)
    assert kernels._packed(layer.weight, layer.scale, layer.bias) is packed  # kept
    with torch.no_grad():
        layer.weight.neg_()  # in place: the packed copy is stale
    again = kernels.dynamic_int8(x, layer.weight, layer.scale, layer.bias)
    assert kernels._packed(layer.weight, layer.scale, layer.bias) is not packed
    torch.testing.assert_close(again - layer.bias, -(first - layer.bias), rtol=0.05, atol=0.05)


def test_a_kernel_quantizing_activations_is_held_to_its_tolerance_and_no_other_is():
    expected = torch.randn(4, 50)
    near = expected + 0.01 * expected.norm() / 50**0.5 * torch.randn(4, 50) / 2  # ~0.5%
    assert kernels._agrees("dynamic", near, expected)
    assert not kernels._agrees("fused", near, expected)  # an exact kernel: rounding only
    far = expected + 0.1 * torch.randn(4, 50) * expected.std()
    assert not kernels._agrees("dynamic", far, expected)
    assert not kernels._agrees("dynamic", expected * float("nan"), expected)


@pytest.fixture
def with_dynamic_int8(monkeypatch):
    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")  # conftest leaves it out of the suite's tuning


def test_the_exact_kernels_setting_leaves_the_dynamic_int8_kernel_out(monkeypatch):
    assert "dynamic" not in kernels.int8_candidates()  # conftest's setting, for every test
    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")
    assert "dynamic" in kernels.int8_candidates()


def test_the_copies_timing_made_are_freed_unless_a_chosen_kernel_reads_them(monkeypatch):
    """Timing `dynamic_int8` packs every int8 weight again (and `bf16_linear`, where the CPU
    has it, copies every fp32 one): held while the weights live, that is the model's bytes
    again, for kernels that lost."""
    from gptkiln.quantize import Int8Linear, quantize_model

    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")
    model = quantize_model(tiny_model())
    weights = [m.weight for m in model.modules() if isinstance(m, Int8Linear)]
    real = kernels._fastest
    choice = {}

    def timed_then(found, layers, rows, repeats):
        real(found, layers, rows, repeats)  # times them all: every copy is made
        return choice[rows] if choice[rows] in found else next(iter(found))

    monkeypatch.setattr(kernels, "_fastest", timed_then)
    choice.update({1: "dynamic", 2: "dequantize"})
    kernels.tune_decoding(model, rows=1)
    assert all(id(w) in kernels._PACKED for w in weights)  # the chosen kernel's copies stay
    kernels.tune_decoding(model, rows=2)
    assert all(id(w) in kernels._PACKED for w in weights)  # still read at 1 row
    for m in model.modules():
        if isinstance(m, Int8Linear):
            del m.few_row_kernels[1]
    kernels.tune_decoding(model, rows=2)
    assert not any(id(w) in kernels._PACKED for w in weights)


@pytest.mark.usefixtures("with_dynamic_int8")
def test_a_model_tuned_to_the_dynamic_int8_kernel_gives_nearly_the_reference_logits(monkeypatch):
    from gptkiln.quantize import Int8Linear, quantize_model

    model = quantize_model(tiny_model())
    x = torch.randint(0, model.config.vocab_size, (1, 1))
    with torch.no_grad():
        expected = model(x)[0]
        force(monkeypatch, "dynamic")
        kernels.tune_decoding(model, rows=1)
        int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
        assert all(m.few_row_kernels[1] is kernels.dynamic_int8 for m in int8)
        got = model(x)[0]
    assert 0 < relative_error(got, expected) < kernels.ACTIVATION_TOLERANCE


def test_a_kernel_quantizing_activations_must_win_clearly(monkeypatch, tmp_path):
    from gptkiln.quantize import quantize_model

    model = quantize_model(tiny_model())
    clock = [0.0]  # a clock the kernels advance: the test hangs on no real timing

    def taking(seconds, kernel):
        return lambda *a: (clock.__setitem__(0, clock[0] + seconds), kernel(*a))[1]

    def on_the_clock(fn):
        start = clock[0]
        fn()
        return clock[0] - start

    monkeypatch.setattr(kernels, "_seconds", on_the_clock)
    exact = taking(1.0, kernels.dequantize_linear)
    for dynamic, expected in ((0.9, "dequantize"), (0.5, "dynamic")):
        found = {"dequantize": exact, "dynamic": taking(dynamic, kernels.dynamic_int8)}
        monkeypatch.setattr(kernels, "_CHOSEN", {})
        monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path / str(dynamic)))  # no choice on disk
        monkeypatch.setattr(kernels, "int8_candidates", lambda found=found: found)
        assert set(kernels.tune_decoding(model, rows=1).values()) == {expected}


# -- bf16 products for fp32 weights ------------------------------------------------------------
def test_the_bf16_kernel_is_f_linear_within_its_tolerance_and_keeps_one_copy():
    w, b = torch.randn(97, 64), torch.randn(97)
    x = torch.randn(3, 1, 64)
    got = kernels.bf16_linear(x, w, b)
    expected = F.linear(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (3, 1, 97)
    # bf16's 8-bit mantissa: ~0.3% of the norm; more than float rounding, within the tolerance
    assert 1e-4 < relative_error(got, expected) < kernels.ACTIVATION_TOLERANCE
    copy = kernels._BF16[id(w)][2]
    assert copy.dtype == torch.bfloat16
    kernels.bf16_linear(x, w, None)
    assert kernels._BF16[id(w)][2] is copy  # made once
    w.neg_()  # in place: the copy is stale
    assert relative_error(kernels.bf16_linear(x, w, None), F.linear(x, w)) < 0.01
    assert kernels._BF16[id(w)][2] is not copy


def test_the_bf16_kernel_is_a_candidate_only_with_bf16_instructions_and_not_exact(monkeypatch):
    assert "bf16" not in kernels.candidates()  # conftest's GPTKILN_EXACT_KERNELS=1
    assert "bf16" in kernels.QUANTIZING_ACTIVATIONS  # held to the looser check, the margin
    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")
    monkeypatch.setattr(kernels, "_has_bf16", lambda: False)
    assert "bf16" not in kernels.candidates()
    monkeypatch.setattr(kernels, "_has_bf16", lambda: True)
    assert kernels.candidates()["bf16"] is kernels.bf16_linear


def test_copy_costs_weigh_the_copies_a_kernel_makes_against_the_time_it_saves(monkeypatch):
    from gptkiln.quantize import Int8Linear, quantize_model

    model = quantize_model(tiny_model())
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)][:3]
    clock = [0.0]

    def on_the_clock(fn):
        start = clock[0]
        fn()
        return clock[0] - start

    def packing(x, w, s, b):  # 0.5 a call, and 3.0 more the first time it sees a weight
        clock[0] += 0.5 + (3.0 if id(w) not in kernels._PACKED else 0.0)
        kernels._PACKED[id(w)] = (weakref.ref(w), (kernels._stamp(w),), None)  # as `_kept` does
        return kernels.dequantize_linear(x, w, s, b)

    def plain(x, w, s, b):
        clock[0] += 1.0
        return kernels.dequantize_linear(x, w, s, b)

    monkeypatch.setattr(kernels, "_seconds", on_the_clock)
    monkeypatch.setattr(kernels, "_PACKED", {})
    monkeypatch.setitem(kernels._QUANTIZING_KERNELS, "dynamic", (packing, kernels._PACKED))
    found = {"dequantize": plain, "dynamic": packing}
    record = kernels._copy_costs(found, "dynamic", layers, rows=1, repeats=2)
    assert record == {
        "kernel": "dynamic",
        "without_copies": "dequantize",
        "copy_seconds": 9.0,  # three weights packed
        "step_seconds_saved": 1.5,  # three products a step, 0.5 s faster each
    }
    assert kernels._for_steps(record, None, layers) == "dynamic"  # a server: unbounded
    assert kernels._for_steps(record, 5, layers) == "dynamic"  # the copies are made already
    kernels._PACKED.clear()
    assert kernels._for_steps(record, 5, layers) == "dequantize"  # 7.5 s saved < 9 s to copy
    assert kernels._for_steps(record, 6, layers) == "dynamic"  # 9 s saved pays for them


def test_a_short_generation_takes_the_kernel_without_copies_and_makes_none(monkeypatch):
    from gptkiln.quantize import Int8Linear, quantize_model

    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")  # "dynamic" on offer
    model = quantize_model(tiny_model())
    weights = [m.weight for m in model.modules() if isinstance(m, Int8Linear)]
    costly = {"copy_seconds": 0.5, "step_seconds_saved": 0.001}  # 500 steps to pay
    monkeypatch.setattr(
        kernels,
        "_fastest",
        lambda found, *a: (
            "dynamic"
            if "dynamic" in found
            else "int8_rows"
            if "int8_rows" in found
            else "dequantize"
        ),
    )
    monkeypatch.setattr(
        kernels,
        "_copy_costs",
        lambda found, name, *a: {"kernel": name, "without_copies": "dequantize", **costly},
    )
    chosen = kernels.tune_decoding(model, rows=1, steps=100)
    assert set(chosen.values()) == {"dequantize"}
    assert not any(id(w) in kernels._PACKED for w in weights)  # nothing packed
    monkeypatch.setattr(kernels, "_CHOSEN", {})  # another process: the record from the disk
    monkeypatch.setattr(kernels, "_fastest", lambda *a: pytest.fail("timed again"))
    assert set(kernels.tune_decoding(model, rows=1, steps=1000).values()) == {"dynamic"}
    with torch.no_grad():
        model(torch.tensor([[1]]))  # one row: every layer packs its weight
    assert all(id(w) in kernels._PACKED for w in weights)
    assert set(kernels.tune_decoding(model, rows=1, steps=10).values()) == {"dynamic"}  # made


@pytest.mark.skipif(
    __import__("gptkiln.native").native.decode_blocks_library() is None,
    reason="no C compiler with OpenMP, or no AVX-512: no one-call step to choose",
)
def test_the_tuner_times_a_whole_step_where_the_products_chose_other_kernels(monkeypatch, tmp_path):
    """Where the products alone were timed fastest with another kernel, the one-call step
    (which needs the loops) may still win: a whole step is timed both ways, once per machine."""
    import gptkiln.sampling as sampling

    greedy = SampleConfig(max_new_tokens=6, temperature=0, stop_at_eos=False)
    with monkeypatch.context() as untuned:
        untuned.setattr(sampling, "tune_decoding", lambda *a, **kw: {})
        reference = generate(tiny_model(), [[1, 2, 3]], greedy)
    model = tiny_model()
    monkeypatch.setattr(kernels, "_fastest", lambda found, *a: next(iter(found)))  # F.linear
    timed = []
    monkeypatch.setattr(kernels, "_time_step", lambda *a: timed.append(1) or "layers")
    assert generate(model, [[1, 2, 3]], greedy) == reference
    assert timed and (model.decode_blocks is None or not model.decode_blocks.rows)
    assert model.h[0].mlp.c_fc.few_row_kernels[1] is F.linear

    model = tiny_model()
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path / "another-machine"))
    real = kernels._time_step
    monkeypatch.setattr(kernels, "_time_step", lambda *a: real(*a) and "native")
    assert generate(model, [[1, 2, 3]], greedy) == reference
    assert model.decode_blocks.rows == {1}
    blocks = [m for b in model.h for m in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj)]
    assert all(m.few_row_kernels[1] is kernels.few_rows_linear for m in blocks)
    assert model.lm_head.few_row_kernels[1] is F.linear  # the head keeps its own choice

    model = tiny_model()
    monkeypatch.setattr(kernels, "_CHOSEN", {})  # another process: the choice from the disk
    monkeypatch.setattr(kernels, "_time_step", lambda *a: pytest.fail("timed again"))
    assert generate(model, [[1, 2, 3]], greedy) == reference
    assert model.decode_blocks.rows == {1}


def test_a_server_tuning_rows_at_their_own_positions_times_no_whole_step(monkeypatch):
    model = tiny_model()
    model.setup_cache(1, 16)
    monkeypatch.setattr(kernels, "_fastest", lambda found, *a: next(iter(found)))  # F.linear
    monkeypatch.setattr(kernels, "_time_step", lambda *a: pytest.fail("timed a whole step"))
    kernels.tune_decoding(model, rows=1, one_call=False)
    assert model.h[0].mlp.c_fc.few_row_kernels[1] is F.linear  # the products' own choice


def test_a_stale_copy_under_a_reused_id_is_not_taken_for_the_weights():
    from gptkiln.quantize import Int8Linear, quantize_model

    layers = [m for m in quantize_model(tiny_model()).modules() if isinstance(m, Int8Linear)]
    record = {"kernel": "dynamic", "without_copies": "dequantize"}
    record.update(copy_seconds=1.0, step_seconds_saved=0.001)
    gone = torch.zeros(1)
    stale = {id(layer.weight): (weakref.ref(gone), (), None) for layer in layers}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(kernels._QUANTIZING_KERNELS, "dynamic", (kernels.dynamic_int8, stale))
        assert kernels._for_steps(record, 10, layers) == "dequantize"  # another tensor's copies
        stale.update(
            {
                id(layer.weight): (weakref.ref(layer.weight), (kernels._stamp(layer.weight),), None)
                for layer in layers
            }
        )
        assert kernels._for_steps(record, 10, layers) == "dynamic"  # these weights' own
        layers[0].weight.data = layers[0].weight.data.clone()  # new storage: its copy is stale
        assert kernels._for_steps(record, 10, layers) == "dequantize"
