"""The CPU backend's C (`gptkiln.cpu.library`): one library built once per machine, loaded only
from a directory of the user's own, every kernel equal to torch's in both builds (the AVX-512
one and the plain-C reference, ``GPTKILN_CPU_KERNELS=generic``), and never in the way where it
cannot be built."""

import math
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gptkiln.cpu import (
    blocks,
    library,
    loops,
    planned,
    prepare_for_decoding,
    products,
    specs,
    tuner,
)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A cache directory of this test's own (no shared build) and no library loaded yet."""
    monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path / "cache"))
    library._load.cache_clear()
    yield tmp_path / "cache" / "cpu"
    library._load.cache_clear()


@pytest.fixture(params=["x86", "generic"])
def build(request, monkeypatch):
    """Each kernel test runs in both builds: the AVX-512 one (where the CPU has AVX-512) and the
    plain-C reference every machine builds (``GPTKILN_CPU_KERNELS=generic``)."""
    if request.param == "x86":
        if library.build() != "x86" or library.library() is None:
            pytest.skip("not an x86-64 build here")
        if not library.library().gk_avx512():
            pytest.skip("no AVX-512 on this CPU: the x86 library runs the generic kernels")
    else:
        monkeypatch.setenv("GPTKILN_CPU_KERNELS", "generic")
    if library.library() is None:
        pytest.skip("no C compiler here: the kernels are not offered")
    assert library.library().gk_avx512() == (request.param == "x86")
    return request.param


needs_library = pytest.mark.skipif(
    library.library() is None,
    reason="no C compiler on this machine: the kernels are not offered",
)


@needs_library
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 64])
@pytest.mark.parametrize("n_out, n_in", [(4, 16), (7, 48), (97, 768), (50, 272)])
def test_the_few_rows_kernel_is_f_linear(build, rows, n_out, n_in):
    # every remainder: rows not a multiple of 4 (1, 3, 5), outputs not a multiple of 4 (7, 97,
    # 50), an input wider than one chunk of k (768, 272 = 256 + 16)
    torch.manual_seed(rows * 1000 + n_out)
    x, w, b = torch.randn(rows, n_in), torch.randn(n_out, n_in), torch.randn(n_out)
    for bias in (b, None):
        got = products.few_rows_linear(x, w, bias)
        assert got.shape == (rows, n_out) and got.is_contiguous()
        # the same sums in another order: as close to the exact ones as torch's own
        exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        torch_error = (F.linear(x, w, bias) - exact).abs().max().item()
        assert (got - exact).abs().max().item() <= 4 * torch_error + 1e-6
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-4, atol=1e-4)


@needs_library
def test_the_few_rows_kernel_leaves_to_f_linear_what_it_does_not_take(build):
    torch.manual_seed(0)
    w = torch.randn(8, 48)
    cases = {
        "a width that is not a multiple of 16": (torch.randn(3, 24), torch.randn(8, 24)),
        "more rows than it keeps sums for": (torch.randn(products.FEW_ROWS + 1, 48), w),
        "float64": (torch.randn(3, 48, dtype=torch.float64), w.double()),
        "a transposed weight": (torch.randn(3, 48), torch.randn(48, 8).t()),
        "a strided input": (torch.randn(3, 96)[:, ::2], w),
    }
    for what, (x, weight) in cases.items():
        torch.testing.assert_close(
            products.few_rows_linear(x, weight, None), F.linear(x, weight), msg=what
        )


@needs_library
def test_the_library_is_built_once_and_later_processes_load_it(fresh_build, monkeypatch):
    assert library.library() is not None
    built = list(fresh_build.glob("gptkiln-cpu-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    # a later process: nothing may be compiled, the file is loaded as it is
    library._load.cache_clear()
    monkeypatch.setattr(library, "_build", lambda *a: pytest.fail("built again"))
    assert library.library() is not None
    assert built[0].stat().st_mtime_ns == stamp


@needs_library
def test_the_cache_directory_is_private_and_a_planted_library_is_never_loaded(
    fresh_build, monkeypatch, capfd
):
    assert library.library() is not None
    assert stat.S_IMODE(fresh_build.stat().st_mode) == 0o700  # made private
    (built,) = fresh_build.glob("gptkiln-cpu-*.so")
    # another user's library in its place: one that writes a file as it loads
    marker = fresh_build.parent / "planted-ran"
    planted = fresh_build.parent / "planted.c"
    planted.write_text(
        "#include <stdio.h>\n__attribute__((constructor)) static void run(void) "
        f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n'
    )
    cc = library.compiler()
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(built), str(planted)], check=True)
    built.chmod(0o666)  # writable by anyone: not this user's alone
    library._load.cache_clear()
    assert library.library() is not None  # built again, privately
    assert not marker.exists()
    assert built.stat().st_mode & stat.S_IWOTH == 0  # and the planted file replaced
    # a directory others may write: never read, one line says so, a private build instead
    fresh_build.chmod(0o777)
    library._load.cache_clear()
    library._private_temp.cache_clear()
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(built), str(planted)], check=True)
    built.chmod(0o700)
    assert library.library() is not None
    assert not marker.exists()
    err = capfd.readouterr().err
    assert err.count("not loading compiled kernels") == 1 and str(fresh_build) in err
    library._private_temp.cache_clear()


@needs_library
def test_a_build_that_does_not_load_is_built_again(tmp_path):
    # in other processes: a library this one has loaded is never rewritten under it
    env = {**os.environ, "GPTKILN_CACHE": str(tmp_path / "cache")}
    check = (
        "import torch; from gptkiln.cpu.library import library as f; assert f() is not None; "
        "from gptkiln.cpu.products import few_rows_linear as k; "
        "y = k(torch.ones(2, 16), torch.ones(5, 16), None); "
        "assert torch.equal(y, torch.full((2, 5), 16.0))"
    )
    subprocess.run([sys.executable, "-c", check], env=env, check=True)
    (built,) = (tmp_path / "cache" / "cpu").glob("gptkiln-cpu-*.so")
    built.write_bytes(b"not a library")  # truncated by a crash, say
    subprocess.run([sys.executable, "-c", check], env=env, check=True)
    assert built.read_bytes()[:4] == b"\x7fELF"


@needs_library
def test_a_private_build_beside_a_shared_cache_is_removed_as_the_process_exits(tmp_path):
    cache, temp = tmp_path / "cache", tmp_path / "temp"
    (cache / "cpu").mkdir(parents=True)
    (cache / "cpu").chmod(0o777)  # others may write there: built in a private temporary
    temp.mkdir()
    env = {
        **os.environ,
        "GPTKILN_CACHE": str(cache),
        "TMPDIR": str(temp),
        "GPTKILN_CPU_INSTALL_BUILD": "0",
    }
    code = (
        "from gptkiln.cpu import library as m; assert m.library() is not None; "
        "print(m._private_temp())"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "not loading compiled kernels" in done.stderr
    assert Path(done.stdout.strip()).parent == temp  # it was there, and it is gone
    assert list(temp.iterdir()) == []


@needs_library
def test_two_processes_building_at_once_both_load_the_library(tmp_path):
    env = {**os.environ, "GPTKILN_CACHE": str(tmp_path / "cache")}
    code = "from gptkiln.cpu.library import library as f; assert f() is not None"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(2)]
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    assert len(list((tmp_path / "cache" / "cpu").glob("gptkiln-cpu-*.so"))) == 1
    assert [p.name for p in (tmp_path / "cache" / "cpu").iterdir() if ".so" != p.suffix] == []


@pytest.mark.parametrize(
    "setting", [("CC", "/nonexistent/cc"), ("GPTKILN_NATIVE", "0")], ids=["no compiler", "off"]
)
def test_where_it_cannot_be_built_the_kernel_is_not_offered_and_tuning_goes_on(
    setting, fresh_build, monkeypatch
):
    monkeypatch.setenv(*setting)
    monkeypatch.setattr(tuner, "_CHOSEN", {})
    assert library.library() is None
    assert "few_rows" not in specs.offered("float32", "fp32")
    assert not fresh_build.exists() or not list(fresh_build.iterdir())
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT

    model = GPT(GPTConfig(vocab_size=64, context_length=16, n_layer=1, n_head=2, n_embd=32)).eval()
    assert tuner.tune_decoding(model, rows=2)  # chosen among torch's own


def test_a_compiler_that_fails_leaves_no_file_behind(fresh_build, monkeypatch, tmp_path):
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'cc: error' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    assert library.library() is None
    assert not list(fresh_build.iterdir())


@pytest.mark.parametrize("kind", ["x86", "generic"])
def test_the_library_builds_wherever_it_can(fresh_build, monkeypatch, kind):
    # so that a source that no longer compiles fails here, instead of every test above skipping
    if library.compiler() is None:
        pytest.skip("no C compiler: nothing to build on this machine")
    if kind == "x86" and library.build() != "x86":
        pytest.skip("not x86-64: the AVX-512 sources are not built here")
    if kind == "generic":
        monkeypatch.setenv("GPTKILN_CPU_KERNELS", "generic")
    lib = library.library()
    assert lib is not None and library.build() == kind
    for name in library.ENTRIES:  # every entry point typed
        assert getattr(lib, name).restype is not None
    assert "few_rows" in specs.offered("float32", "fp32")
    assert "int8_rows" in specs.offered("int8", "exact")
    monkeypatch.setenv("GPTKILN_EXACT_KERNELS", "0")  # conftest's: the suite decodes exactly
    assert "bf16_rows" in specs.offered("float32", "bf16")
    assert ("q8_rows" in specs.offered("int8", "int8")) == bool(lib.gk_q8_vnni())
    if kind == "x86" and _cpu_has_vnni():  # q8_rows needs AVX-512 VNNI besides
        assert lib.gk_q8_vnni()


def _cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512_vnni"))


# -- target_log_probs: one token's log-probability a row, for scoring ---------------------------
needs_scoring_library = pytest.mark.skipif(
    library.library() is None,
    reason="no C compiler with OpenMP, or no AVX-512 on this machine: torch's path runs",
)


@needs_scoring_library
@pytest.mark.parametrize("rows, width", [(1, 16), (5, 50257), (33, 1000), (3, 7)])
def test_target_log_probs_are_log_softmax_gathered_and_argmax_the_first_largest(build, rows, width):
    # widths: a multiple of 16, GPT-2's 50,257 (a remainder of 1), one smaller than a vector
    torch.manual_seed(rows)
    logits = torch.randn(rows, width) * 8
    logits[0, width // 2] = logits[0, -1] = logits[0].max() + 1  # a tie: the first index wins
    if rows > 1:
        logits[1, -1] = logits[1].max() + 1  # the largest in the remainder
    targets = torch.randint(0, width, (rows,))
    got, top = loops.target_log_probs(logits, targets, with_argmax=True)
    exact = torch.log_softmax(logits.double(), -1).gather(-1, targets[:, None]).squeeze(-1)
    torch_error = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1) - exact
    assert (got.double() - exact).abs().max() <= torch_error.abs().max() + 2e-6
    assert torch.equal(top, logits.argmax(-1))
    assert top[0] == width // 2
    again, none = loops.target_log_probs(logits, targets, with_argmax=False)
    assert none is None and torch.equal(again, got)


@needs_scoring_library
def test_target_log_probs_take_rows_apart_and_refuse_a_target_out_of_range(build):
    torch.manual_seed(0)
    wide = torch.randn(4, 80)
    logits = wide[:, :64]  # rows 80 floats apart
    targets = torch.tensor([0, 63, 5, 17])
    got, _ = loops.target_log_probs(logits, targets, with_argmax=False)
    torch.testing.assert_close(got, torch.log_softmax(logits, -1)[range(4), targets])
    with pytest.raises(IndexError, match="outside the 64 logits"):
        loops.target_log_probs(logits, torch.tensor([0, 64, 1, 2]), with_argmax=False)


def test_target_log_probs_leave_to_torch_what_they_do_not_take(fresh_build, monkeypatch):
    logits, targets = torch.randn(3, 20), torch.tensor([1, 2, 19])
    assert loops.target_log_probs(logits.double(), targets, with_argmax=True) is None
    assert loops.target_log_probs(logits.t().contiguous().t(), targets, False) is None
    monkeypatch.setenv("GPTKILN_NATIVE", "0")
    library._load.cache_clear()  # a new process, as it were
    assert loops.target_log_probs(logits, targets, with_argmax=True) is None


# -- gelu_tanh_: GPT-2's MLP activation with its bias, in place --------------------------------
needs_gelu_library = pytest.mark.skipif(
    library.library() is None,
    reason="no C compiler with OpenMP, or no AVX-512 on this machine: F.gelu runs",
)


@needs_gelu_library
@pytest.mark.parametrize("shape", [(1, 16), (16, 3072), (2, 3, 50), (3, 7), (700, 3072)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_gelu_loop_is_the_tanh_gelu_of_y_plus_bias(build, shape, with_bias):
    # widths: whole vectors, a remainder, less than one vector; (700, 3072): many threads' chunks
    torch.manual_seed(len(shape) + shape[-1])
    y = torch.randn(shape) * 4
    bias = torch.randn(shape[-1]) * 3 if with_bias else None
    before = y if bias is None else y + bias
    exact = F.gelu(before.double(), approximate="tanh")
    torch_error = (F.gelu(before, approximate="tanh").double() - exact).abs().max()
    out = y.clone()
    assert loops.gelu_tanh_(out, bias)
    assert (out.double() - exact).abs().max() <= torch_error + 1e-6


@needs_gelu_library
def test_the_gelu_loop_takes_the_far_ends_as_torch_does(build):
    edge = torch.tensor([-1e4, -100.0, -20.0, -5.0, -1e-30, 0.0, 1e-30, 5.0, 100.0, 3e38])
    edge = torch.cat([edge, torch.tensor([float("inf"), float("-inf"), float("nan")])])
    out = edge.clone()[None]
    assert loops.gelu_tanh_(out, None)
    torch.testing.assert_close(out[0], F.gelu(edge, approximate="tanh"), equal_nan=True)


def test_the_gelu_loop_leaves_to_torch_what_it_does_not_take(fresh_build, monkeypatch):
    y = torch.randn(4, 32)
    for other, bias in [
        (y.double(), None),
        (y.t(), None),  # not contiguous
        (y.clone(), torch.randn(31)),  # a bias of another width
        (y.clone(), torch.randn(32).double()),
        (y[:0].clone(), None),
    ]:
        kept = other.clone()
        assert not loops.gelu_tanh_(other, bias)
        assert torch.equal(other, kept)
    monkeypatch.setenv("GPTKILN_NATIVE", "0")
    library._load.cache_clear()  # a new process, as it were
    kept = y.clone()
    assert not loops.gelu_tanh_(y, None) and torch.equal(y, kept)


def _mlp(bias: float):
    from gptkiln.config import GPTConfig
    from gptkiln.model import MLP

    torch.manual_seed(0)
    mlp = MLP(GPTConfig(vocab_size=64, context_length=16, n_layer=1, n_head=2, n_embd=32)).eval()
    with torch.no_grad():
        mlp.c_fc.bias.fill_(bias)  # far from 0: a bias left out or added twice shows
    return mlp


def _reference(mlp, x):
    h = F.gelu(F.linear(x, mlp.c_fc.weight, mlp.c_fc.bias), approximate="tanh")
    return F.linear(h, mlp.c_proj.weight, mlp.c_proj.bias)


@needs_gelu_library
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_the_mlp_takes_the_loop_without_autograd_and_adds_the_bias_once(build, rows, monkeypatch):
    mlp = _mlp(bias=2.5)
    x = torch.randn(1, rows, 32)
    assert planned.use_compiled_gelu(mlp) == 1
    called = []
    monkeypatch.setattr(
        planned, "gelu_tanh_", lambda h, b: called.append(h) or loops.gelu_tanh_(h, b)
    )
    with torch.inference_mode():
        torch.testing.assert_close(mlp(x), _reference(mlp, x), atol=2e-6, rtol=1e-5)
    assert called  # the loop's path is the one taken
    if rows <= products.FEW_ROWS:
        tuner.tune_decoding(mlp, rows=rows)
        assert planned.few_row_kernels(mlp.c_fc)
    with torch.no_grad():  # a tuned few-row kernel, called without the bias
        torch.testing.assert_close(mlp(x), _reference(mlp, x), atol=2e-6, rtol=1e-5)
    x.requires_grad_(True)
    called.clear()
    mlp(x).sum().backward()  # autograd: F.gelu, which has a backward
    assert x.grad is not None and not called


@needs_gelu_library
def test_an_int8_mlp_takes_the_loop_after_its_own_bias(monkeypatch):
    from gptkiln.quantize import Int8Linear

    mlp = _mlp(bias=-1.5)
    x = torch.randn(2, 5, 32)
    mlp.c_fc = quantized = Int8Linear.from_float(mlp.c_fc)
    planned.use_compiled_gelu(mlp)
    called = []
    monkeypatch.setattr(
        planned, "gelu_tanh_", lambda h, b: called.append(b) or loops.gelu_tanh_(h, b)
    )
    with torch.inference_mode():
        mlp(x)
        assert called == [None]  # the loop, without a bias: the int8 layer added its own
        h = F.gelu(quantized(x), approximate="tanh")
        expected = F.linear(h, mlp.c_proj.weight, mlp.c_proj.bias)
        torch.testing.assert_close(mlp(x), expected, atol=2e-6, rtol=1e-5)


def test_the_compiled_gelu_goes_where_it_builds_and_the_model_runs_without_it(
    fresh_build, monkeypatch
):
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT

    cfg = dict(vocab_size=64, context_length=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg)).eval()
    exact = GPT(GPTConfig(**cfg, gelu="exact")).eval()  # the erf GELU: not this loop's
    idx = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        before = model(idx)
    assert planned.use_compiled_gelu(exact) == 0
    if library.library() is not None:
        planned.use_compiled_loops(model)  # as `prepare_for_decoding` and evaluation give it
        assert all(isinstance(block.mlp, planned.PlannedGelu) for block in model.h)
        with torch.no_grad():
            torch.testing.assert_close(model(idx), before, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("GPTKILN_NATIVE", "0")
    library._load.cache_clear()
    fresh = GPT(GPTConfig(**cfg)).eval()
    assert planned.use_compiled_gelu(fresh) == 0
    assert not any(isinstance(block.mlp, planned.PlannedGelu) for block in fresh.h)


# -- int8_rows_linear: int8 weights, fp32 activations, a few rows ------------------------------
needs_int8_library = pytest.mark.skipif(
    library.library() is None,
    reason="no C compiler with OpenMP, or no AVX-512 on this machine: the kernel is not offered",
)


@needs_int8_library
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 64])
@pytest.mark.parametrize("n_out, n_in", [(4, 16), (7, 48), (97, 768), (50, 528)])
def test_the_int8_rows_kernel_is_the_dequantizing_product(build, rows, n_out, n_in):
    # remainders as the fp32 loop's; 528 = 512 + 16: an input wider than one chunk of k
    from gptkiln.quantize import quantize_per_channel

    torch.manual_seed(rows * 1000 + n_out)
    q, scale = quantize_per_channel(torch.randn(n_out, n_in))
    x, b = torch.randn(rows, n_in), torch.randn(n_out)
    for bias in (b, None):
        got = products.int8_rows_linear(x, q, scale, bias)
        assert got.shape == (rows, n_out) and got.is_contiguous()
        w = q.double() * scale.double()[:, None]  # the exact sums: activations never rounded
        exact = F.linear(x.double(), w, None if bias is None else bias.double())
        reference = products.dequantize_linear(x, q, scale, bias)
        torch_error = (reference - exact).abs().max().item()
        assert (got - exact).abs().max().item() <= 4 * torch_error + 1e-6
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
    many = torch.randn(2, 3, n_in)  # leading dimensions are kept
    assert products.int8_rows_linear(many, q, scale, b).shape == (2, 3, n_out)


@pytest.mark.parametrize(
    "name, width, odd",
    [
        pytest.param("int8_rows", 48, 24, marks=needs_int8_library),
        pytest.param(
            "q8_rows",
            64,
            48,
            marks=pytest.mark.skipif(
                library.library() is None, reason="no AVX-512 VNNI here: not offered"
            ),
        ),
    ],
)
def test_an_int8_loop_leaves_to_the_reference_what_it_does_not_take(build, name, width, odd):
    # width: a multiple of what the loop takes; odd: a width it refuses
    from gptkiln.quantize import quantize_per_channel

    kernel = {"int8_rows": products.int8_rows_linear, "q8_rows": products.q8_rows_linear}[name]
    torch.manual_seed(0)
    q, scale = quantize_per_channel(torch.randn(8, width))
    q_odd, scale_odd = quantize_per_channel(torch.randn(8, odd))
    cases = {
        "a width it does not take": (torch.randn(3, odd), q_odd, scale_odd),
        "more rows than it keeps sums for": (torch.randn(products.FEW_ROWS + 1, width), q, scale),
        "float64": (torch.randn(3, width, dtype=torch.float64), q, scale.double()),
        "a transposed weight": (torch.randn(3, 8), q.t(), torch.ones(width)),
    }
    if name == "int8_rows":  # taken (made contiguous), and exact: the reference's numbers
        cases["a strided input"] = (torch.randn(3, 2 * width)[:, ::2], q, scale)
    for what, (x, weight, s) in cases.items():
        expected = x
        if name == "q8_rows" and what == "more rows than it keeps sums for":
            expected = products.q8_0(x)  # a prefill's rows: rounded by the loop, 64 at a time
        torch.testing.assert_close(
            kernel(x, weight, s, None), products.dequantize_linear(expected, weight, s, None),
            msg=what,
        )  # fmt: skip


@needs_int8_library
def test_an_int8_model_given_the_loop_decodes_the_reference_tokens(monkeypatch):
    import gptkiln.sampling as sampling
    from gptkiln.config import GPTConfig, SampleConfig
    from gptkiln.model import GPT
    from gptkiln.quantize import quantize_model

    # the kernels set below (no backend prepares the model: sampling's own prepares nothing)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=96, context_length=32, n_layer=2, n_head=2, n_embd=64)
    model = quantize_model(GPT(cfg).eval())
    layers = [m for m in model.modules() if planned.is_product(m)]
    assert layers and all(m.weight.dtype == torch.int8 for m in layers)
    greedy = SampleConfig(max_new_tokens=12, temperature=0, stop_at_eos=False)
    reference = torch.cat(list(sampling.generate_stream(model, [[1, 2, 3]], greedy)))
    for layer in layers:
        planned.give_kernel(layer, 1, products.int8_rows_linear)
    called = []
    lib = library.library()
    monkeypatch.setattr(products, "library", lambda: called.append(1) or lib)
    got = torch.cat(list(sampling.generate_stream(model, [[1, 2, 3]], greedy)))
    assert called  # the loop ran: every decode step's products went through it
    assert torch.equal(got, reference)


# -- bf16_rows_linear: fp32 weights rounded to bf16, fp32 activations, a few rows --------------
needs_bf16_rows_library = pytest.mark.skipif(
    library.library() is None,
    reason="no C compiler with OpenMP, or no AVX-512 on this machine: the kernel is not offered",
)


@needs_bf16_rows_library
@pytest.mark.parametrize("rows", [1, 3, 5, 64, 100])  # 100: a prefill's, past the loop's
@pytest.mark.parametrize("n_out, n_in", [(4, 16), (97, 768), (50, 528)])
def test_the_bf16_rows_kernel_is_f_linear_on_the_weights_rounded_to_bf16(build, rows, n_out, n_in):
    torch.manual_seed(rows * 1000 + n_out)
    x, w, b = torch.randn(rows, n_in), torch.randn(n_out, n_in), torch.randn(n_out)
    rounded = w.to(torch.bfloat16).double()  # the only rounding: the weights' own
    for bias in (b, None):
        got = products.bf16_rows_linear(x, w, bias)
        assert got.shape == (rows, n_out) and got.is_contiguous()
        expected = F.linear(x.double(), rounded, None if bias is None else bias.double())
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
        reference = F.linear(x, w, bias)  # and within the tuner's tolerance of fp32's
        assert ((got - reference).norm() / reference.norm()).item() <= tuner.ACTIVATION_TOLERANCE
    if rows > products.FEW_ROWS:  # a prefill's rows through the loop: each as a step gets it
        got = products.bf16_rows_linear(x, w, b)
        assert torch.equal(got[70], products.bf16_rows_linear(x[70:71], w, b)[0])
    assert id(w) in products._BF16_ROWS  # its copy, made once and kept with the weight
    copy = products._BF16_ROWS[id(w)][2]
    products.bf16_rows_linear(x, w, b)
    assert products._BF16_ROWS[id(w)][2] is copy
    with torch.no_grad():
        w.mul_(2)  # changed in place: copied again
    torch.testing.assert_close(
        products.bf16_rows_linear(x, w, None).double(),
        F.linear(x.double(), w.to(torch.bfloat16).double()),
        rtol=1e-5,
        atol=1e-4,
    )
    layer = torch.nn.Linear(n_in, n_out)
    products.bf16_rows_linear(x, layer.weight, None)
    version = layer.weight._version
    layer.weight.data = torch.randn(n_out, n_in)  # the same object, its version as it was
    assert layer.weight._version == version
    torch.testing.assert_close(  # copied again all the same
        products.bf16_rows_linear(x, layer.weight, None).double(),
        F.linear(x.double(), layer.weight.detach().to(torch.bfloat16).double()),
        rtol=1e-5,
        atol=1e-4,
    )


@needs_bf16_rows_library
def test_bf16_rows_is_offered_only_where_the_kernels_need_not_be_exact(monkeypatch):
    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")  # conftest's: the suite tunes exactly
    assert "bf16_rows" in specs.offered("float32", "bf16") and "bf16_rows" in specs.inexact()
    assert "bf16_rows" not in specs.offered("float32", "fp32")  # fp32 decoding never rounds
    with specs.exact_kernels():
        assert "bf16_rows" not in specs.offered("float32", "bf16")
    layer = torch.nn.Linear(64, 32)
    kernels_of = {1: products.bf16_rows_linear}
    layer.few_row_kernels = kernels_of
    products.bf16_rows_linear(torch.randn(1, 64), layer.weight, layer.bias)
    assert id(layer.weight) in products._BF16_ROWS
    model = torch.nn.Sequential(layer)
    tuner.keep_exact(model)  # as an evaluation does: taken off, and its copy freed
    assert kernels_of == {} and id(layer.weight) not in products._BF16_ROWS


# -- q8_rows_linear: int8 weights, activations rounded to 8 bits in blocks of 32 ---------------
needs_q8_library = pytest.mark.skipif(
    not specs.available(specs.BY_NAME["q8_rows"]),
    reason="no C compiler with OpenMP, no AVX-512 VNNI on this machine, or the generic build "
    "forced (GPTKILN_CPU_KERNELS=generic): q8_rows is not offered",
)


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as q8_0 rounds it: each block of 32 values to 8 bits on its own scale
    d = max |x| / 127, as ``csrc/q8_rows.c`` computes it in fp32 (x * (127 / max |x|), rounded
    half to even: a tie rounded otherwise would be off by one unit, d |w|), in float64."""
    blocks = x.float().view(x.size(0), -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    k = torch.full_like(amax, 127.0)  # tensor by tensor: IEEE division, as the C's
    inv = torch.where(amax > 0, k / torch.where(amax > 0, amax, 1.0), 0.0)
    a = torch.round(blocks * inv)
    return (a.double() * (amax / k).double()).view_as(x)


@needs_q8_library
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 64, 100])  # 100: a prefill's, past the loop's
@pytest.mark.parametrize("n_out, n_in", [(4, 64), (7, 128), (97, 768), (50, 1088)])
def test_the_q8_rows_kernel_is_q8_0s_product(build, rows, n_out, n_in):
    # remainders as the other loops'; 1088 = 1024 + 64: an input wider than one chunk of k
    from gptkiln.quantize import quantize_per_channel

    torch.manual_seed(rows * 1000 + n_out)
    q, scale = quantize_per_channel(torch.randn(n_out, n_in))
    q[:, -1], q[::3, -2] = -128, -128  # quantize.py's stop at -127; a loaded int8 file's need not
    x, b = torch.randn(rows, n_in), torch.randn(n_out)
    x[:, 3] *= 40  # an outlier: only its own block of 32 is rounded on its scale
    w = q.double() * scale.double()[:, None]
    for bias in (b, None):
        got = products.q8_rows_linear(x, q, scale, bias)
        assert got.shape == (rows, n_out) and got.is_contiguous()
        expected = F.linear(_q8_0(x), w, None if bias is None else bias.double())
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
        # against the activations unrounded: within the tolerance the tuner holds it to
        reference = products.dequantize_linear(x, q, scale, bias)
        error = ((got - reference).norm() / reference.norm()).item()
        assert error <= tuner.ACTIVATION_TOLERANCE
    many = torch.randn(2, 3, n_in)  # leading dimensions are kept
    assert products.q8_rows_linear(many, q, scale, b).shape == (2, 3, n_out)


@needs_q8_library
def test_q8_rows_keeps_what_is_not_finite_not_finite(build):
    from gptkiln.quantize import quantize_per_channel

    torch.manual_seed(0)
    q, scale = quantize_per_channel(torch.randn(9, 128))
    x = torch.randn(4, 128)
    x[0, 5], x[1, 70], x[2, 127] = math.nan, math.inf, -math.inf  # each in one block of 32
    got = products.q8_rows_linear(x, q, scale, None)
    assert got[0].isnan().all()  # not rounded away to a finite number
    assert not got[1].isfinite().any() and not got[2].isfinite().any()
    assert torch.equal(got[3], products.q8_rows_linear(x[3:], q, scale, None)[0])
    many = products.q8_rows_linear(x.repeat(20, 1), q, scale, None)  # past 64 rows: in chunks
    assert many[0].isnan().all()
    assert not many[1].isfinite().any() and not many[2].isfinite().any()
    assert many[3].isfinite().all()


def test_q8_rows_is_not_offered_on_a_cpu_without_vnni(monkeypatch):
    class WithoutVnni:  # the library as it loads on a CPU that lacks AVX-512 VNNI
        def gk_q8_vnni(self):
            return 0

    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")  # conftest's: the suite tunes exactly
    monkeypatch.setattr(specs, "library", lambda: WithoutVnni())
    offered = specs.offered("int8", "int8")  # int8 asked: the exact int8 kernels instead
    assert "q8_rows" not in offered and "dequantize" in offered


@needs_q8_library
def test_q8_rows_is_left_out_where_the_kernels_must_be_exact(monkeypatch):
    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")  # conftest's: the suite tunes exactly
    assert "q8_rows" in specs.offered("int8", "int8") and "q8_rows" in specs.inexact()
    with specs.exact_kernels():
        assert "q8_rows" not in specs.offered("int8", "int8")


# -- decode_attention: one new token a row over the KV cache -----------------------------------
needs_attention_library = pytest.mark.skipif(
    library.library() is None,
    reason="no C compiler with OpenMP, or no AVX-512 on this machine: SDPA runs",
)


@needs_attention_library
@pytest.mark.parametrize(
    "B, H, G, S, D, masked",
    [
        (1, 12, 12, 130, 64, False),  # GPT-2 at batch 1
        (16, 12, 12, 37, 64, True),  # a left-padded batch
        (2, 8, 2, 50, 128, True),  # grouped-query heads (Llama's, Qwen's) of 128
        (3, 4, 1, 5, 16, True),  # multi-query, fewer keys than one vector
    ],
)
def test_decode_attention_is_sdpa(build, B, H, G, S, D, masked):
    torch.manual_seed(B * 100 + S)
    qkv = torch.randn(B, 1, (H + 2 * G) * D)
    q = qkv[..., : H * D].view(B, 1, H, D).transpose(1, 2)  # a strided view, as the model's
    cache_k, cache_v = torch.randn(B, G, S + 9, D), torch.randn(B, G, S + 9, D)
    k, v = cache_k[:, :, :S], cache_v[:, :, :S]  # the cache's first S positions, a view
    mask = None
    if masked:
        mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
        mask[0, ..., : S // 3 + 1] = False  # row 0's left padding
    got = loops.decode_attention(q, k, v, mask)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=G != H)
    assert got.shape == (B, H, 1, D)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)


@needs_attention_library
def test_decode_attention_of_a_row_with_every_key_masked_is_sdpas(build):
    q, k, v = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 4, 16), torch.randn(2, 2, 4, 16)
    mask = torch.tensor([[True, True, False, True], [False] * 4])[:, None, None]
    got = loops.decode_attention(q, k, v, mask)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # zeros on the CPU
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert got[0].abs().sum() > 0
    q[1, 0, 0, 3] = float("nan")  # a broken query: NaN out, as SDPA's (not zeros)
    mask[1] = True
    got = loops.decode_attention(q, k, v, mask)
    assert got[1, 0].isnan().all() and not got[1, 1].isnan().any() and not got[0].isnan().any()
    assert F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[1, 0].isnan().all()


def test_decode_attention_leaves_to_sdpa_what_it_does_not_take(fresh_build, monkeypatch):
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 4, 6, 16), torch.randn(1, 4, 6, 16)
    cases = {
        "two new tokens": (torch.randn(1, 4, 2, 16), k, v, None),
        "float64": (q.double(), k.double(), v.double(), None),
        "a head size that is not a multiple of 16": (q[..., :8], k[..., :8], v[..., :8], None),
        "an additive mask": (q, k, v, torch.zeros(1, 1, 1, 6)),
        "a mask of several query rows": (q, k, v, torch.ones(1, 1, 2, 6, dtype=torch.bool)),
        "heads that do not group": (torch.randn(1, 3, 1, 16), k[:, :2], v[:, :2], None),
    }
    for what, (a, b, c, mask) in cases.items():
        assert loops.decode_attention(a, b, c, mask) is None, what
    monkeypatch.setenv("GPTKILN_NATIVE", "0")
    library._load.cache_clear()
    assert loops.decode_attention(q, k, v, None) is None


@needs_attention_library
@pytest.mark.parametrize("family", ["gpt2", "llama3"])
def test_a_model_given_the_compiled_loops_decodes_the_same_tokens(build, family, monkeypatch):
    import gptkiln.sampling as sampling
    from gptkiln.config import GPTConfig, SampleConfig
    from gptkiln.model import GPT

    # no backend prepares the model here: the loops are given below
    name = "baby" if family == "gpt2" else f"{family}-baby"
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name(name, vocab_size=97, context_length=48)).eval()
    prompts = [[5, 6, 7, 8, 9], [1, 2]]  # unequal: the shorter row is left-padded (a mask)
    greedy = SampleConfig(max_new_tokens=10, temperature=0, stop_at_eos=False)
    reference = torch.stack(list(sampling.generate_stream(model, prompts, greedy)))
    assert planned.use_compiled_attention(model) == len(model.h)
    calls = []
    monkeypatch.setattr(
        planned, "decode_attention", lambda *a: calls.append(1) or loops.decode_attention(*a)
    )
    got = torch.stack(list(sampling.generate_stream(model, prompts, greedy)))
    assert len(calls) == 9 * len(model.h)  # every decode step, every layer (not the prefill)
    assert torch.equal(got, reference)
    spelled_out = GPT(GPTConfig.from_name(name, vocab_size=97, attention="math"))
    assert planned.use_compiled_attention(spelled_out) == 0  # the explicit product, as asked


def test_the_library_is_built_once_per_install_whatever_the_cache(monkeypatch, tmp_path):
    """A first use with an empty cache (a new ``GPTKILN_CACHE``) loads the library built beside
    the package instead of compiling it again; where others may write there, the cache's."""
    if library.compiler() is None:
        pytest.skip("no C compiler on this machine")
    package = tmp_path / "package"
    package.mkdir(mode=0o700)
    monkeypatch.setattr(library, "INSTALL_DIR", package / "_built")
    monkeypatch.delenv(library.INSTALL_ENV)
    builds = []
    real = library._build
    monkeypatch.setattr(library, "_build", lambda *a: builds.append(a[-1]) or real(*a))
    for cache in ("first", "second"):  # a new, empty cache each time
        monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path / cache))
        library._load.cache_clear()
        assert library.library() is not None
    assert len(builds) == 1 and builds[0].parent == package / "_built"
    (package / "_built").chmod(0o777)  # others may write it: not the install's own any more
    library._load.cache_clear()
    assert library.library() is not None
    assert len(builds) == 2 and builds[1].parent == tmp_path / "second" / "cpu"
    library._load.cache_clear()


@pytest.mark.slow
def test_the_install_builds_the_library_a_first_use_loads(monkeypatch, tmp_path):
    """``setup.py``'s build step (what ``pip install`` runs) compiles the library into the
    package's ``cpu/_built/``, under the name a first use looks for: it loads it and compiles
    nothing."""
    from conftest import REPO

    pytest.importorskip(
        "setuptools", reason="setuptools is not in this environment (pip's build has its own)"
    )
    if library.compiler() is None:
        pytest.skip("no C compiler on this machine")
    env = {k: v for k, v in os.environ.items() if k != library.INSTALL_ENV}
    out = tmp_path / "lib"
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)],
        cwd=REPO, env=env, check=True, capture_output=True,
    )  # fmt: skip
    built = out / "gptkiln" / "cpu" / "_built"
    name = library.library_name(library.build(), library.compiler())
    assert [p.name for p in built.iterdir()] == [name]
    monkeypatch.delenv(library.INSTALL_ENV)
    monkeypatch.setattr(library, "INSTALL_DIR", built)
    monkeypatch.setattr(library, "_build", lambda *a: pytest.fail("compiled at first use"))
    built.parent.chmod(0o700)  # the package's directory, this user's alone
    assert library.load_built(library.build()) is not None


def test_an_edited_header_builds_a_new_library(fresh_build, monkeypatch, tmp_path):
    import shutil

    if library.compiler() is None:
        pytest.skip("no C compiler: nothing to build on this machine")
    sources = tmp_path / "csrc"
    shutil.copytree(library.SOURCES, sources)
    monkeypatch.setattr(library, "SOURCES", sources)
    assert library.load_built("generic") is not None
    first = [p.name for p in fresh_build.glob("gptkiln-cpu-generic-*.so")]
    header = sources / "gptkiln_cpu.h"  # what every source includes
    header.write_text(header.read_text() + "\n/* edited */\n")
    assert library.load_built("generic") is not None
    second = [p.name for p in fresh_build.glob("gptkiln-cpu-generic-*.so")]
    assert len(first) == len(second) == 1 and first != second  # rebuilt, the old one removed


# -- decode_blocks: a GPT-2 decode step's blocks and final norm in one call ---------------------
needs_blocks_library = pytest.mark.skipif(
    library.library() is None,
    reason="no C compiler with OpenMP, or no AVX-512 on this machine: the layers run from Python",
)


def _small_model(quantized: bool = False, name: str = "baby", **overrides):
    """A small model of preset ``name`` (GPT-2's ``baby``; ``llama3-baby``, ``qwen3-baby``)."""
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT
    from gptkiln.quantize import quantize_model

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name(name, vocab_size=97, context_length=48, **overrides)).eval()
    with torch.no_grad():  # no zero biases or unit norms: a term left out would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return quantize_model(model) if quantized else model


def _step_logits(model, prompts, steps: int):
    """Prefill ``prompts`` (left-padded), then ``steps`` greedy decode steps through
    ``model.forward``; the logits of every step (steps, B, V)."""
    from gptkiln.sampling import decoding, left_pad

    idx, pad = left_pad(prompts, 0, "cpu")
    model.setup_cache(idx.size(0), 40, pad)
    out = []
    with torch.no_grad(), decoding():  # a decoding's forwards: the one call may take the steps
        logits = model(idx, start_pos=0, last_only=True)[:, -1]
        pos = idx.size(1)
        for _ in range(steps):
            token = logits.argmax(-1)
            logits = model(token[:, None], start_pos=pos, last_only=True)[:, -1]
            out.append(logits)
            pos += 1
    return torch.stack(out)


def _counting(blocks):
    """``blocks`` (a `DecodeBlocks`, or its class's ``__call__``) wrapped to count the steps it
    computed (not declined)."""
    done = []

    def call(*args):
        y = blocks(*args)
        if y is not None:
            done.append(1)
        return y

    return call, done


def _steps_computed(monkeypatch) -> list:
    """Every `DecodeBlocks` from now on counting, into the list returned, the steps it computed
    (not those it declined)."""
    counted, done = _counting(blocks.DecodeBlocks.__call__)
    monkeypatch.setattr(blocks.DecodeBlocks, "__call__", counted)
    return done


@needs_blocks_library
@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("prompts", [[[5, 6, 7]], [[5, 6, 7, 8, 9], [1, 2], [3, 4, 5, 6]]])
def test_the_one_call_decode_step_is_the_layers_step(build, quantized, prompts):
    model = _small_model(quantized)
    rows = len(prompts)
    layers = [m for m in model.modules() if planned.is_product(m)]
    loop = products.int8_rows_linear if quantized else products.few_rows_linear
    for layer in layers:  # the loops the one call runs, on every product
        planned.give_kernel(layer, rows, loop)
    planned.use_compiled_loops(model)
    reference = _step_logits(model, prompts, steps=8)
    assert blocks.use_native_blocks(model, rows)
    model.decode_blocks, done = _counting(model.decode_blocks)
    got = _step_logits(model, prompts, steps=8)
    assert len(done) == 8  # every decode step went through the one call (not the prefill)
    torch.testing.assert_close(got, reference, atol=2e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), reference.argmax(-1))


@needs_blocks_library
@pytest.mark.parametrize("name", ["qwen3-baby", "llama3-baby"])
@pytest.mark.parametrize("kind", ["fp32", "int8", "bf16"])
@pytest.mark.parametrize("prompts", [[[5, 6, 7]], [[5, 6, 7, 8, 9], [1, 2], [3, 4, 5, 6]]])
def test_the_one_call_step_of_llama_and_qwen3_is_the_layers_step(build, name, kind, prompts):
    # RMSNorm, Qwen3's q/k norms, RoPE at each row's own position (left padding), grouped
    # heads and SwiGLU in C: the same logits as the layers running the same loops
    model = _small_model(kind == "int8", name=name)
    rows = len(prompts)
    loop = {
        "fp32": products.few_rows_linear,
        "int8": products.int8_rows_linear,
        "bf16": products.bf16_rows_linear,
    }[kind]
    for layer in [m for m in model.modules() if planned.is_product(m)]:
        planned.give_kernel(layer, rows, loop)
    planned.use_compiled_loops(model)
    reference = _step_logits(model, prompts, steps=8)
    assert blocks.use_native_blocks(model, rows)
    model.decode_blocks, done = _counting(model.decode_blocks)
    got = _step_logits(model, prompts, steps=8)
    assert len(done) == 8  # every decode step went through the one call
    torch.testing.assert_close(got, reference, atol=2e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), reference.argmax(-1))


@needs_blocks_library
def test_the_one_call_step_declines_a_relu2_mlp():
    # a choice the C step does not compute (ReLU² gates) leaves the step to the layers
    model = _small_model(name="qwen3-baby")
    for block in model.h:
        block.mlp.relu2 = True
    for layer in [m for m in model.modules() if planned.is_product(m)]:
        planned.give_kernel(layer, 1, products.few_rows_linear)
    reference = _step_logits(model, [[5, 6, 7]], steps=3)
    assert blocks.use_native_blocks(model, 1)
    model.decode_blocks, done = _counting(model.decode_blocks)
    got = _step_logits(model, [[5, 6, 7]], steps=3)
    assert done == []  # declined every step: the layers ran
    torch.testing.assert_close(got, reference)


@needs_blocks_library
def test_the_one_call_step_runs_bf16_layers_over_their_bf16_copies(build):
    # bf16 decoding: the one call reads each layer's bf16 copy, as the layers' loop does
    model = _small_model(False)
    layers = [m for m in model.modules() if planned.is_product(m)]
    for i, layer in enumerate(layers):  # bf16 on most products, fp32 on some: both in one step
        kernel = products.few_rows_linear if i % 5 == 1 else products.bf16_rows_linear
        planned.give_kernel(layer, 1, kernel)
    planned.use_compiled_loops(model)
    with pytest.MonkeyPatch.context() as m:  # the layers, each by its own loop
        m.setattr(blocks, "library", lambda: None)
        assert not blocks.use_native_blocks(model, 1)
    reference = _step_logits(model, [[5, 6, 7]], steps=6)
    assert blocks.use_native_blocks(model, 1)
    model.decode_blocks, done = _counting(model.decode_blocks)
    got = _step_logits(model, [[5, 6, 7]], steps=6)
    assert len(done) == 6
    torch.testing.assert_close(got, reference, atol=2e-5, rtol=1e-5)
    exact = _step_logits_with(_small_model(False), products.few_rows_linear, [[5, 6, 7]], steps=6)
    assert not torch.allclose(got, exact, atol=1e-6, rtol=0)  # the weights were rounded


@needs_blocks_library
@needs_q8_library
@pytest.mark.parametrize("mixed", [False, True], ids=["q8", "q8-and-int8"])
def test_the_one_call_step_runs_each_product_by_its_layers_loop(build, mixed):
    # q8_rows rounds the activations: the one call must run it where the layer has it (and
    # the exact int8 loop where that layer has that), so that the step is the layers' step
    model = _small_model(quantized=True)
    layers_ = blocks.block_products(model)
    for i, layer in enumerate(layers_):
        exact = mixed and i % 3 == 1
        planned.give_kernel(
            layer, 1, products.int8_rows_linear if exact else products.q8_rows_linear
        )
    planned.use_compiled_loops(model)
    reference = _step_logits(model, [[5, 6, 7]], steps=6)
    exact = _step_logits_with(model, products.int8_rows_linear, [[5, 6, 7]], steps=6)
    assert not torch.allclose(reference, exact, atol=1e-4)  # the rounding shows in the logits
    assert blocks.use_native_blocks(model, 1)
    model.decode_blocks, done = _counting(model.decode_blocks)
    got = _step_logits(model, [[5, 6, 7]], steps=6)
    assert len(done) == 6
    torch.testing.assert_close(got, reference, atol=2e-5, rtol=1e-5)


def _step_logits_with(model, kernel, prompts, steps: int):
    """`_step_logits` with ``kernel`` on every block product for the step (then as before)."""
    layers_ = blocks.block_products(model)
    kept = [planned.few_row_kernels(layer).get(1) for layer in layers_]
    for layer in layers_:
        planned.give_kernel(layer, 1, kernel)
    try:
        return _step_logits(model, prompts, steps)
    finally:
        for layer, k in zip(layers_, kept):
            planned.give_kernel(layer, 1, k)


@needs_blocks_library
@needs_q8_library
def test_q8_on_a_width_that_is_no_multiple_of_64_keeps_the_layers_step():
    model = _small_model(quantized=True, n_embd=80, n_head=2)  # q8_rows.c refuses k = 80
    for layer in blocks.block_products(model):
        planned.give_kernel(layer, 1, products.q8_rows_linear)
    planned.use_compiled_loops(model)
    assert not blocks.use_native_blocks(model, 1)
    wide = _small_model(quantized=True)  # 128 and 512: taken
    for layer in blocks.block_products(wide):
        planned.give_kernel(layer, 1, products.q8_rows_linear)
    planned.use_compiled_loops(wide)
    assert blocks.use_native_blocks(wide, 1)


@needs_blocks_library
@needs_q8_library
def test_keep_exact_takes_q8_off_the_one_call_step_too():
    model = _small_model(quantized=True)
    for layer in blocks.block_products(model):
        planned.give_kernel(layer, 1, products.q8_rows_linear)
    planned.use_compiled_loops(model)
    assert blocks.use_native_blocks(model, 1)
    tuner.keep_exact(model)  # as an evaluation does before it scores
    model.decode_blocks, done = _counting(model.decode_blocks)
    got = _step_logits(model, [[5, 6, 7]], steps=3)
    assert not done  # declined: the layers run, on the reference product
    model.decode_blocks = None
    exact = _step_logits_with(model, products.dequantize_linear, [[5, 6, 7]], steps=3)
    torch.testing.assert_close(got, exact, atol=2e-5, rtol=1e-5)


@needs_blocks_library
def test_the_one_call_step_is_given_only_where_the_tuner_chose_the_loops():
    model = _small_model()
    assert not blocks.use_native_blocks(model, 1)  # untuned: F.linear on every product
    assert getattr(model, "decode_blocks", None) is None
    for m in model.modules():
        if planned.is_product(m):
            planned.give_kernel(m, 1, products.few_rows_linear)
    assert blocks.use_native_blocks(model, 1) and model.decode_blocks.rows == {1}
    planned.give_kernel(
        model.h[1].mlp.c_fc, 1, products.onednn
    )  # one product timed faster elsewhere
    assert not blocks.use_native_blocks(model, 1)
    assert model.decode_blocks.rows == set()  # taken away: every step runs the layers
    llama = GPT_of("llama3-baby")
    assert not blocks.use_native_blocks(llama, 1)


def GPT_of(name):
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT

    return GPT(GPTConfig.from_name(name, vocab_size=97, context_length=48)).eval()


@needs_blocks_library
def test_the_tuner_gives_the_one_call_step_and_generation_runs_it(monkeypatch):
    import gptkiln.sampling as sampling
    from gptkiln.config import SampleConfig

    model = _small_model()
    greedy = SampleConfig(max_new_tokens=12, temperature=0, stop_at_eos=False)
    monkeypatch.setattr(tuner, "use_native_blocks", lambda model, rows: False)
    prepare = prepare_for_decoding
    reference = torch.cat(list(sampling.generate_stream(model, [[1, 2, 3]], greedy)))
    assert getattr(model, "decode_blocks", None) is None
    monkeypatch.undo()
    monkeypatch.setattr(tuner, "_fastest", lambda kernels, layers, rows, repeats, clock: "few_rows")
    monkeypatch.setattr(tuner, "_CHOSEN", {})
    done = _steps_computed(monkeypatch)
    got = torch.cat(list(sampling.generate_stream(model, [[1, 2, 3]], greedy, prepare=prepare)))
    assert model.decode_blocks.rows == {1} and len(done) == 11  # every step after the first
    assert torch.equal(got, reference)


@needs_blocks_library
@needs_q8_library
def test_where_the_tuner_chose_q8_the_one_call_step_runs_it(monkeypatch):
    import gptkiln.sampling as sampling
    from gptkiln.config import SampleConfig

    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")  # conftest's: the suite tunes exactly
    monkeypatch.setattr(tuner, "_CHOSEN", {})
    model = _small_model(quantized=True)
    greedy = SampleConfig(max_new_tokens=12, temperature=0, stop_at_eos=False)
    prepare = prepare_for_decoding  # at int8, a quantized model's own: q8_0's loop
    with monkeypatch.context() as m:  # the layers, each with the kernel the tuner chose
        m.setattr(tuner, "use_native_blocks", lambda model, rows: False)
        reference = torch.cat(
            list(sampling.generate_stream(model, [[1, 2, 3]], greedy, prepare=prepare))
        )
    layers = blocks.block_products(model)
    assert {planned.few_row_kernels(layer)[1] for layer in layers} == {products.q8_rows_linear}
    done = _steps_computed(monkeypatch)
    got = torch.cat(list(sampling.generate_stream(model, [[1, 2, 3]], greedy, prepare=prepare)))
    assert model.decode_blocks.rows == {1} and len(done) == 11
    assert torch.equal(got, reference)


@needs_blocks_library
def test_the_one_call_step_declines_what_it_does_not_take_and_the_layers_run():
    def another_kind(model):  # a layer the step does not know (a LoRA wrapper, say)
        old = model.h[1].attn.c_proj
        model.h[1].attn.c_proj = torch.nn.Linear(old.in_features, old.out_features)

    cases = {
        "dropout while training": lambda m: m.train(),
        "a layer of another kind": another_kind,
        "bf16 weights": lambda m: m.to(torch.bfloat16),
        "the explicit attention": lambda m: [setattr(b.attn, "use_sdpa", False) for b in m.h],
        "the exact GELU": lambda m: [setattr(b.mlp, "approximate", "none") for b in m.h],
        "steps of another number of rows": lambda m: m.decode_blocks.rows.discard(1),
    }
    for what, change in cases.items():
        model = _small_model(dropout=0.1)
        for m in model.modules():
            if planned.is_product(m):
                planned.give_kernel(m, 1, products.few_rows_linear)
        assert blocks.use_native_blocks(model, 1), what
        change(model)
        model.decode_blocks, done = _counting(model.decode_blocks)
        logits = _step_logits(model, [[5, 6, 7]], steps=3)
        assert not done and torch.isfinite(logits).all(), what


@needs_blocks_library
def test_the_one_call_step_sees_the_model_as_it_is_at_each_step():
    model = _small_model()
    for m in model.modules():
        if planned.is_product(m):
            planned.give_kernel(m, 1, products.few_rows_linear)
    planned.use_compiled_loops(model)
    assert blocks.use_native_blocks(model, 1)
    model.decode_blocks, done = _counting(model.decode_blocks)
    _step_logits(model, [[5, 6, 7]], steps=2)  # the addresses gathered and kept
    proj = model.h[0].attn.c_proj
    with torch.no_grad():  # a new parameter, and another tensor under an old one
        proj.weight = torch.nn.Parameter(torch.randn_like(proj.weight) * 0.05)
        model.h[1].mlp.c_fc.bias.data = torch.randn_like(model.h[1].mlp.c_fc.bias)
    got = _step_logits(model, [[5, 6, 7]], steps=3)
    assert len(done) == 5
    model.decode_blocks = None  # the layers step: the reference for the one call above
    torch.testing.assert_close(got, _step_logits(model, [[5, 6, 7]], steps=3), atol=2e-5, rtol=1e-5)
