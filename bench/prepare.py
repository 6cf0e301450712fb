"""Tokenizing a corpus to disk, MB/s, cores busy and peak RSS: gptkiln's ``prepare`` against
tiktoken alone, on a text file and on Parquet, for gpt2 and a trained BPE.

    python bench/prepare.py [--corpus SOURCE] [--sizes-mb 25 50 100] [--formats txt parquet]
                            [--tokenizers gpt2 bpe:16384] [--rounds 3]

The corpus (``--corpus``: anything gptkiln reads, ``shakespeare``, the bundled plays, by
default) is read as gptkiln reads a source, its documents joined and repeated until each size
is reached, then written in each format:

- ``txt``: one file, one document;
- ``parquet``: documents of about ``--doc-chars`` characters (cut at line ends) in a ``text``
  column, ``--row-group-rows`` rows a row group (pyarrow's default compression), as FineWeb and
  OpenWebText ship their shards.

The figures in bench/README.md repeat tiny Shakespeare (``--corpus
../shared/data/tinyshakespeare.txt``, nanoGPT's ``input.txt``). Every measurement is a fresh
process:

- gptkiln: ``gptkiln.data.prepare.prepare(path, out_dir, tokenizer=T, progress=False,
  threads=2)``, the whole job: read, tokenize, write train.bin / val.bin (for ``bpe:N``, also
  the pass that trains the BPE on the corpus);
- ``bpe:N training``: that training pass alone (`train_bpe_tokenizer` over the source's pieces),
  so the table shows where a BPE prepare's time goes;
- tiktoken: GPT-2's encoding, ``encode_ordinary_batch(texts, num_threads=2)`` in a loop over
  batches of about 8 MB of the same text, already in memory (1 MB pieces cut at line ends for
  ``txt``; the documents for ``parquet``); nothing is written. This is the speed of the encoder
  itself, the ratio's denominator for every row of its size and format.

MB = 10^6 bytes of UTF-8 text. ``cores busy`` is the process's CPU time over its wall time
while timed (2.0 = both threads busy the whole time). Peak RSS is VmHWM of the worker process,
so it includes the interpreter and imports (numpy, tiktoken, pyarrow; torch is not imported).
Hugging Face ``tokenizers`` gets ``TOKENIZERS_PARALLELISM=true`` and 2 Rayon threads.

Rounds run every process once each, interleaved, per size (3 by default): ``ratio`` divides
the best rounds, ``ratio, paired rounds`` is the median of the ratios within each round.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

PIECE_BYTES = 1 << 20
BATCH_CHARS = 8 << 20


def corpus_text(source: str) -> str:
    from gptkiln.data.sources import iter_documents

    return "".join(iter_documents(source))


def make_txt(path: Path, size_mb: float, text: str) -> int:
    """Write ``text`` repeated until ``size_mb`` MB are reached; returns the bytes."""
    data = text.encode("utf-8")
    copies = max(1, round(size_mb * 1e6 / len(data)))
    with open(path, "wb") as f:
        for _ in range(copies):
            f.write(data)
    return copies * len(data)


def make_parquet(path: Path, size_mb: float, text: str, doc_chars: int, row_group_rows: int) -> int:
    """Write documents of ``text`` (about ``doc_chars`` each, cut at line ends), repeated until
    ``size_mb`` MB, as a Parquet file; returns the bytes of text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs, start = [], 0
    while start < len(text):
        end = text.find("\n", start + doc_chars)
        end = len(text) if end < 0 else end + 1
        docs.append(text[start:end])
        start = end
    sizes = [len(d.encode("utf-8")) for d in docs]
    target, written, rows = size_mb * 1e6, 0, []
    schema = pa.schema([("text", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        i = 0
        while written < target:
            rows.append(docs[i % len(docs)])
            written += sizes[i % len(docs)]
            i += 1
            if len(rows) == row_group_rows:
                writer.write_table(pa.table({"text": rows}, schema=schema))
                rows = []
        if rows:
            writer.write_table(pa.table({"text": rows}, schema=schema))
    return written


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def worker(job: dict) -> None:
    # Rayon threads for Hugging Face tokenizers (the driver turns its parallelism off)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    os.environ["RAYON_NUM_THREADS"] = str(job["threads"])
    path = Path(job["path"])
    size = job["text_bytes"]
    if job["impl"] == "gptkiln":
        from gptkiln.data.prepare import prepare

        t0, c0 = time.perf_counter(), _cpu_seconds()
        meta = prepare(
            path, job["out"], tokenizer=job["tokenizer"], progress=False, threads=job["threads"]
        )
        sec, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
        tokens = meta["train_tokens"] + meta["val_tokens"]
    elif job["impl"] == "bpe-train":
        from gptkiln.data.sources import iter_pieces
        from gptkiln.tokenizers import parse_tokenizer_spec, train_bpe_tokenizer

        vocab_size = parse_tokenizer_spec(job["tokenizer"])[1]
        t0, c0 = time.perf_counter(), _cpu_seconds()
        train_bpe_tokenizer((text for _, text in iter_pieces(path)), vocab_size)
        sec, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
        tokens = None
    else:
        from gptkiln.tokenizers import GPT2Tokenizer

        encoding = GPT2Tokenizer()._encoding  # GPT-2's ranks, as tiktoken.get_encoding("gpt2")
        batches = _baseline_batches(path)
        t0, c0 = time.perf_counter(), _cpu_seconds()
        tokens = 0
        for batch in batches:
            ids = encoding.encode_ordinary_batch(batch, num_threads=job["threads"])
            tokens += sum(map(len, ids))
        sec, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    common.emit(
        {
            "mb_per_s": size / 1e6 / sec,
            "seconds": sec,
            "cores_busy": cpu / sec,
            "tokens": tokens,
            "size_mb": size / 1e6,
        }
    )


def _baseline_batches(path: Path) -> list[list[str]]:
    """The text of ``path`` in memory, as the baseline encodes it: batches of ~8 MB."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        texts = pq.read_table(path, columns=["text"]).column(0).to_pylist()
    else:
        text = path.read_text(encoding="utf-8")
        texts, start = [], 0
        while start < len(text):
            end = text.find("\n", start + PIECE_BYTES)
            end = len(text) if end < 0 else end + 1
            texts.append(text[start:end])
            start = end
    batches, batch, chars = [], [], 0
    for t in texts:
        batch.append(t)
        chars += len(t)
        if chars >= BATCH_CHARS:
            batches.append(batch)
            batch, chars = [], 0
    return batches + ([batch] if batch else [])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--corpus",
        default="shakespeare",
        help="the text to repeat: any source gptkiln reads, or 'shakespeare' (the bundled "
        "plays; the default)",
    )
    p.add_argument("--sizes-mb", nargs="+", type=float, default=[25, 50, 100])
    p.add_argument("--formats", nargs="+", choices=["txt", "parquet"], default=["txt", "parquet"])
    p.add_argument(
        "--tokenizers",
        nargs="+",
        default=["gpt2"],
        help="gptkiln's tokenizers to time: gpt2 and/or bpe:N (default: gpt2)",
    )
    p.add_argument("--doc-chars", type=int, default=4000, help="characters a Parquet document")
    p.add_argument("--row-group-rows", type=int, default=1000, help="rows a Parquet row group")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repeats of every process")
    args = p.parse_args()
    from gptkiln.data import check_source
    from gptkiln.errors import GptkilnError
    from gptkiln.tokenizers import parse_tokenizer_spec

    try:
        check_source(args.corpus)
        for spec in args.tokenizers:
            parse_tokenizer_spec(spec)
    except GptkilnError as e:
        sys.exit(str(e))

    info = common.print_machine()
    text = corpus_text(args.corpus)
    tmp = Path(tempfile.mkdtemp(prefix="gptkiln-bench-prepare-"))
    rows = []
    try:
        for size_mb in args.sizes_mb:
            for fmt in args.formats:
                rows += _measure(tmp, size_mb, fmt, text, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    common.print_table(
        rows,
        [
            ("size_mb", "corpus MB"),
            ("format", "format"),
            ("impl", "implementation"),
            ("mb_per_s", "MB/s"),
            ("ratio", "ratio vs tiktoken"),
            ("ratio_paired", "ratio, paired rounds"),
            ("seconds", "seconds"),
            ("cores_busy", "cores busy"),
            ("tokens", "tokens"),
            ("peak_rss_mb", "peak RSS MB"),
            ("others_cores", "others' cores"),
        ],
    )
    print(
        f"\n# corpus: {args.corpus}, repeated; tiktoken = GPT-2's encode_ordinary_batch("
        f"num_threads={common.THREADS}) over ~8 MB batches of the text in memory; gptkiln = "
        f"prepare() end to end (read, [train a BPE,] encode, write); MB/s and seconds from the "
        f"best of {args.rounds} rounds; Parquet: ~{args.doc_chars} characters a document, "
        f"{args.row_group_rows} rows a row group; load average now "
        f"{common.machine()['loadavg_1m']:.2f} (at start {info['loadavg_1m']:.2f})"
    )


def _measure(tmp: Path, size_mb: float, fmt: str, text: str, args) -> list[dict]:
    """The rows of one size and format: tiktoken, then each of gptkiln's tokenizers."""
    path = tmp / f"corpus-{size_mb:g}mb.{fmt}"
    if fmt == "txt":
        text_bytes = make_txt(path, size_mb, text)
    else:
        text_bytes = make_parquet(path, size_mb, text, args.doc_chars, args.row_group_rows)
    base = dict(path=str(path), text_bytes=text_bytes, threads=common.THREADS)
    jobs = [dict(base, impl="tiktoken", label="tiktoken gpt2")]
    for spec in args.tokenizers:
        out = str(tmp / f"out-{size_mb:g}-{fmt}")
        jobs.append(dict(base, impl="gptkiln", tokenizer=spec, out=out, label=f"gptkiln {spec}"))
        if spec.startswith("bpe"):
            jobs.append(dict(base, impl="bpe-train", tokenizer=spec, label=f"{spec} training"))
    results = common.run_rounds(__file__, jobs, args.rounds, "mb_per_s")
    baseline = results[0]
    rows = []
    for job, r in zip(jobs, results):
        row = dict(r, impl=job["label"], format=fmt)
        if job["impl"] != "tiktoken":
            row["ratio"] = common.ratio(r["mb_per_s"], baseline["mb_per_s"])
            row["ratio_paired"] = common.paired_ratio(
                r["mb_per_s_rounds"], baseline["mb_per_s_rounds"]
            )
        rows.append(row)
    path.unlink()
    shutil.rmtree(tmp / f"out-{size_mb:g}-{fmt}", ignore_errors=True)
    return rows


if __name__ == "__main__":
    job = common.worker_args()
    worker(job) if job is not None else main()
