"""lm-evaluation-harness wall time: gptkiln's backend against the harness's own ``hf`` backend on
the same weights, one task per kind of request.

    python bench/evaluate.py [--questions 100] [--prompts 200] [--documents 100]
                             [--max-gen-toks 32] [--batch-size 16] [--rounds 1] [--work DIR]

A GPT-2 124M-shaped run with random weights (GPT-2's tokenizer, context 1,024, fp32, 2 threads),
saved by gptkiln and exported with ``gptkiln.convert.export_hf``; the ``hf`` backend
(``lm_eval.models.huggingface.HFLM``: transformers' GPT2LMHeadModel, SDPA attention, float32,
its logits cache on, as the harness runs it) reads that export, gptkiln's backend
(``gptkiln.evaluate.GptkilnLM``) the run. Three tasks are written here over the bundled plays
(local JSON Lines read by the harness's ``json`` loader; nothing is downloaded):

- ``mc``, multiple choice: ``--questions`` passages of 60 words, each with 4 continuations of
  12-20 words (4 loglikelihood requests a question; HellaSwag's shape), acc and acc_norm.
- ``gen``, generate_until: ``--prompts`` passages of 30 words, until a blank line, at most
  ``--max-gen-toks`` tokens (random weights never write a blank line, so every request
  generates them all, on both backends), greedy, exact_match.
- ``roll``, loglikelihood_rolling: ``--documents`` passages of 80 to 1,500 words (the longest
  are two or three windows of 1,024 tokens), word and byte perplexity.

Each (backend, task) runs in a fresh process: it loads its model and builds the task untimed,
then times the harness's evaluation of that task (``simple_evaluate`` on the built task,
bootstrap off): the requests and the harness's own work around them, the same for both. The
ratio is hf's seconds over gptkiln's. The metrics of both are printed: on the same weights they
agree (the tests check the per-request figures to 1e-4). gptkiln's process keeps freed memory
for reuse (`gptkiln.allocator`), as ``gptkiln evaluate`` and ``lm_eval --model gptkiln`` set it
on the CPU; the ``hf`` backend's runs as ``lm_eval --model hf`` leaves it, unless
``--hf-keeps-freed-memory`` gives it the same.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

SHAPE = dict(vocab=50257, context=1024, n_layer=12, n_head=12, n_embd=768)
TASKS = ("mc", "gen", "roll")
IMPLS = ("gptkiln", "hf")


# -- the run and the tasks -----------------------------------------------------------------------
def words_of_the_plays(count: int) -> list[str]:
    from gptkiln.data.sources import iter_documents

    words: list[str] = []
    for document in iter_documents("shakespeare"):
        words.extend(document.split())
        if len(words) >= count:
            return words
    return words


def write_task(folder: Path, name: str, rows: list[dict], body: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    head = (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"  cache_dir: {folder / 'cache'}\ntest_split: test\n"
    )
    (folder / f"{name}.yaml").write_text(head + body, encoding="utf-8")


def write_tasks(folder: Path, questions: int, prompts: int, documents: int, max_gen: int) -> None:
    rng = random.Random(0)
    words = words_of_the_plays(200_000)

    def passage(n: int) -> str:
        start = rng.randrange(len(words) - n)
        return " ".join(words[start : start + n])

    folder.mkdir(parents=True, exist_ok=True)
    mc = [
        {"ctx": passage(60), "endings": [" " + passage(rng.randint(12, 20)) for _ in range(4)],
         "label": rng.randrange(4)}
        for _ in range(questions)
    ]  # fmt: skip
    write_task(
        folder,
        "mc",
        mc,
        'output_type: multiple_choice\ndoc_to_text: "{{ctx}}"\ndoc_to_target: label\n'
        "doc_to_choice: endings\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
    )
    gen = [{"prompt": passage(30), "target": passage(3)} for _ in range(prompts)]
    write_task(
        folder,
        "gen",
        gen,
        'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
        f'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: {max_gen}\n'
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n",
    )
    roll = [{"text": passage(rng.randint(80, 1500))} for _ in range(documents)]
    write_task(
        folder,
        "roll",
        roll,
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n",
    )


def build(work: Path, args) -> None:
    """The run, its Hugging Face export, the tasks (in ``work``)."""
    import torch

    from gptkiln.checkpoint import save_model
    from gptkiln.convert import export_hf
    from gptkiln.tokenizers import load_tokenizer

    torch.manual_seed(0)
    model = common.gptkiln_gpt(SHAPE).eval()
    save_model(model, work / "run", tokenizer=load_tokenizer("gpt2"))
    export_hf(work / "run", work / "hf", overwrite=True)
    write_tasks(work / "tasks", args.questions, args.prompts, args.documents, args.max_gen_toks)


# -- one measurement ----------------------------------------------------------------------------
def worker(job: dict) -> None:
    common.setup_torch(job["threads"])
    from gptkiln.evaluate import GptkilnLM, flat_metrics, load_tasks, run_harness

    if job["impl"] == "gptkiln" or job["hf_keeps_freed_memory"]:
        from gptkiln.allocator import keep_freed_memory

        keep_freed_memory()  # as `gptkiln evaluate` and `lm_eval --model gptkiln` do on the CPU
    work = Path(job["work"])
    manager, built = load_tasks(job["task"], work / "tasks")
    t0 = time.perf_counter()
    if job["impl"] == "gptkiln":
        lm = GptkilnLM(
            str(work / "run"), batch_size=job["batch_size"], dtype=job["dtype"], progress=False
        )
    else:
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=str(work / "hf"), device="cpu", batch_size=job["batch_size"],
                  dtype=job["dtype"])  # fmt: skip
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    results = run_harness(lm, manager, built, bootstrap_iters=0)
    seconds = time.perf_counter() - t0
    requests = sum(n["effective"] for n in results["n-samples"].values())
    common.emit(
        {
            "impl": job["impl"],
            "task": job["task"],
            "seconds": seconds,
            "load_s": load_s,
            "documents": requests,
            "metrics": flat_metrics(results),
        }
    )


# -- the driver ---------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--questions", type=int, default=100, help="mc: 4 requests each")
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--documents", type=int, default=100)
    p.add_argument("--max-gen-toks", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16, help="both backends'")
    p.add_argument("--rounds", type=int, default=1, help="interleaved repeats of every process")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="both backends' weights (bfloat16: where the CPU has AMX or AVX512-BF16)",
    )
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument(
        "--hf-keeps-freed-memory",
        action="store_true",
        help="the hf backend's process keeps freed memory too, as gptkiln's does (lm_eval's own "
        "command does not): like for like on the allocator",
    )
    p.add_argument("--work", type=Path, help="where the run and tasks go (default: a temp dir)")
    args = p.parse_args()
    info = common.print_machine()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        build(work, args)
        rows = []
        for task in args.tasks:
            jobs = [
                dict(impl=impl, task=task, work=str(work), batch_size=args.batch_size,
                     dtype=args.dtype, threads=common.THREADS,
                     hf_keeps_freed_memory=args.hf_keeps_freed_memory)
                for impl in IMPLS
            ]  # fmt: skip
            ours, theirs = common.run_rounds(__file__, jobs, args.rounds, "seconds", best="min")
            pair = common.paired_ratio(theirs["seconds_rounds"], ours["seconds_rounds"])
            for r in (ours, theirs):
                r["ratio"] = common.ratio(theirs["seconds"], r["seconds"])
                r["ratio_paired"] = pair if args.rounds > 1 else None
                r["metrics_text"] = ", ".join(f"{k.split('/')[1]} {v:.4g}"
                                              for k, v in r["metrics"].items())  # fmt: skip
            rows += [ours, theirs]
    common.print_table(
        rows,
        [
            ("task", "task"),
            ("impl", "backend"),
            ("documents", "documents"),
            ("seconds", "seconds"),
            ("ratio", "hf s / this s"),
            ("ratio_paired", "ratio, paired rounds"),
            ("load_s", "load s"),
            ("peak_rss_mb", "peak RSS MB"),
            ("others_cores", "others' cores"),
            ("metrics_text", "metrics"),
        ],
    )
    total = {i: sum(r["seconds"] for r in rows if r["impl"] == i) for i in IMPLS}
    print(
        f"\n# all tasks: gptkiln {total['gptkiln']:.1f} s, hf {total['hf']:.1f} s, ratio "
        f"{total['hf'] / total['gptkiln']:.2f}; {args.questions} questions x 4 choices, "
        f"{args.prompts} prompts x {args.max_gen_toks} tokens, {args.documents} documents; "
        f"batch size {args.batch_size}; {args.dtype}; hf keeps freed memory: "
        f"{'yes' if args.hf_keeps_freed_memory else 'no (as lm_eval runs it)'}; "
        f"load average now {common.machine()['loadavg_1m']:.2f} "
        f"(at start {info['loadavg_1m']:.2f})"
    )


if __name__ == "__main__":
    job = common.worker_args()
    worker(job) if job is not None else main()
