"""What a LoRA run of the Qwen3-0.6B shape weighs on disk, file by file, against its base.

    python bench/lora_size.py [--dtype bfloat16|float32] [--keep DIR]

A Hugging Face directory of the Qwen3-0.6B shape (28 layers, width 1,024, 16 query and 8
key/value heads of 128, MLP 3,072, vocabulary 151,936, tied head: 596,049,920 parameters) with
random weights in ``--dtype`` is written by ``transformers`` (needs it installed), with the test
suite's small Qwen3 tokenizer and the real Qwen3-0.6B chat template; then ``gptkiln finetune
--task chat --train-layers lora`` (rank 16 on every projection, the default) takes 2 steps on 40
short conversations, and every file of the run is listed with its share of the base's
``model.safetensors``. The real Qwen3-0.6B tokenizer.json (about 11 MB) is not on this machine:
the one here is a few KB, so add about 0.9% (bf16 base) for a run of the real model. Takes a few
minutes on a 2-core CPU (two steps of the 0.6B model).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAKE_BASE = """
import sys
from pathlib import Path
import torch, transformers
sys.path.insert(0, {tests!r})
from hf_tokenizer_dirs import write_qwen3_dir
out, dtype = Path({out!r}), getattr(torch, {dtype!r})
write_qwen3_dir(out, template=Path({template!r}).read_text(encoding="utf-8"))
config = transformers.Qwen3Config(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    tie_word_embeddings=True, rope_theta=1000000,
)
with torch.device("meta"):
    model = transformers.Qwen3ForCausalLM(config)
model = model.to_empty(device="cpu").to(dtype)
model.tie_weights()
torch.manual_seed(0)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02)
model.save_pretrained(out)
"""


def conversations(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = i % 7, i % 5
        rows.append(
            {
                "messages": [
                    {"role": "system", "content": "You add numbers."},
                    {"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"It is {a + b}."},
                    {"role": "user", "content": "And times?"},
                    {"role": "assistant", "content": f"{a * b}."},
                ]
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--keep", metavar="DIR", help="work in DIR (kept) instead of a temp dir")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gptkiln-lora-size-") as scratch:
        work = Path(args.keep or scratch)
        work.mkdir(parents=True, exist_ok=True)
        base, run, data = work / "base", work / "run", work / "chats.json"
        script = MAKE_BASE.format(
            tests=str(ROOT / "tests"),
            out=str(base),
            dtype=args.dtype,
            template=str(ROOT / "tests" / "chat_templates" / "qwen3-0.6b.jinja"),
        )
        if not (base / "model.safetensors").is_file():
            subprocess.run([sys.executable, "-c", script], check=True)
        data.write_text(json.dumps(conversations(40)), encoding="utf-8")
        command = [
            sys.executable, "-m", "gptkiln", "finetune", str(base), "--task", "chat",
            "--data", str(data), "--train-layers", "lora", "--out", str(run), "--overwrite",
            "--max-steps", "2", "--batch-size", "2", "--eval-batches", "1",
            "--sample-interval", "1000", "--precision", "fp32", "--no-progress",
        ]  # fmt: skip
        print("$ python", " ".join(command[1:]), flush=True)
        subprocess.run(command, check=True)
        base_bytes = (base / "model.safetensors").stat().st_size
        print(f"\nbase model.safetensors ({args.dtype}): {base_bytes:,} bytes")
        total = 0
        for path in sorted(run.iterdir(), key=lambda p: -p.stat().st_size):
            if path.is_file():
                size = path.stat().st_size
                total += size
                print(f"  {path.name:24} {size:>12,} bytes  {100 * size / base_bytes:6.3f}%")
        print(f"  {'the run, all files':24} {total:>12,} bytes  {100 * total / base_bytes:6.3f}%")


if __name__ == "__main__":
    main()
