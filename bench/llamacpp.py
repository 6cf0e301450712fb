"""gptkiln against llama.cpp on the CPU: greedy decoding at batch 1, first token, whole process.

    python bench/llamacpp.py [--run RUN] [--shape 124m|tiny] [--family gpt2|qwen3|llama3]
                             [--new-tokens 200] [--rounds 2]
                             [--llamacpp-python PATH] [--sdist PATH] [--workdir DIR]

The peer is ``llama-cpp-python`` (llama.cpp compiled from its PyPI source package, once, into a
venv of its own, outside this project and its tests: building it takes ~25 min on 2 cores).
``--llamacpp-python`` (env ``LLAMACPP_PYTHON``, default ``/work/peers/llamacpp-venv/bin/python``)
is that venv's interpreter; ``--sdist`` (env ``LLAMACPP_SDIST``) is the source package, whose
``convert_hf_to_gguf.py`` (llama.cpp's own converter) and ``gguf-py`` convert the weights. The
converter imports torch and transformers, so it runs with this interpreter (gptkiln's), with the
sdist's ``gguf-py`` first on its path.

The same weights on both sides: ``--run`` (a GPT-2 run), or by default a GPT-2 124M-shaped run
with random weights (as ``bench/generate.py`` makes one, gpt2 tokenizer), exported with
``gptkiln convert to-hf`` and converted to f32, bf16 and q8_0 GGUF by llama.cpp's converter;
with ``--family qwen3`` or ``llama3``, the published Qwen3-0.6B or Llama 3.2-1B blocks with
GPT-2's vocabulary (`FAMILY_PRESETS`), written to GGUF by ``gptkiln convert to-gguf`` (llama.cpp's
converter wants the family's own tokenizer). Each gptkiln row decodes at
one precision (``--precision``) and is compared with the llama.cpp file of that precision, as
the ``vs`` column says: exact fp32 against f32, bf16 (bf16 weights, fp32 activations) against
bf16, int8 (``gptkiln convert quantize`` of the run: int8 weights per output channel, head
included, activations rounded to 8 bits in blocks of 32 while decoding) against q8_0 (weights
in blocks of 32, and, while decoding, the activations too).

Rows (every one its own fresh process, ``--threads`` threads (2), interleaved over ``--rounds``):

- decode tok/s: greedy, batch 1, ``--new-tokens`` tokens from "The" (end-of-text does not stop
  it), the tokens after the second over the time after the second: the steady decode rate
  (gptkiln tunes its decoding kernels between the first token and the second; the whole
  process below counts that time).
- decode CPU ms/token: the process's CPU time a token over the same tokens (all its threads):
  on a machine others are using, ``--threads 1`` and this column compare the two sides' work
  where their wall times would compare the neighbours' (``BENCH_MAX_WAIT=0`` skips waiting for
  a quiet machine before each run).
- first token: from the process's start (the driver's clock at launch) to the first generated
  token, imports and loading included.
- whole process: ``gptkiln generate RUN --prompt The --temperature 0 --max-new-tokens N`` (the
  CLI, printing the text) against a script that imports llama_cpp, loads the GGUF and generates
  the same number of tokens; launch to exit.
- import torch: ``python -c "import torch"``, launch to torch imported (not to exit: gptkiln's
  first token is timed from launch too, before its process ends), once a round (its best), the
  floor any Python tool on torch starts from; gptkiln's first token is also shown over it.

Each figure is the best of the rounds (a busy neighbour only slows a run down); every round's
figure is printed too. The ratio is gptkiln's over llama.cpp's (> 1: gptkiln faster for tok/s;
for times, llama.cpp's over gptkiln's, so > 1 is gptkiln faster there too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

SHAPES = {
    "124m": dict(vocab=50257, context=1024, n_layer=12, n_head=12, n_embd=768),
    "tiny": dict(vocab=50257, context=256, n_layer=2, n_head=2, n_embd=64),  # a smoke run
}
FAMILY_PRESETS = {"qwen3": "qwen3-0.6b", "llama3": "llama3.2-1b"}
"""``--family``'s published shape (gptkiln's preset) beside GPT-2's ``--shape``: its blocks as
published, GPT-2's tokenizer and vocabulary (50,257 rows of head instead of 151,936 or 128,256:
no Qwen or Llama tokenizer is on this machine), a 2,048-token context, random weights."""
DEFAULT_PYTHON = "/work/peers/llamacpp-venv/bin/python"
DEFAULT_SDIST = "/work/peers/sdist/llama_cpp_python-0.3.36.tar.gz"
PROMPT = "The"

# What the llama.cpp side runs, in its own interpreter: argv = gguf path, new tokens, launch time.
LLAMA_WORKER = r"""
import json, sys, time
launched = float(sys.argv[3])
from llama_cpp import Llama
threads = int(sys.argv[4])
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=threads, n_threads_batch=threads,
            n_batch=512, verbose=False)
n = int(sys.argv[2])
tokens = llm.tokenize(b"The", add_bos=False)
times, cpu = [], []
for i, token in enumerate(llm.generate(tokens, top_k=1, temp=0.0, repeat_penalty=1.0)):
    times.append(time.perf_counter())
    cpu.append(time.process_time())
    if i == 0:
        first = time.time() - launched
    if len(times) == n:
        break
rate = (n - 2) / (times[-1] - times[1])
cpu_ms = (cpu[-1] - cpu[1]) / (n - 2) * 1e3
print("RESULT " + json.dumps({"decode_tok_s": rate, "decode_cpu_ms": cpu_ms, "first_token_s": first,
                              "tokens": n}))
"""


# -- the gptkiln worker (this script with --worker) --------------------------------------------
def worker(job: dict) -> None:
    """Load the run as `gptkiln generate` does and time every greedy token from "The"."""
    import torch

    from gptkiln.config import SampleConfig
    from gptkiln.cpu import prepare_for_decoding, ready_for_decoding
    from gptkiln.loading import load_run
    from gptkiln.sampling import generate_stream

    model, tokenizer, _ = load_run(job["run"], device="cpu")
    precision = ready_for_decoding(model, job.get("precision"), "cpu")
    n = job["new_tokens"]
    cfg = SampleConfig(temperature=0.0, max_new_tokens=n, stop_at_eos=False)
    ids = tokenizer.encode(PROMPT)
    times, cpu, first = [], [], None
    with torch.no_grad():
        for _ in generate_stream(
            model,
            [ids],
            cfg,
            tokenizer.eot_id,
            prepare=lambda m, rows, steps: prepare_for_decoding(
                m, rows, steps, precision=precision
            ),
        ):
            times.append(time.perf_counter())
            cpu.append(time.process_time())
            if first is None:
                first = time.time() - job["launched"]
    rate = (len(times) - 2) / (times[-1] - times[1])  # after the second: the tuning is over
    cpu_ms = (cpu[-1] - cpu[1]) / (len(times) - 2) * 1e3
    common.emit(
        {"decode_tok_s": rate, "decode_cpu_ms": cpu_ms, "first_token_s": first, "tokens": n}
    )


# -- the driver ---------------------------------------------------------------------------------
def make_run(shape: str, directory: Path, family: str = "gpt2") -> Path:
    common.setup_torch()
    from gptkiln.checkpoint import save_model
    from gptkiln.config import GPTConfig
    from gptkiln.config.model import GPT2_VOCAB_SIZE, PRESETS
    from gptkiln.model import GPT
    from gptkiln.tokenizers import load_tokenizer

    if family == "gpt2":
        model, name = common.gptkiln_gpt(SHAPES[shape]), f"gpt2-{shape}"
    else:
        preset = FAMILY_PRESETS[family]
        config = dict(PRESETS[preset], vocab_size=GPT2_VOCAB_SIZE, context_length=2048)
        model, name = GPT(GPTConfig(**config, dropout=0.0)), preset
    return save_model(model.eval(), directory / name, tokenizer=load_tokenizer("gpt2"))


def own_gguf(run: Path, workdir: Path) -> dict[str, Path]:
    """The f32, bf16 and q8_0 GGUF files of a Llama 3 or Qwen3 run by ``gptkiln convert
    to-gguf`` (llama.cpp's converter wants the family's own tokenizer, which is not here;
    gptkiln's files load in llama.cpp: tests/test_export_gguf.py)."""
    out = {}
    for kind in ("f32", "bf16", "q8_0"):
        path = workdir / f"model-{kind}.gguf"
        if not path.exists():
            gptkiln_cli("convert", "to-gguf", str(run), "--out", str(path), "--type", kind)
        out[kind] = path
    return out


def gptkiln_cli(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "gptkiln", *args],
        check=True,
        cwd=common.REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
    )


def _env(**extra: str) -> dict:
    src = str(common.REPO / "src")
    path = os.environ.get("PYTHONPATH")
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(common.THREADS),
        PYTHONPATH=src if not path else f"{src}{os.pathsep}{path}",
        PYTHONWARNINGS="ignore",
    )
    env.update(extra)
    return env


def to_gguf(hf_dir: Path, sdist: Path, workdir: Path) -> dict[str, Path]:
    """The f32, bf16 and q8_0 GGUF files of an HF GPT-2 directory, by llama.cpp's own converter."""
    root = workdir / "llamacpp-src"
    if not root.exists():
        with tarfile.open(sdist) as tar:
            members = [
                m
                for m in tar.getmembers()
                if "/vendor/llama.cpp/" in m.name
                and any(k in m.name for k in ("convert_hf_to_gguf", "/conversion/", "/gguf-py/"))
            ]
            tar.extractall(root, members=members, filter="data")
    (llama_dir,) = root.glob("*/vendor/llama.cpp")
    out = {}
    for kind in ("f32", "bf16", "q8_0"):
        path = workdir / f"model-{kind}.gguf"
        if not path.exists():
            subprocess.run(
                [
                    sys.executable,
                    str(llama_dir / "convert_hf_to_gguf.py"),
                    str(hf_dir),
                    "--outtype",
                    kind,
                    "--outfile",
                    str(path),
                ],
                check=True,
                env=_env(PYTHONPATH=str(llama_dir / "gguf-py")),
                capture_output=True,
            )
        out[kind] = path
    return out


def run_timed(cmd: list[str], env: dict, timeout: float = 900) -> tuple[dict | None, float]:
    """Run ``cmd`` (its last arguments may need the launch time: pass ``{launched}``); its
    ``RESULT`` dict (None if it prints none) and its wall time from launch to exit."""
    common.wait_for_quiet()
    launched = time.time()
    cmd = [c.replace("{launched}", repr(launched)) for c in cmd]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=common.REPO
    )
    wall = time.time() - launched
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(common.RESULT_PREFIX):
            return json.loads(line[len(common.RESULT_PREFIX) :]), wall
    return None, wall


def jobs(
    runs: dict[str, tuple[Path, str]], ggufs: dict[str, Path], llama_python: str, n: int
) -> list[dict]:
    """(name, decode command, whole-process command, env) of every side; ``runs``: name ->
    (run, the precision it decodes at)."""
    script = str(Path(__file__).resolve())
    out = []
    for name, (run, precision) in runs.items():
        job = {"run": str(run), "new_tokens": n, "launched": "{launched}", "precision": precision}
        job["threads"] = common.THREADS
        job_text = json.dumps(job).replace('"{launched}"', "{launched}")  # a number, at launch
        decode = [sys.executable, script, "--worker", job_text]
        whole = [sys.executable, "-m", "gptkiln", "generate", str(run), "--prompt", PROMPT]
        whole += ["--temperature", "0", "--max-new-tokens", str(n), "--json"]
        whole += ["--precision", precision]
        out.append({"name": name, "decode": decode, "whole": whole, "env": _env()})
    for name, path in ggufs.items():
        cmd = [llama_python, "-c", LLAMA_WORKER, str(path), str(n), "{launched}"]
        cmd.append(str(common.THREADS))
        env = dict(os.environ, OMP_NUM_THREADS=str(common.THREADS))
        out.append({"name": f"llama.cpp {name}", "decode": cmd, "whole": cmd, "env": env})
    return out


def measure(sides: list[dict], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Every side's figures over ``rounds`` interleaved rounds: {name: {figure: [per round]}};
    and, under "import torch", ``python -c "import torch"`` (launch to imported: `IMPORTED`)
    once a round: the floor of gptkiln's first token (issue 28's target: within 0.5 s of it)."""
    figures = {
        s["name"]: {"decode_tok_s": [], "decode_cpu_ms": [], "first_token_s": [], "whole_s": []}
        for s in sides
    }
    figures[IMPORT_TORCH] = {"whole_s": []}
    for r in range(rounds):
        floor = run_timed([sys.executable, "-c", IMPORTED], _env())[0]["imported_s"]
        figures[IMPORT_TORCH]["whole_s"].append(floor)
        print(f"  round {r + 1} import torch: {floor:.2f} s", flush=True)
        for side in sides:
            result, wall = run_timed(side["decode"], side["env"])
            figures[side["name"]]["decode_tok_s"].append(result["decode_tok_s"])
            figures[side["name"]]["decode_cpu_ms"].append(result["decode_cpu_ms"])
            figures[side["name"]]["first_token_s"].append(result["first_token_s"])
            if side["whole"] is side["decode"]:  # llama.cpp: this process is the whole one
                whole = wall
            else:
                whole = run_timed(side["whole"], side["env"])[1]
            figures[side["name"]]["whole_s"].append(whole)
            print(
                f"  round {r + 1} {side['name']}: {result['decode_tok_s']:.1f} tok/s "
                f"({result['decode_cpu_ms']:.1f} CPU ms a token), first "
                f"token {result['first_token_s']:.2f} s, whole {whole:.2f} s",
                flush=True,
            )
    return figures


IMPORT_TORCH = "import torch"
IMPORTED = (  # launch to torch imported, as gptkiln's first token is timed from launch
    "import json, time\nimport torch\n"
    f"print({common.RESULT_PREFIX!r} + json.dumps({{'imported_s': time.time() - {{launched}}}}))"
)


def table(figures: dict[str, dict[str, list[float]]]) -> list[dict]:
    floor = min(figures.pop(IMPORT_TORCH)["whole_s"])
    best = {
        name: {
            "decode_tok_s": max(f["decode_tok_s"]),
            "decode_cpu_ms": min(f["decode_cpu_ms"]),
            "first_token_s": min(f["first_token_s"]),
            "whole_s": min(f["whole_s"]),
        }
        for name, f in figures.items()
    }
    peer_of = {
        "gptkiln fp32": "llama.cpp f32",
        "gptkiln bf16": "llama.cpp bf16",
        "gptkiln int8": "llama.cpp q8_0",
    }
    rows = []
    for name, f in figures.items():
        b = best[name]
        row = {"side": name, **b}
        row["decode_rounds"] = f["decode_tok_s"]
        peer = best.get(peer_of.get(name, ""))
        if peer:
            row["vs"] = peer_of[name]
            row["decode_ratio"] = common.ratio(b["decode_tok_s"], peer["decode_tok_s"])
            row["cpu_ratio"] = common.ratio(peer["decode_cpu_ms"], b["decode_cpu_ms"])
            row["first_ratio"] = common.ratio(peer["first_token_s"], b["first_token_s"])
            row["whole_ratio"] = common.ratio(peer["whole_s"], b["whole_s"])
            row["over_torch"] = f"{b['first_token_s'] - floor:+.2f} s"
        rows.append(row)
    rows.append({"side": IMPORT_TORCH, "whole_s": floor})
    return rows


def main() -> None:
    job = common.worker_args()
    if job is not None:
        common.setup_torch(job.get("threads", common.THREADS))
        worker(job)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, help="a GPT-2 run (default: a random one of --shape)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="124m")
    p.add_argument(
        "--family",
        choices=["gpt2", *FAMILY_PRESETS],
        default="gpt2",
        help="gpt2 (--shape), or a published Llama 3 / Qwen3 shape (FAMILY_PRESETS)",
    )
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument(
        "--threads",
        type=int,
        default=common.THREADS,
        help="threads of every side; 1 with the CPU-time column compares on a busy machine",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--llamacpp-python", default=os.environ.get("LLAMACPP_PYTHON", DEFAULT_PYTHON))
    p.add_argument("--sdist", type=Path, default=os.environ.get("LLAMACPP_SDIST", DEFAULT_SDIST))
    p.add_argument("--workdir", type=Path, help="keep the runs and GGUF files here")
    args = p.parse_args()
    common.THREADS = args.threads
    if args.new_tokens < 3:
        sys.exit(f"--new-tokens {args.new_tokens}: at least 3 (the first, then steps to time)")
    for path, what in ((args.llamacpp_python, "--llamacpp-python"), (args.sdist, "--sdist")):
        if not Path(path).exists():
            sys.exit(
                f"{what} {path} does not exist: build llama-cpp-python once into a venv of its "
                "own (python3 -m venv DIR && DIR/bin/pip install llama-cpp-python: ~25 min), "
                "download its sdist (pip download --no-deps --no-binary :all: "
                "llama-cpp-python), and pass both (--llamacpp-python DIR/bin/python --sdist FILE)"
            )
    common.print_machine()
    with tempfile.TemporaryDirectory(prefix="gptkiln-llamacpp-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        run = args.run or make_run(args.shape, workdir, args.family)
        int8_run, hf_dir = workdir / "int8-run", workdir / "hf"
        if not int8_run.exists():
            gptkiln_cli("convert", "quantize", str(run), "--out", str(int8_run))
        if args.family != "gpt2":
            ggufs = own_gguf(run, workdir)
        else:
            if not hf_dir.exists():
                gptkiln_cli("convert", "to-hf", str(run), "--out", str(hf_dir))
            ggufs = to_gguf(hf_dir, args.sdist, workdir)
        sides = jobs(
            {
                "gptkiln fp32": (run, "fp32"),
                "gptkiln bf16": (run, "bf16"),
                "gptkiln int8": (int8_run, "int8"),
            },
            ggufs,
            args.llamacpp_python,
            args.new_tokens,
        )
        print(
            f"# run {run}; greedy, batch 1, {args.new_tokens} tokens from {PROMPT!r}, "
            f"{args.rounds} rounds interleaved, each side a fresh process; each gptkiln row "
            "against the llama.cpp file of its precision: fp32 vs f32, bf16 vs bf16, int8 vs q8_0"
        )
        rows = table(measure(sides, args.rounds))
    common.print_table(
        rows,
        [
            ("side", "side"),
            ("decode_tok_s", "decode tok/s"),
            ("decode_cpu_ms", "decode CPU ms/token"),
            ("decode_rounds", "rounds"),
            ("first_token_s", "first token s"),
            ("over_torch", "first token over import torch"),
            ("whole_s", f"generate {args.new_tokens}, whole process s"),
            ("vs", "vs"),
            ("decode_ratio", "decode ×"),
            ("cpu_ratio", "CPU time ×"),
            ("first_ratio", "first token ×"),
            ("whole_ratio", "whole process ×"),
        ],
    )


if __name__ == "__main__":
    main()
