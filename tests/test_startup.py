"""Start-up: a command imports what it uses and nothing more (`python -c "import torch"` is the
floor; every heavy library above it costs a generate its first token)."""

import subprocess
import sys
import textwrap

import pytest
import torch

from gptkiln.checkpoint import save_model
from gptkiln.config import GPTConfig
from gptkiln.model import GPT
from gptkiln.quantize import quantize_model
from gptkiln.tokenizers import load_tokenizer

HEAVY = (
    "torch._dynamo",  # 1.8 s on a 2-core Xeon: what building on meta used to pull in
    "torch._inductor",
    "sympy",
    "fastapi",
    "uvicorn",
    "peft",
    "matplotlib",
    "transformers",
    "tensorboard",
    "datasets",
    "pyarrow",
    "pandas",
    "lm_eval",
    "jinja2",
)


def run_and_list_heavy(argv: list[str]) -> subprocess.CompletedProcess:
    """``gptkiln ARGV`` in a fresh interpreter; its stdout ends with the list of `HEAVY` modules
    the command imported."""
    code = textwrap.dedent(
        """
        import sys
        from gptkiln.cli import main
        try:
            main(sys.argv[2:])
        finally:
            print(sorted(m for m in sys.argv[1].split(",") if m in sys.modules))
        """
    )
    return subprocess.run(
        [sys.executable, "-c", code, ",".join(HEAVY), *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    """A tiny model with the gpt2 tokenizer, saved as a run."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=50257, context_length=32))
    return save_model(model, tmp_path_factory.mktemp("run"), tokenizer=load_tokenizer("gpt2"))


@pytest.mark.parametrize("tokens", ["1", "4"])  # 4: the decode kernels are tuned too
def test_generate_imports_no_heavy_module(gpt2_run, tokens):
    proc = run_and_list_heavy(
        ["generate", str(gpt2_run), "--prompt", "The", "--max-new-tokens", tokens]
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The") and len(proc.stdout.splitlines()) >= 2  # it generated
    assert proc.stdout.splitlines()[-1] == "[]", proc.stdout


def test_a_quantized_run_loads_without_torch_dynamo(tmp_path):
    """A stored int8 run is built quantized on the meta device: no reduction may run there."""
    torch.manual_seed(0)
    model = quantize_model(GPT(GPTConfig.from_name("tiny", vocab_size=50257, context_length=32)))
    run = save_model(model, tmp_path / "int8", tokenizer=load_tokenizer("gpt2"))
    proc = run_and_list_heavy(["generate", str(run), "--prompt", "The", "--max-new-tokens", "1"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]", proc.stdout


def test_building_on_meta_runs_no_initialiser():
    """A GPT on meta is only shapes: its layers' own ``reset_parameters`` (which would import
    torch._dynamo through meta ``normal_``) are skipped; a GPT on the CPU is initialised."""
    code = textwrap.dedent(
        """
        import sys, torch
        from gptkiln.config import GPTConfig
        from gptkiln.model import GPT
        for name in ("gpt2", "llama3-124m", "qwen3-124m"):
            with torch.device("meta"):
                GPT(GPTConfig.from_name(name, n_layer=2))
        print("torch._dynamo" in sys.modules)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip() == "False", proc.stdout + proc.stderr
    fresh = GPT(GPTConfig.from_name("tiny", vocab_size=61, context_length=8))
    assert fresh.h[0].mlp.c_fc.weight.std() > 0.01  # initialised, as always


def the_program(argv: list[str]) -> subprocess.CompletedProcess:
    """``gptkiln ARGV`` as the console script runs it (`gptkiln.cli.run`), with an object whose
    finalizer prints when the interpreter tears the modules down, and an atexit handler."""
    code = textwrap.dedent(
        """
        import atexit, sys
        from gptkiln.cli import run

        class Teardown:
            def __del__(self):
                print("torn down", flush=True)

        keep = Teardown()
        atexit.register(lambda: print("atexit ran"))
        run(sys.argv[1:])
        """
    )
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300
    )


def test_a_command_that_only_prints_skips_the_interpreters_teardown(gpt2_run):
    """torch's teardown is ~0.4 s of every process; `generate`, `perplexity`, `info` and `inspect`
    end without it, their output and the atexit handlers intact."""
    proc = the_program(["generate", str(gpt2_run), "--prompt", "The", "--max-new-tokens", "3"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The") and "atexit ran" in proc.stdout
    assert "torn down" not in proc.stdout
    proc = the_program(["info", str(gpt2_run / "nowhere")])  # bad input: 2, its one line
    assert proc.returncode == 2 and "error" in proc.stderr and "torn down" not in proc.stdout
    proc = the_program(["prepare", str(gpt2_run / "nowhere.txt"), "--out", str(gpt2_run / "p")])
    assert proc.returncode == 2 and "atexit ran" in proc.stdout and "torn down" in proc.stdout
