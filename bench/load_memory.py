"""Peak memory of loading a gpt2-medium-shaped checkpoint: gptkiln's `load_model` vs the naive way,
and of its int8 quantized copy.

    python bench/load_memory.py [--preset gpt2-medium]

A subprocess writes a run directory with random weights (~1.4 GB of fp32 safetensors) into a
temporary directory; then each loader runs in a fresh subprocess of its own, so that one's peak
(VmHWM from /proc/self/status, Linux only) cannot pollute the other's:

- gptkiln: `load_model` builds the model on the meta device and assigns the memory-mapped
  tensors of the file (``load_state_dict(assign=True)``): one copy of the weights, at most.
- naive: ``GPT(config)`` allocates and initialises every weight, then
  ``safetensors.torch.load_file`` + ``load_state_dict`` copies the file's tensors into them: two.
- gptkiln int8: `load_model` of the same run quantized beforehand (``convert.quantize_run``,
  what ``gptkiln convert quantize`` writes): the meta model is quantized and the int8 tensors
  are assigned, so no fp32 copy of the quantized weights is ever made. The issue's target:
  its peak under 40% of the fp32 load's (gptkiln's).
- int8 on load: ``load_model(fp32 run, quantize="int8")`` (``--quantize int8``), for
  comparison: every fp32 weight is read to be quantized.

Memory-mapped pages count in RSS only once they are read, so each loader is measured right after
loading and again after reading every weight once (what the first forward pass does anyway).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def status_kb(field: str) -> int:
    """A memory field of /proc/self/status in kB (VmRSS: now, VmHWM: the peak so far)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def write_checkpoint(run_dir: str, preset: str) -> None:
    """Random weights of the preset's shape, saved as a gptkiln run directory."""
    import torch

    from gptkiln.checkpoint import save_model
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig.from_name(preset))
    model.to_empty(device="cpu")
    model.reset_parameters()  # also re-ties lm_head to wte
    save_model(model, run_dir)


def quantize_run(run_dir: str, out_dir: str) -> None:
    from gptkiln.convert import quantize_run as quantize

    quantize(run_dir, out_dir)


def measure(method: str, run_dir: str) -> dict:
    """Load the run's weights the given way; RSS figures in kB, relative to before loading."""
    import torch
    from safetensors.torch import load_file

    from gptkiln.config import GPTConfig
    from gptkiln.loading import CONFIG_FILE, WEIGHTS_FILE, load_model, read_config
    from gptkiln.model import GPT

    torch.set_num_threads(4)
    base = status_kb("VmRSS")
    start = time.perf_counter()
    if method in ("gptkiln", "gptkiln int8"):  # the int8 one is given the quantized run
        model = load_model(run_dir)
    elif method == "int8 on load":
        model = load_model(run_dir, quantize="int8")
    else:
        config = GPTConfig.from_dict(read_config(run_dir)["model"])
        model = GPT(config)
        sd = load_file(Path(run_dir) / WEIGHTS_FILE)
        sd["lm_head.weight"] = sd["wte.weight"]  # the tied head is stored once
        model.load_state_dict(sd)
        del sd
    seconds = time.perf_counter() - start
    after_load = status_kb("VmHWM") - base
    with torch.no_grad():  # reads every page; in slices: an int8 sum would upcast a whole copy
        tensors = [*model.parameters(), *model.buffers()]
        checksum = sum(float(part.sum()) for t in tensors for part in t.reshape(-1).split(2**18))
    after_touch = status_kb("VmHWM") - base
    assert (Path(run_dir) / CONFIG_FILE).is_file()
    return {
        "method": method,
        "seconds": seconds,
        "peak_after_load_kb": after_load,
        "peak_after_reading_kb": after_touch,
        "checksum": checksum,
        "params": sum(p.numel() for p in model.parameters()),
    }


def run_child(*args: str) -> str:
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(args)} failed:\n{done.stderr}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-medium")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gptkiln-load-memory-") as tmp:
        run_dir = str(Path(tmp) / "run")
        start = time.perf_counter()
        run_child("_write", run_dir, args.preset)
        size = (Path(run_dir) / "model.safetensors").stat().st_size
        print(
            f"{args.preset}: wrote {size / 2**30:.2f} GiB of safetensors in "
            f"{time.perf_counter() - start:.0f} s"
        )
        q_dir = str(Path(tmp) / "run-int8")
        run_child("_quantize", run_dir, q_dir)
        q_size = (Path(q_dir) / "model.safetensors").stat().st_size
        runs = {
            "gptkiln": run_dir,
            "naive": run_dir,
            "gptkiln int8": q_dir,
            "int8 on load": run_dir,
        }
        results = {m: json.loads(run_child("_measure", m, d)) for m, d in runs.items()}
    if results["gptkiln"]["checksum"] != results["naive"]["checksum"]:
        sys.exit("the two loaders disagree on the weights")
    if results["gptkiln int8"]["checksum"] != results["int8 on load"]["checksum"]:
        sys.exit("the saved int8 run and the fp32 run quantized on load disagree")
    print(f"{'loader':<12} {'load s':>7} {'peak after load':>16} {'peak after reading':>19}")
    for method, r in results.items():
        print(
            f"{method:<12} {r['seconds']:>7.2f} {r['peak_after_load_kb'] / 2**20:>12.2f} GiB "
            f"{r['peak_after_reading_kb'] / 2**20:>15.2f} GiB"
        )
    ours, naive = results["gptkiln"], results["naive"]
    print(
        f"file {size / 2**30:.2f} GiB; peak / file size: gptkiln "
        f"{ours['peak_after_reading_kb'] * 1024 / size:.2f}, naive "
        f"{naive['peak_after_reading_kb'] * 1024 / size:.2f}; naive / gptkiln = "
        f"{naive['peak_after_reading_kb'] / ours['peak_after_reading_kb']:.2f}x"
    )
    int8 = results["gptkiln int8"]["peak_after_reading_kb"] / ours["peak_after_reading_kb"]
    print(
        f"int8 run: file {q_size / 2**30:.2f} GiB ({q_size / size:.0%} of fp32's); its peak "
        f"{int8:.0%} of the fp32 load's (target < 40%: {'met' if int8 < 0.4 else 'MISSED'})"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_write":
        write_checkpoint(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "_quantize":
        quantize_run(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "_measure":
        print(json.dumps(measure(sys.argv[2], sys.argv[3])))
    else:
        main()
