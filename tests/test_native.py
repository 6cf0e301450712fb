"""The project's compiled kernels (`gptkiln.native`): built once per machine, equal to torch's
own, and never in the way where they cannot be built."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import gptkiln.kernels as kernels
import gptkiln.native as native


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A cache directory of this test's own (no shared build) and no library loaded yet."""
    monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path / "cache"))
    native.few_rows_library.cache_clear()
    native.target_log_probs_library.cache_clear()
    yield tmp_path / "cache" / "native"
    native.few_rows_library.cache_clear()
    native.target_log_probs_library.cache_clear()


needs_library = pytest.mark.skipif(
    native.few_rows_library() is None,
    reason="no C compiler with OpenMP, or no AVX-512 on this machine: the kernel is not offered",
)


@needs_library
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 64])
@pytest.mark.parametrize("n_out, n_in", [(4, 16), (7, 48), (97, 768), (50, 272)])
def test_the_few_rows_kernel_is_f_linear(rows, n_out, n_in):
    # every remainder: rows not a multiple of 4 (1, 3, 5), outputs not a multiple of 4 (7, 97,
    # 50), an input wider than one chunk of k (768, 272 = 256 + 16)
    torch.manual_seed(rows * 1000 + n_out)
    x, w, b = torch.randn(rows, n_in), torch.randn(n_out, n_in), torch.randn(n_out)
    for bias in (b, None):
        got = kernels.few_rows_linear(x, w, bias)
        assert got.shape == (rows, n_out) and got.is_contiguous()
        # the same sums in another order: as close to the exact ones as torch's own
        exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        torch_error = (F.linear(x, w, bias) - exact).abs().max().item()
        assert (got - exact).abs().max().item() <= 4 * torch_error + 1e-6
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-4, atol=1e-4)


@needs_library
def test_the_few_rows_kernel_leaves_to_f_linear_what_it_does_not_take():
    torch.manual_seed(0)
    w = torch.randn(8, 48)
    cases = {
        "a width that is not a multiple of 16": (torch.randn(3, 24), torch.randn(8, 24)),
        "more rows than it keeps sums for": (torch.randn(kernels.FEW_ROWS + 1, 48), w),
        "float64": (torch.randn(3, 48, dtype=torch.float64), w.double()),
        "a transposed weight": (torch.randn(3, 48), torch.randn(48, 8).t()),
        "a strided input": (torch.randn(3, 96)[:, ::2], w),
    }
    for what, (x, weight) in cases.items():
        torch.testing.assert_close(
            kernels.few_rows_linear(x, weight, None), F.linear(x, weight), msg=what
        )


@needs_library
def test_the_library_is_built_once_and_later_processes_load_it(fresh_build, monkeypatch):
    assert native.few_rows_library() is not None
    built = list(fresh_build.glob("few_rows-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    # a later process: nothing may be compiled, the file is loaded as it is
    native.few_rows_library.cache_clear()
    monkeypatch.setattr(native, "_build", lambda *a: pytest.fail("built again"))
    assert native.few_rows_library() is not None
    assert built[0].stat().st_mtime_ns == stamp


@needs_library
def test_a_build_that_does_not_load_is_built_again(tmp_path):
    # in other processes: a library this one has loaded is never rewritten under it
    env = {**os.environ, "GPTKILN_CACHE": str(tmp_path / "cache")}
    check = (
        "import torch; from gptkiln.native import few_rows_library as f; assert f() is not None; "
        "from gptkiln.kernels import few_rows_linear as k; "
        "y = k(torch.ones(2, 16), torch.ones(5, 16), None); "
        "assert torch.equal(y, torch.full((2, 5), 16.0))"
    )
    subprocess.run([sys.executable, "-c", check], env=env, check=True)
    (built,) = (tmp_path / "cache" / "native").glob("few_rows-*.so")
    built.write_bytes(b"not a library")  # truncated by a crash, say
    subprocess.run([sys.executable, "-c", check], env=env, check=True)
    assert built.read_bytes()[:4] == b"\x7fELF"


@needs_library
def test_two_processes_building_at_once_both_load_the_library(tmp_path):
    env = {**os.environ, "GPTKILN_CACHE": str(tmp_path / "cache")}
    code = "from gptkiln.native import few_rows_library as f; assert f() is not None"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert len(list((tmp_path / "cache" / "native").glob("few_rows-*.so"))) == 1
    assert not list((tmp_path / "cache" / "native").glob("*.tmp"))


@pytest.mark.parametrize(
    "setting", [("CC", "/nonexistent/cc"), ("GPTKILN_NATIVE", "0")], ids=["no compiler", "off"]
)
def test_where_it_cannot_be_built_the_kernel_is_not_offered_and_tuning_goes_on(
    setting, fresh_build, monkeypatch
):
    monkeypatch.setenv(*setting)
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    assert native.few_rows_library() is None
    assert "few_rows" not in kernels.candidates()
    assert not fresh_build.exists() or not list(fresh_build.iterdir())
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT

    model = GPT(GPTConfig(vocab_size=64, context_length=16, n_layer=1, n_head=2, n_embd=32)).eval()
    assert kernels.tune_decoding(model, rows=2)  # chosen among torch's own


def test_a_compiler_that_fails_leaves_no_file_behind(fresh_build, monkeypatch, tmp_path):
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'cc: error' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    monkeypatch.setattr(native, "_avx512_on_linux", lambda: True)
    assert native.few_rows_library() is None
    assert not list(fresh_build.iterdir())


def test_the_library_builds_wherever_it_can(fresh_build):
    # so that a source that no longer compiles fails here, instead of every test above skipping
    if native.compiler() is None or not native._avx512_on_linux():
        pytest.skip("no C compiler, or no AVX-512: nothing to build on this machine")
    assert native.few_rows_library() is not None
    assert "few_rows" in kernels.candidates()
    assert native.target_log_probs_library() is not None


# -- target_log_probs: one token's log-probability a row, for scoring ---------------------------
needs_scoring_library = pytest.mark.skipif(
    native.target_log_probs_library() is None,
    reason="no C compiler with OpenMP, or no AVX-512 on this machine: torch's path runs",
)


@needs_scoring_library
@pytest.mark.parametrize("rows, width", [(1, 16), (5, 50257), (33, 1000), (3, 7)])
def test_target_log_probs_are_log_softmax_gathered_and_argmax_the_first_largest(rows, width):
    # widths: a multiple of 16, GPT-2's 50,257 (a remainder of 1), one smaller than a vector
    torch.manual_seed(rows)
    logits = torch.randn(rows, width) * 8
    logits[0, width // 2] = logits[0, -1] = logits[0].max() + 1  # a tie: the first index wins
    if rows > 1:
        logits[1, -1] = logits[1].max() + 1  # the largest in the remainder
    targets = torch.randint(0, width, (rows,))
    got, top = native.target_log_probs(logits, targets, with_argmax=True)
    exact = torch.log_softmax(logits.double(), -1).gather(-1, targets[:, None]).squeeze(-1)
    torch_error = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1) - exact
    assert (got.double() - exact).abs().max() <= torch_error.abs().max() + 2e-6
    assert torch.equal(top, logits.argmax(-1))
    assert top[0] == width // 2
    again, none = native.target_log_probs(logits, targets, with_argmax=False)
    assert none is None and torch.equal(again, got)


@needs_scoring_library
def test_target_log_probs_take_rows_apart_and_refuse_a_target_out_of_range():
    torch.manual_seed(0)
    wide = torch.randn(4, 80)
    logits = wide[:, :64]  # rows 80 floats apart
    targets = torch.tensor([0, 63, 5, 17])
    got, _ = native.target_log_probs(logits, targets, with_argmax=False)
    torch.testing.assert_close(got, torch.log_softmax(logits, -1)[range(4), targets])
    with pytest.raises(IndexError, match="outside the 64 logits"):
        native.target_log_probs(logits, torch.tensor([0, 64, 1, 2]), with_argmax=False)


def test_target_log_probs_leave_to_torch_what_they_do_not_take(fresh_build, monkeypatch):
    logits, targets = torch.randn(3, 20), torch.tensor([1, 2, 19])
    assert native.target_log_probs(logits.double(), targets, with_argmax=True) is None
    assert native.target_log_probs(logits.t().contiguous().t(), targets, False) is None
    monkeypatch.setenv("GPTKILN_NATIVE", "0")
    native.target_log_probs_library.cache_clear()  # a new process, as it were
    assert native.target_log_probs(logits, targets, with_argmax=True) is None
