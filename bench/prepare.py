"""Tokenizing a corpus to disk, MB/s and peak RSS: gptkiln's ``prepare`` against tiktoken alone.

    python bench/prepare.py [--corpus SOURCE] [--sizes-mb 25 50 100] [--rounds 3]

The corpus (``--corpus``: a text file, a folder, or ``shakespeare``, the bundled plays, by
default) is read as gptkiln reads a source, its documents joined and repeated into a temporary
file of each size (one document). The figures in bench/README.md repeat tiny Shakespeare
(``--corpus ../shared/data/tinyshakespeare.txt``, nanoGPT's ``input.txt``). Every measurement
is a fresh process:

- gptkiln: ``gptkiln.data.prepare.prepare(path, out_dir, tokenizer="gpt2", progress=False,
  threads=2)``,
  the whole job: read the file, tokenize (GPT-2 BPE via tiktoken), write train.bin / val.bin.
- tiktoken: the same GPT-2 encoding's ``encode_ordinary_batch(pieces, num_threads=2)`` over the
  file's text, already in memory, cut into ~1 MB pieces at line ends; nothing is written. This
  is the speed of the encoder itself, the most prepare could reach.

MB = 10^6 bytes of UTF-8 text. Peak RSS is VmHWM of the worker process, so it includes the
interpreter and imports (numpy, tiktoken, torch is not imported by either).

Rounds run both processes once each, interleaved, per size (3 by default): ``ratio`` divides
the best rounds, ``ratio, paired rounds`` is the median of the ratios within each round. One
round alone swung from 0.91 to 1.22 between sizes on a noisy machine, with the encoder itself
moving between 12.6 and 21.7 MB/s.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

PIECE_BYTES = 1 << 20


def make_corpus(path: Path, size_mb: float, source: str) -> int:
    """Write the text of ``source`` repeated until ``size_mb`` MB are reached; returns the bytes."""
    from gptkiln.data.sources import iter_documents

    text = "".join(iter_documents(source)).encode("utf-8")
    copies = max(1, round(size_mb * 1e6 / len(text)))
    with open(path, "wb") as f:
        for _ in range(copies):
            f.write(text)
    return copies * len(text)


def worker(job: dict) -> None:
    path = Path(job["path"])
    size = path.stat().st_size
    if job["impl"] == "gptkiln":
        from gptkiln.data.prepare import prepare

        t0 = time.perf_counter()
        meta = prepare(path, job["out"], tokenizer="gpt2", progress=False, threads=job["threads"])
        sec = time.perf_counter() - t0
        tokens = meta["train_tokens"] + meta["val_tokens"]
    else:
        from gptkiln.tokenizers import GPT2Tokenizer

        encoding = GPT2Tokenizer()._encoding  # GPT-2's ranks, as tiktoken.get_encoding("gpt2")
        text = path.read_text(encoding="utf-8")
        pieces, start = [], 0
        while start < len(text):
            end = text.find("\n", start + PIECE_BYTES)
            end = len(text) if end < 0 else end + 1
            pieces.append(text[start:end])
            start = end
        t0 = time.perf_counter()
        ids = encoding.encode_ordinary_batch(pieces, num_threads=common.THREADS)
        sec = time.perf_counter() - t0
        tokens = sum(map(len, ids))
    common.emit(
        {"mb_per_s": size / 1e6 / sec, "seconds": sec, "tokens": tokens, "size_mb": size / 1e6}
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--corpus",
        default="shakespeare",
        help="the text to repeat: a .txt/.md/.jsonl file, a folder of them, or 'shakespeare' "
        "(the bundled plays; the default)",
    )
    p.add_argument("--sizes-mb", nargs="+", type=float, default=[25, 50, 100])
    p.add_argument("--rounds", type=int, default=3, help="interleaved repeats of every process")
    args = p.parse_args()
    from gptkiln.data.sources import check_source
    from gptkiln.errors import GptkilnError

    try:
        check_source(args.corpus)
    except GptkilnError as e:
        sys.exit(f"--corpus: {e}")

    info = common.print_machine()
    tmp = Path(tempfile.mkdtemp(prefix="gptkiln-bench-prepare-"))
    rows = []
    try:
        for size_mb in args.sizes_mb:
            path = tmp / f"corpus-{size_mb:g}mb.txt"
            make_corpus(path, size_mb, args.corpus)
            jobs = [
                dict(
                    impl=impl,
                    path=str(path),
                    out=str(tmp / f"out-{size_mb:g}"),
                    threads=common.THREADS,
                )
                for impl in ("gptkiln", "tiktoken")
            ]
            results = common.run_rounds(__file__, jobs, args.rounds, "mb_per_s")
            for job, r in zip(jobs, results):
                row = dict(impl=job["impl"], **r)
                if job["impl"] == "gptkiln":
                    row["ratio"] = common.ratio(r["mb_per_s"], results[1]["mb_per_s"])
                    row["ratio_paired"] = common.paired_ratio(
                        r["mb_per_s_rounds"], results[1]["mb_per_s_rounds"]
                    )
                rows.append(row)
            path.unlink()
            shutil.rmtree(tmp / f"out-{size_mb:g}", ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    common.print_table(
        rows,
        [
            ("size_mb", "corpus MB"),
            ("impl", "implementation"),
            ("mb_per_s", "MB/s"),
            ("ratio", "ratio vs tiktoken"),
            ("ratio_paired", "ratio, paired rounds"),
            ("seconds", "seconds"),
            ("tokens", "tokens"),
            ("peak_rss_mb", "peak RSS MB"),
            ("others_cores", "others' cores"),
        ],
    )
    print(
        f"\n# corpus: {args.corpus}, repeated; tiktoken = encode_ordinary_batch(num_threads="
        f"{common.THREADS}) of the text in memory; gptkiln = prepare() end to end (read, encode, "
        f"write); MB/s and seconds from the "
        f"best of {args.rounds} rounds; load average now "
        f"{common.machine()['loadavg_1m']:.2f} (at start {info['loadavg_1m']:.2f})"
    )


if __name__ == "__main__":
    job = common.worker_args()
    worker(job) if job is not None else main()
