"""Generation: filters, greedy, seeds, end-of-text, batches, streaming, and the KV cache."""

import pytest
import torch

from gptkiln.config import GPTConfig, SampleConfig
from gptkiln.cpu import planned
from gptkiln.errors import GptkilnError
from gptkiln.model import GPT
from gptkiln.sampling import generate, generate_stream, left_pad, logits_to_probs, sample


@pytest.fixture(scope="module")
def model() -> GPT:
    # Untied: a fresh tied model's greedy output is its last prompt token over and over (the
    # head is the embedding itself), so a token-level comparison would hide any other change.
    torch.manual_seed(0)
    config = GPTConfig.from_name("tiny", vocab_size=64, context_length=24, tie_embeddings=False)
    return GPT(config).eval()


def test_the_fixture_model_does_not_just_repeat_a_token(model):
    for prompt in ([1, 2, 3], [37, 43, 12, 8, 63, 9, 11]):
        assert len(set(generate(model, prompt, max_new_tokens=10, temperature=0))) >= 4


def test_top_k_keeps_exactly_k_tokens():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    probs = logits_to_probs(logits, top_k=2)
    assert (probs > 0).sum().item() == 2
    assert probs[0, 1] > probs[0, 3] > 0 and probs[0, [0, 2, 4]].sum() == 0
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs_in = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs_in.log()
    kept = logits_to_probs(logits, top_p=0.75) > 0
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.75 <= 0.8
    assert (logits_to_probs(logits, top_p=0.5) > 0).sum() == 1  # the top token alone reaches it
    torch.testing.assert_close(logits_to_probs(logits, top_p=1.0), probs_in)


def whole_sort_top_p(logits, temperature, top_k, top_p):
    """Top-k then top-p as the filters are defined: every row's probabilities sorted whole; top-p
    keeps the fewest most likely that reach it, and every token as likely as the last."""
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    ranked, ids = torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)
    needed = ranked.cumsum(dim=-1) - ranked < top_p  # the fewest that reach top_p
    edge = torch.where(needed, ranked, float("inf")).amin(dim=-1, keepdim=True)
    ranked = ranked.masked_fill(~needed & (ranked != edge), 0.0)  # and any as likely as the last
    probs = torch.zeros_like(ranked).scatter_(-1, ids, ranked)
    return probs / probs.sum(dim=-1, keepdim=True)


def test_top_p_keeps_every_token_as_likely_as_the_last_it_needs():
    """Where top-p's nucleus ends on equal probabilities it keeps them all, as top-k keeps every
    token tied with its k-th: what it keeps never depends on how ties are ranked."""
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.2, 0.0], [0.1, 0.2, 0.3, 0.2, 0.2]])
    kept = logits_to_probs(probs.log(), 1.0, None, 0.5)
    assert (kept > 0).tolist() == [[True] * 4 + [False], [False] + [True] * 4]
    torch.testing.assert_close(kept[0, :4], torch.tensor([0.4, 0.2, 0.2, 0.2]))
    edge = logits_to_probs(probs.log(), 1.0, None, 0.3)  # 0.4 alone reaches it in row 0
    assert (edge[0] > 0).tolist() == [True, False, False, False, False]
    shuffled = probs[:, torch.randperm(5, generator=torch.Generator().manual_seed(1))]
    again = logits_to_probs(shuffled.log(), 1.0, None, 0.5)
    assert torch.equal((again > 0).sum(dim=-1), (kept > 0).sum(dim=-1))
    # on the CPU's ranked candidates: the tie runs on past the first 256 the nucleus ends in
    vocab = 50257
    row = torch.full((vocab,), 0.1 / (vocab - 1010))
    row[:10], row[10:1010] = 0.05, 0.0004  # top-p 0.55 ends 125 into 1,000 equal ones
    row = row[torch.randperm(vocab, generator=torch.Generator().manual_seed(2))]
    wide = logits_to_probs(row.log()[None], 1.0, None, 0.55)
    assert (wide > 0).sum() == 1010
    assert torch.equal(wide > 0, whole_sort_top_p(row.log()[None], 1.0, None, 0.55) > 0)


def test_top_p_ranks_a_rows_likeliest_ids_first_and_sorts_only_the_rows_that_need_it(
    monkeypatch,
):
    """On the CPU top-p ranks a row's 256, then 4,096 most likely ids before it sorts the whole
    row, and sorts at once a row that cannot do with them; every row keeps the tokens a whole
    sort keeps, and gets in a batch exactly what it gets alone."""
    import gptkiln.sampling as sampling

    gen = torch.Generator().manual_seed(0)
    vocab = 50257
    rank = torch.arange(1, vocab + 1, dtype=torch.float32)
    shuffled = lambda law: law[torch.randperm(vocab, generator=gen)]  # noqa: E731
    spike = torch.full((vocab,), 0.5 / (vocab - 10))
    spike[:10] = 0.05  # half the mass in 10 ids, the rest flat
    logits = torch.stack(
        [
            torch.randn(vocab, generator=gen) * 12,  # steep: its 256 most likely suffice
            shuffled(-1.2 * rank.log()),  # Zipf 1.2: top-p keeps ~2,000 ids, 4,096 suffice
            shuffled(spike.log()),  # 0.9 is ~40,000 ids past the first 256: sorted
            torch.randn(vocab, generator=gen) * 0.3,  # near-uniform: sorted, nothing ranked
        ]
    )
    calls = []
    real_sort, real_topk = torch.sort, torch.topk

    def sort(x, *args, **kwargs):
        calls.append(("sort", x.shape[0]))
        return real_sort(x, *args, **kwargs)

    def topk(x, k, *args, **kwargs):
        calls.append((k, x.shape[0]))
        return real_topk(x, k, *args, **kwargs)

    monkeypatch.setattr(torch, "sort", sort)
    monkeypatch.setattr(torch, "topk", topk)
    for top_k in (None, 40, 3000):
        calls.clear()
        probs = logits_to_probs(logits, 1.0, top_k, 0.9)
        if top_k is None:  # 256 for three rows, 4,096 for one, two rows sorted together
            assert calls == [(256, 3), (4096, 1), ("sort", 2)]
            assert (probs > 0).sum(dim=-1)[1] > 256  # the Zipf row needed the second ranking
        if top_k == 40:  # top-k's own ranking serves, but for the spike row: its flat rest is
            assert calls == [(40, 4), ("sort", 1)]  # one tie at the 40th, which top-k keeps
        want = whole_sort_top_p(logits, 1.0, top_k, 0.9)
        assert torch.equal(probs > 0, want > 0)
        torch.testing.assert_close(probs, want, atol=1e-6, rtol=1e-5)
        for row in range(4):
            alone = logits_to_probs(logits[row : row + 1], 1.0, top_k, 0.9)
            assert torch.equal(probs[row], alone[0])
    assert sampling.NUCLEUS_CANDIDATES[-1] < vocab


def test_top_p_gives_a_row_in_a_batch_exactly_what_it_gives_the_row_alone():
    """Each row renormalised by its own running sum: torch sums one row alone in two threads' halves
    and a batch's rows each in one, which rounds a row otherwise (the whole sort's
    renormalisation did, in about a third of rows); so this runs on two threads."""
    gen = torch.Generator().manual_seed(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _each_row_as_alone(gen)
    finally:
        torch.set_num_threads(threads)


def _each_row_as_alone(gen: torch.Generator) -> None:
    for trial in range(6):
        scale = torch.tensor([[0.3], [0.5], [1.0], [4.0], [8.0]])[torch.randperm(5, generator=gen)]
        logits = torch.randn(5, 50257, generator=gen) * scale
        top_k = (None, 40, 500)[trial % 3]
        batch = logits_to_probs(logits, 0.9, top_k, 0.9)
        for row in range(5):
            alone = logits_to_probs(logits[row : row + 1], 0.9, top_k, 0.9)[0]
            assert torch.equal(batch[row], alone), (trial, row)


def test_compiled_top_p_sorts_whole_and_keeps_what_eager_keeps():
    """Under torch.compile (a CUDA graph's step) top-p takes the whole sort: the candidates'
    checks are data-dependent branches a full graph cannot hold."""
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2)) * 4
    compiled = torch.compile(logits_to_probs, backend="aot_eager", fullgraph=True, dynamic=False)
    for top_k in (None, 50):
        got, want = compiled(logits, 0.8, top_k, 0.9), logits_to_probs(logits, 0.8, top_k, 0.9)
        assert torch.equal(got > 0, want > 0)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_top_p_after_a_tie_at_top_ks_edge_ranks_every_token_top_k_kept():
    """Top-k keeps every token tied with its k-th; top-p then ranks them all (the k most likely
    alone would miss one), as a whole sort does."""
    logits = torch.tensor([[5.0, 1.0, 4.0, 4.0, 0.0, 4.0] + [-3.0] * 300])
    probs = logits_to_probs(logits, 1.0, top_k=2, top_p=0.99)
    assert (probs > 0).sum() == 4  # 5 and the three 4s: top-p 0.99 needs them all
    torch.testing.assert_close(probs, whole_sort_top_p(logits, 1.0, 2, 0.99))


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    cold, warm = logits_to_probs(logits, 0.5), logits_to_probs(logits, 2.0)
    assert cold[0, 2] > logits_to_probs(logits, 1.0)[0, 2] > warm[0, 2]


def test_greedy_is_argmax_and_sampling_is_seeded():
    logits = torch.randn(3, 10)
    assert torch.equal(sample(logits, temperature=0), logits.argmax(-1))
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    draws1 = [sample(logits, 1.0, generator=g1) for _ in range(5)]
    draws2 = [sample(logits, 1.0, generator=g2) for _ in range(5)]
    assert all(torch.equal(a, b) for a, b in zip(draws1, draws2))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_new_tokens=-1), "max_new"),
    ],
)
def test_invalid_sampling_values_raise(kwargs, message):
    with pytest.raises(GptkilnError, match=message):
        SampleConfig(**kwargs)


@pytest.mark.parametrize("prompt_len", [1, 2, 7, 16, 23, 24, 30])
def test_kv_cache_greedy_equals_no_cache(model, prompt_len):
    # Lengths past the context (24) crop the prompt; 20 new tokens slide past it too.
    prompt = torch.randint(0, 64, (prompt_len,), generator=torch.Generator().manual_seed(1))
    with_cache = generate(model, prompt.tolist(), max_new_tokens=20, temperature=0)
    without = generate(model, prompt.tolist(), max_new_tokens=20, temperature=0, use_cache=False)
    assert len(with_cache) == 20
    assert with_cache == without


def test_no_cache_path_is_the_books_generate_text_simple(model):
    prompt = [5, 9, 2, 33]
    idx = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(10):  # generate_text_simple, spelled out
            logits = model(idx[:, -24:])[:, -1, :]
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    assert generate(model, prompt, max_new_tokens=10, temperature=0) == idx[0, 4:].tolist()


def test_batched_prompts_of_unequal_length_match_one_by_one(model):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    batch = generate(model, prompts, max_new_tokens=12, temperature=0)
    assert batch == [generate(model, p, max_new_tokens=12, temperature=0) for p in prompts]


def test_padded_rows_through_the_cache_give_each_rows_own_logits(model):
    # Logits, not tokens: every real position of a left-padded row, in the prefill and in a
    # decode step, equals the row run alone without cache or padding (padding mask + causality).
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    idx, pad_lens = left_pad(prompts, 0, torch.device("cpu"))
    nxt = torch.tensor([[12], [13], [14]])
    with torch.no_grad():
        model.setup_cache(3, 12, pad_lens)
        try:
            prefilled = model(idx, start_pos=0)  # (3, 7, V)
            stepped = model(nxt, start_pos=idx.size(1))  # (3, 1, V)
        finally:
            model.clear_cache()
        for row, prompt in enumerate(prompts):
            alone = model(torch.tensor([prompt + [int(nxt[row])]]))[0]  # (len + 1, V)
            pad = idx.size(1) - len(prompt)
            torch.testing.assert_close(prefilled[row, pad:], alone[:-1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(stepped[row, 0], alone[-1], atol=1e-5, rtol=1e-5)


def test_padded_rows_with_the_explicit_attention_give_each_rows_own_tokens(model):
    # The explicit ("math") attention: a padded slot's query sees no key at all, and its NaN
    # must not reach the row's real tokens (through V, in the next layer).
    import dataclasses

    math_model = GPT(dataclasses.replace(model.config, attention="math")).eval()
    math_model.load_state_dict(model.state_dict())
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    batch = generate(math_model, prompts, max_new_tokens=12, temperature=0)
    assert batch == [generate(model, p, max_new_tokens=12, temperature=0) for p in prompts]
    sampled = generate(math_model, prompts, max_new_tokens=6, temperature=1.0, seed=3)
    assert all(0 <= t < 64 for row in sampled for t in row)


def test_kernels_tuned_for_fp32_step_aside_when_the_model_changes_dtype(model):
    import copy

    from gptkiln.cpu import prepare_for_decoding, specs
    from gptkiln.model import Linear

    if "onednn" not in specs.offered("float32", "fp32"):
        pytest.skip("this torch build has no oneDNN linear")
    tuned = copy.deepcopy(model)
    prompts = [[1, 2, 3]] * 8
    prepare = prepare_for_decoding  # tunes for 8 rows
    expected = generate(tuned, prompts, max_new_tokens=4, temperature=0, prepare=prepare)
    for layer in tuned.modules():  # oneDNN's linear, which takes no float64, for every layer
        if isinstance(layer, Linear):
            planned.give_kernel(layer, 8, specs.BY_NAME["onednn"].kernel)
    tuned.double()
    assert generate(tuned, prompts, max_new_tokens=4, temperature=0) == expected


def test_a_prompt_may_be_a_tensor_or_an_array(model):
    import numpy as np

    alone = generate(model, [5, 6, 7], max_new_tokens=4, temperature=0)
    assert generate(model, torch.tensor([5, 6, 7]), max_new_tokens=4, temperature=0) == alone
    assert generate(model, np.array([5, 6, 7]), max_new_tokens=4, temperature=0) == alone
    batch = generate(model, torch.tensor([[5, 6, 7], [5, 6, 7]]), max_new_tokens=4, temperature=0)
    assert batch == [alone, alone]


def test_a_tiny_temperature_is_greedy_not_a_crash(model):
    # 1 / 1e-39 overflows float32: unshifted, the top logits became inf and softmax NaN
    probs = logits_to_probs(torch.tensor([[1.0, 2.0, -1.0], [1.0, 2.0, 2.0]]), 1e-39)
    assert probs.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.5, 0.5]]
    greedy = generate(model, [5, 6, 7], max_new_tokens=5, temperature=0)
    assert generate(model, [5, 6, 7], max_new_tokens=5, temperature=1e-39, seed=0) == greedy


def test_a_prompt_fed_in_chunks_through_the_cache_is_causal(model):
    seq = torch.tensor([[5, 9, 2, 33, 40, 17, 8, 21, 3]])
    with torch.no_grad():
        full = model(seq)
        model.setup_cache(1, 12)
        try:
            chunks = [model(seq[:, :4], start_pos=0), model(seq[:, 4:], start_pos=4)]
        finally:
            model.clear_cache()
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=1e-5)


def test_seeded_sampling_is_reproducible_and_seeds_differ(model):
    cfg = SampleConfig(max_new_tokens=15, temperature=1.0, top_k=20, seed=3)
    a, b = generate(model, [1, 2], cfg), generate(model, [1, 2], cfg)
    c = generate(model, [1, 2], cfg, seed=4)
    assert a == b and a != c


def test_end_of_text_stops_generation(model):
    greedy = generate(model, [1, 2, 3], max_new_tokens=10, temperature=0)
    eot = greedy[3]  # pretend the 4th greedy token is end-of-text
    stopped = generate(model, [1, 2, 3], max_new_tokens=10, temperature=0, eot_id=eot)
    assert stopped == greedy[: greedy.index(eot)]
    kept = generate(
        model, [1, 2, 3], max_new_tokens=10, temperature=0, eot_id=eot, stop_at_eos=False
    )
    assert kept == greedy


def test_the_stream_stops_at_end_of_text_and_a_finished_row_keeps_yielding_it(model):
    cfg = SampleConfig(max_new_tokens=10, temperature=0)
    greedy = {p: generate(model, list(p), cfg) for p in [(1, 2, 3), (4, 5, 6)]}
    # end-of-text: a token the first row makes early on and the second row never makes
    eot = next((t for t in greedy[(1, 2, 3)][1:6] if t not in greedy[(4, 5, 6)]), None)
    if eot is None:
        pytest.skip("the fixture's two rows share their early greedy tokens")
    ends = {p: g.index(eot) if eot in g else None for p, g in greedy.items()}
    alone = [int(t) for t in generate_stream(model, [[1, 2, 3]], cfg, eot_id=eot)]
    assert alone == greedy[(1, 2, 3)][: ends[(1, 2, 3)] + 1]  # the end-of-text, then stop
    steps = torch.stack(list(generate_stream(model, [[1, 2, 3], [4, 5, 6]], cfg, eot_id=eot)))
    last = ends[(4, 5, 6)]
    assert len(steps) == (10 if last is None else last + 1)
    assert steps[:, 0].tolist() == alone + [eot] * (len(steps) - len(alone))
    assert steps[:, 1].tolist() == greedy[(4, 5, 6)][: len(steps)]


def test_stream_yields_one_token_per_step(model):
    steps = list(generate_stream(model, [[1, 2, 3]], SampleConfig(max_new_tokens=6, temperature=0)))
    assert len(steps) == 6 and all(s.shape == (1,) for s in steps)
    assert [int(s) for s in steps] == generate(model, [1, 2, 3], max_new_tokens=6, temperature=0)


def test_generate_restores_training_mode_and_clears_the_cache(model):
    model.train()
    generate(model, [1, 2], max_new_tokens=3, temperature=0)
    assert model.training and model.cache_len == 0
    model.eval()


def test_generation_leaves_the_module_structure_as_it_was():
    """What torch.compile guards on: a sample during compiled training must not recompile it."""
    model = GPT(GPTConfig.from_name("tiny", vocab_size=64, context_length=24))
    before = {name: list(m._modules) for name, m in model.named_modules()}
    generate(model, [[1, 2], [3, 4]], max_new_tokens=3, temperature=0)
    assert {name: list(m._modules) for name, m in model.named_modules()} == before


@pytest.mark.slow
def test_a_sample_does_not_recompile_a_compiled_training_step():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=61, context_length=16))
    compiled = torch.compile(model)
    x = torch.randint(0, 61, (2, 16))
    torch._dynamo.reset()
    counters.clear()
    compiled(x, x)[1].backward()
    graphs = counters["stats"]["unique_graphs"]
    generate(model, [1, 2, 3], max_new_tokens=4, temperature=0)  # KV cache set up and cleared
    compiled(x, x)[1].backward()
    assert graphs >= 1 and counters["stats"]["unique_graphs"] == graphs


def test_empty_prompt_is_an_error(model):
    with pytest.raises(GptkilnError, match="at least one token"):
        generate(model, [[]], max_new_tokens=3)


# -- stop strings, penalties, a generator a row, empty prompts -------------------------------
def test_penalties_are_openais_formula():
    from gptkiln.logits_processors import apply_penalties

    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    counts = torch.tensor([[0.0, 1.0, 3.0, 0.0]])
    out = apply_penalties(logits, counts, presence=0.5, frequency=0.25)
    assert out.tolist() == [[1.0, 2.0 - 0.25 - 0.5, 3.0 - 0.75 - 0.5, 4.0]]
    assert apply_penalties(logits, counts, 0.0, 0.0) is logits


def test_repetition_penalty_min_p_and_their_order_are_transformers():
    """`apply_penalties`' repetition penalty is transformers' processor over the prompt and the
    tokens generated; `logits_to_probs`' min-p is its warper after temperature, top-k and
    top-p, in that order: the same probabilities."""
    from transformers.generation import logits_process as lp

    from gptkiln.logits_processors import apply_penalties, prompt_tokens

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 300, generator=gen) * 3
    prompts = [[1, 5, 5, 7], [2, 2, 2, 2], [150, 3, 9, 199]]
    made = [[7, 8], [299, 2], [0, 0]]  # generated: counted, and a token of the prompt again
    counts = torch.zeros(3, 300)
    for row, ids in enumerate(made):
        for i in ids:
            counts[row, i] += 1
    seen = torch.tensor([p + m for p, m in zip(prompts, made)])
    in_prompt = prompt_tokens(prompts, 300)
    want = lp.RepetitionPenaltyLogitsProcessor(1.3)(seen, logits.clone())
    got = apply_penalties(logits, counts, 0.0, 0.0, 1.3, in_prompt)
    assert torch.equal(got, want) and not torch.equal(got, logits)
    assert torch.equal(apply_penalties(logits, counts, 0.0, 0.0, 1.0, in_prompt), logits)
    for temperature, top_k, top_p, min_p in [(0.7, None, None, 0.1), (1.3, 50, 0.9, 0.05)]:
        scores = lp.TemperatureLogitsWarper(temperature)(seen, logits.clone())
        if top_k:
            scores = lp.TopKLogitsWarper(top_k)(seen, scores)
        if top_p:
            scores = lp.TopPLogitsWarper(top_p)(seen, scores)
        scores = lp.MinPLogitsWarper(min_p)(seen, scores)
        probs = logits_to_probs(logits, temperature, top_k, top_p, min_p)
        assert torch.equal(probs > 0, scores > float("-inf"))
        torch.testing.assert_close(probs, torch.softmax(scores, dim=-1))
        assert (probs > 0).sum() < (logits_to_probs(logits, temperature, top_k, top_p) > 0).sum()


def test_greedy_with_a_repetition_penalty_counts_the_prompt_and_the_tokens_generated(model):
    """Step by step: each token of the prompt (all of it, also past the window) or generated
    has its logit divided by the penalty where positive, multiplied where negative; greedy
    then takes the argmax (transformers' ``repetition_penalty`` with ``do_sample=False``)."""
    prompt, n, penalty = [5, 9, 2, 33] * 8, 16, 1.8  # 32 tokens: past the window of 24
    idx = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            logits = model(idx[:, -24:])[0, -1, :]
            seen = torch.zeros(64, dtype=torch.bool)
            seen[idx[0]] = True
            logits = torch.where(seen & (logits > 0), logits / penalty, logits)
            logits = torch.where(seen & (logits < 0), logits * penalty, logits)
            idx = torch.cat([idx, logits.argmax()[None, None]], dim=1)
    got = generate(model, prompt, max_new_tokens=n, temperature=0, repetition_penalty=penalty)
    assert got == idx[0, len(prompt) :].tolist()
    assert got != generate(model, prompt, max_new_tokens=n, temperature=0)  # it did something
    rows = generate(model, [prompt, [7, 8]], max_new_tokens=n, temperature=0,
                    repetition_penalty=penalty)  # fmt: skip
    assert rows[0] == got  # the padded row beside it marks nothing of its padding


def test_logit_bias_is_added_to_its_tokens_logits_before_the_draw(model):
    """OpenAI's logit_bias: +100 makes a token every greedy pick; -100 keeps the greedy pick of
    each step out (the next likeliest instead), step by step as the formula says."""
    prompt, n = [5, 9, 2, 33], 8
    free = generate(model, prompt, max_new_tokens=n, temperature=0)
    assert generate(model, prompt, max_new_tokens=n, temperature=0, logit_bias={7: 100}) == [7] * n
    banned = free[0]
    idx = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            logits = model(idx[:, -24:])[:, -1, :]
            logits[:, banned] -= 100
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    got = generate(model, prompt, max_new_tokens=n, temperature=0, logit_bias=[(banned, -100)])
    assert got == idx[0, len(prompt) :].tolist() and banned not in got
    for bias, needle in [({-1: 1}, "token id -1"), ({3: 101}, r"\[-100, 100\]"), (5, "map")]:
        with pytest.raises(GptkilnError, match=needle):
            SampleConfig(logit_bias=bias)
    with pytest.raises(GptkilnError, match="past the model's 64 ids"):
        generate(model, prompt, max_new_tokens=2, logit_bias={64: 1})


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 0.5), (-1.0, 0.5)])
def test_generation_with_penalties_equals_the_formula_applied_step_by_step(
    model, presence, frequency
):
    prompt, n = [5, 9, 2, 33], 20  # greedy repeats tokens from its 13th on
    idx, counts = torch.tensor([prompt]), torch.zeros(1, 64)
    with torch.no_grad():
        for _ in range(n):
            logits = model(idx[:, -24:])[:, -1, :]
            logits = logits - frequency * counts - presence * (counts > 0).float()
            nxt = logits.argmax(-1)
            counts[0, nxt] += 1
            idx = torch.cat([idx, nxt[:, None]], dim=1)
    got = generate(
        model, prompt, max_new_tokens=n, temperature=0,
        presence_penalty=presence, frequency_penalty=frequency,
    )  # fmt: skip
    assert got == idx[0, len(prompt) :].tolist()
    assert got != generate(model, prompt, max_new_tokens=n, temperature=0)  # they did something


def test_generate_ends_each_row_at_its_stop_string_and_the_batch_when_all_have_ended(model):
    from gptkiln.text_stream import TextStream

    tok = _ids_as_letters()
    prompts = [[1, 2, 3], [4, 5, 6]]
    free = generate(model, prompts, max_new_tokens=12, temperature=0)
    stop = tok.decode(free[0][2:4])  # the text of row 0's 3rd and 4th tokens
    assert stop not in tok.decode(free[1])
    rows = generate(model, prompts, max_new_tokens=12, temperature=0, stop=[stop], tokenizer=tok)
    assert rows[0] == free[0][:4]  # up to the token that completes the stop string
    assert rows[1] == free[1]  # the other row runs on
    cfg = SampleConfig(max_new_tokens=12, temperature=0, stop=(stop,))
    streams = [TextStream(tok.decode, cfg.stop) for _ in range(2)]
    steps = list(generate_stream(model, [[1, 2, 3]], cfg, streams=streams[:1]))
    assert len(steps) == 4 and streams[0].done and streams[0].text == tok.decode(free[0][:2])
    with pytest.raises(GptkilnError, match="stop strings need"):
        generate(model, prompts, max_new_tokens=3, stop=["x"])


def _ids_as_letters():
    """A tokenizer for the fixture model's 64 ids: each id a distinct character."""
    from gptkiln.tokenizers import CharTokenizer

    return CharTokenizer([chr(0x41 + i) for i in range(64)], with_eot=False)


def test_each_row_of_a_seeded_batch_samples_what_it_samples_alone(model):
    cfg = SampleConfig(max_new_tokens=10, temperature=1.0, seed=11)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    alone = [generate(model, p, cfg) for p in prompts]
    assert generate(model, prompts, cfg) == alone
    assert len({tuple(a) for a in alone}) == 3
    tokens = generate_stream(model, [[1, 2, 3]] * 2, cfg, row_seeds=[11, 12])
    rows = torch.stack(list(tokens)).T.tolist()
    assert rows[0] == alone[0] and rows[1] == generate(model, [1, 2, 3], cfg, seed=12)


def test_an_empty_prompt_starts_from_end_of_text_or_is_refused_without_one():
    from gptkiln.tokenizers import CharTokenizer, encode_prompt, load_tokenizer

    assert encode_prompt(load_tokenizer("gpt2"), "") == [50256]
    assert encode_prompt(load_tokenizer("gpt2"), "Hi") == [17250]
    with pytest.raises(GptkilnError, match="prompt is empty.*no end-of-text"):
        encode_prompt(CharTokenizer(["a", "b"], with_eot=False), "")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(stop=[""]), "stop must be"),
        (dict(stop=["a", 3]), "stop must be"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
        (dict(min_p=float("nan")), "min_p"),
    ],
)
def test_bad_stop_strings_and_penalties_are_refused(kwargs, message):
    with pytest.raises(GptkilnError, match=message):
        SampleConfig(**kwargs)


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_is_argmax_with_its_ties_and_nans(rows):
    """`greedy` takes NumPy's argmax for fp32 on the CPU: the same indices as torch's, the
    first of equal largest logits and NaN counted largest included."""
    from gptkiln.sampling import greedy

    torch.manual_seed(0)
    logits = torch.randn(rows, 50257)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie: the first wins
    if rows > 1:
        logits[1, 4] = float("nan")
    for x in (logits, logits.double(), logits[:, ::2], logits.t().contiguous().t()):
        got = greedy(x)
        assert got.dtype == torch.long and torch.equal(got, x.argmax(dim=-1))
    assert greedy(logits)[0] == 7
    with torch.inference_mode():
        assert torch.equal(greedy(logits.clone()), logits.argmax(dim=-1))
    w = logits.clone().requires_grad_()
    assert torch.equal(greedy(w), logits.argmax(dim=-1))  # autograd: torch's own


def test_the_first_token_is_out_before_the_decoding_kernels_are_tuned(model):
    tuned = []

    def prepare(m, rows, steps):  # the backend's set-up, as the caller that owns decoding hands it
        tuned.append(rows)

    cfg = SampleConfig(max_new_tokens=3, temperature=0, stop_at_eos=False)
    stream = generate_stream(model, [[1, 2, 3], [4, 5]], cfg, prepare=prepare)
    next(stream)  # the prefill's token: no timing stood before it
    assert tuned == []
    next(stream)  # the first decode step multiplies 2 rows: tuned for 2, once
    list(stream)
    assert tuned == [2]
    one = generate_stream(
        model, [[1, 2, 3]], SampleConfig(max_new_tokens=1, temperature=0), prepare=prepare
    )
    assert len(list(one)) == 1 and tuned == [2]  # no decode step, nothing to tune


# -- reading ahead: the next step queued before the host reads this one's tokens ---------------
class _Watched:
    """A `TextStream` that notes, at each token it is given, how many decode steps were queued
    by then (``queued``: the count the test's spy keeps)."""

    def __init__(self, stream, queued):
        self.stream, self.queued, self.seen = stream, queued, []

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def push(self, token):
        self.seen.append(len(self.queued))
        return self.stream.push(token)


@pytest.mark.parametrize("read_ahead", [True, False])
def test_reading_ahead_queues_the_next_step_before_the_host_reads_this_one(
    model, monkeypatch, read_ahead
):
    from gptkiln import sampling
    from gptkiln.text_stream import TextStream

    tok = _ids_as_letters()
    free = generate(model, [1, 2, 3], max_new_tokens=10, temperature=0)
    stop = tok.decode(free[5:7])  # ends the row at its 7th token
    assert stop not in tok.decode(free[:6])
    queued = []
    real = sampling.decode_one_token

    def spy(m, token, pos):
        queued.append(pos)
        return real(m, token, pos)

    monkeypatch.setattr(sampling, "decode_one_token", spy)
    cfg = SampleConfig(max_new_tokens=10, temperature=0, stop=(stop,))
    stream = _Watched(TextStream(tok.decode, cfg.stop), queued)
    steps = list(generate_stream(model, [[1, 2, 3]], cfg, streams=[stream], read_ahead=read_ahead))
    assert [int(t) for t in steps] == free[:7] and stream.done
    if read_ahead:  # token k is read once step k+1 is queued; the 8th step was never used
        assert stream.seen == [1, 2, 3, 4, 5, 6, 7] and len(queued) == 7
    else:
        assert stream.seen == [0, 1, 2, 3, 4, 5, 6] and len(queued) == 6
    queued.clear()  # the last step queues nothing after it
    cfg = SampleConfig(max_new_tokens=4, temperature=0, stop=("@@",))
    stream = _Watched(TextStream(tok.decode, cfg.stop), queued)
    list(generate_stream(model, [[1, 2, 3]], cfg, streams=[stream], read_ahead=read_ahead))
    assert stream.seen == ([1, 2, 3, 3] if read_ahead else [0, 1, 2, 3]) and len(queued) == 3


def test_reading_ahead_is_for_the_steps_a_backend_takes_on_cuda():
    from gptkiln.sampling import _reads_ahead

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _reads_ahead(None, True, cuda)
    assert not _reads_ahead(None, False, cuda)  # an eager step: its launch is the host's work
    assert not _reads_ahead(None, True, cpu)  # a CPU step has run when it returns
    assert _reads_ahead(True, False, cpu) and not _reads_ahead(False, True, cuda)


@pytest.mark.parametrize(
    "case", ["end of text", "stop string", "seeded penalties", "sliding window", "no cache"]
)
def test_reading_ahead_gives_the_tokens_of_reading_in_step(model, case):
    """Every step's tokens (an ended row's filler included) and every row's text are those of
    reading each step before the next is queued."""
    from gptkiln.text_stream import TextStream

    tok = _ids_as_letters()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    free = generate(model, prompts, max_new_tokens=10, temperature=0)
    kw, eot = dict(max_new_tokens=10, temperature=0), None
    if case == "end of text":  # rows end at different steps
        eot = free[0][4]
    elif case == "stop string":  # one row by a stop string, one at end-of-text
        kw["stop"], eot = (tok.decode(free[1][3:5]),), free[2][6]
    elif case == "seeded penalties":
        kw.update(temperature=0.9, seed=5, frequency_penalty=0.5)
        eot = generate(model, prompts, **kw)[0][2]
    elif case == "sliding window":  # 5 + 30 tokens pass the context of 24
        kw["max_new_tokens"], eot = 30, 63
    else:
        prompts, eot = [[1, 2, 3], [4, 5, 6]], free[0][3]
    cfg = SampleConfig(**kw)

    def run(read_ahead):
        streams = [TextStream(tok.decode, cfg.stop, eot) for _ in prompts]
        steps = generate_stream(
            model, prompts, cfg, eot, case != "no cache", streams=streams, read_ahead=read_ahead
        )
        return torch.stack(list(steps)).tolist(), [(s.text, s.done, len(s.ids)) for s in streams]

    behind = run(False)
    assert run(True) == behind
    steps, rows = behind
    ended = {"sliding window": 0, "stop string": 2}.get(case, 1)  # while another row goes on
    assert sum(done for _, done, _ in rows) >= ended
    for r, (_, done, made) in enumerate(rows):  # an ended row yields end-of-text from then on
        assert not done or all(step[r] == eot for step in steps[made:])


def test_a_draw_takes_one_uniform_a_row_and_follows_the_probabilities():
    """`sample` (by `draw`) picks id i with probability p_i, never an id of probability 0,
    from one uniform a row of its generator (torch.multinomial would take an exponential for
    every id: 20x slower at GPT-2's vocabulary)."""
    from gptkiln.sampling import draw

    probs = torch.softmax(torch.randn(1, 40, generator=torch.Generator().manual_seed(0)), -1)
    probs[0, [3, 17, 39]] = 0  # the last id too
    probs /= probs.sum()
    n = 100_000
    g = torch.Generator().manual_seed(5)
    drawn = sample(probs.log().expand(n, -1), 1.0, generator=g)  # softmax(log p) = p
    freq = torch.bincount(drawn, minlength=40).float() / n
    assert freq[[3, 17, 39]].sum() == 0
    sigma = (probs[0] * (1 - probs[0]) / n).sqrt()
    assert ((freq - probs[0]).abs() <= 5 * sigma + 1e-6).all()
    # one uniform a row: the generator then gives what a twin gives after n uniforms
    twin = torch.Generator().manual_seed(5)
    torch.rand(n, 1, generator=twin)
    assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=twin))
    again = draw(probs.expand(8, -1), torch.Generator().manual_seed(5))
    assert torch.equal(again, drawn[:8])  # seeded: the same ids
    assert draw(torch.full((2, 5), float("nan"))).tolist() == [0, 0]  # greedy's id, no error


def test_a_gpus_running_sum_is_made_flat_over_zeros_and_non_decreasing():
    """A parallel scan's running sum may step by an ulp over an id of probability 0, or fall
    (`draw` on a GPU): made flat there and non-decreasing, no zero id can be the first to pass a
    uniform, and the kept ids' sums are the scan's own."""
    from gptkiln.sampling import flat_over_zeros

    probs = torch.tensor([[0.0, 0.25, 0.0, 0.0, 0.5, 0.0, 0.25, 0.0]])
    scan = torch.tensor([[1e-8, 0.25, 0.25 + 3e-8, 0.25 - 3e-8, 0.75, 0.75 + 6e-8, 1.0, 1.0]])
    flat = flat_over_zeros(probs, scan)
    assert flat.tolist() == [[0.0, 0.25, 0.25, 0.25, 0.75, 0.75, 1.0, 1.0]]
    ids = torch.searchsorted(flat.expand(999, -1), torch.rand(999, 1), right=True)
    assert set(ids.flatten().tolist()) == {1, 4, 6}


def test_a_top_k_draw_on_the_cpu_reads_its_k_candidates_and_picks_what_the_whole_row_picks(
    monkeypatch,
):
    """With a top-k, `sample` and `sample_rows` draw from each row's k most likely ids alone
    (their probabilities, top-p and running sum over k values, not V), in the order of their
    ids, so a uniform picks the id the whole row's `draw(logits_to_probs(...))` picks: fp32
    rows of 50 to 50,257 ids, with and without top-p and min-p, seeded a row and by one
    generator."""
    from gptkiln import sampling
    from gptkiln.sampling import draw, row_uniforms, sample_rows

    gen = torch.Generator().manual_seed(3)
    cases = []
    for trial in range(24):
        vocab = int(torch.randint(50, 50257, (1,), generator=gen))
        scale = float(torch.rand(1, generator=gen)) * 8 + 0.1
        logits = torch.randn(6, vocab, generator=gen) * scale
        top_k = int(torch.randint(1, min(vocab, 2000), (1,), generator=gen))
        top_p, min_p = (None, 0.9, 0.5)[trial % 3], (None, 0.05, 0.3, 0.0)[trial % 4]
        cases.append((logits, (0.7, 1.0, 1.6)[trial % 3], top_k, top_p, min_p))
    real, whole = sampling.logits_to_probs, []
    monkeypatch.setattr(sampling, "logits_to_probs", lambda *a: whole.append(1) or real(*a))
    for logits, temperature, top_k, top_p, min_p in cases:
        seeds = [torch.Generator().manual_seed(s) for s in range(6)]
        got = sample_rows(logits, temperature, top_k, top_p, seeds, min_p)
        one = sample(logits, temperature, top_k, top_p, torch.Generator().manual_seed(9), min_p)
        assert not whole  # no row read whole: no tie at a k-th
        probs = real(logits, temperature, top_k, top_p, min_p)
        twins = [torch.Generator().manual_seed(s) for s in range(6)]
        drawn_as_whole(got, draw(probs, uniforms=row_uniforms(twins, logits.device)), probs)
        drawn_as_whole(one, draw(probs, torch.Generator().manual_seed(9)), probs)


def drawn_as_whole(got: torch.Tensor, want: torch.Tensor, probs: torch.Tensor) -> None:
    """``got``, drawn from the candidates, is what the whole row's draw ``want`` picked from
    ``probs`` with the same uniforms: but for the rounding of a softmax's sum (k values
    against V), which may move a boundary by an ulp (at most one row in a hundred here, and
    to an id the whole row keeps too)."""
    other = (got != want).nonzero().flatten()
    assert len(other) <= max(1, len(got) // 100), (got, want)
    assert all(probs[r, got[r]] > 0 for r in other)


def test_a_row_tied_at_its_k_th_or_not_a_number_is_drawn_whole_and_alone():
    """Where the k-th value comes again past it (top-k keeps them all), or a row's values are
    not numbers (id 0, as greedy), or fewer than k ids are possible (a grammar's mask), that
    row draws from its whole row, the others from their candidates: each what it draws alone."""
    from gptkiln.sampling import draw, row_uniforms, sample_rows

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 300, generator=gen) * 3
    logits[1, [7, 50, 90]] = 20.0
    logits[1, [8, 60]] = 19.5  # top-k 4 keeps 5: the three 20s and both 19.5s
    logits[2, 5] = float("nan")
    logits[3, 3:] = float("-inf")  # three possible ids, top-k 4
    seeds = list(range(5))
    got = sample_rows(logits, 1.0, 4, None, [torch.Generator().manual_seed(s) for s in seeds])
    twins = [torch.Generator().manual_seed(s) for s in seeds]
    want = draw(logits_to_probs(logits, 1.0, 4, None), uniforms=row_uniforms(twins, "cpu"))
    assert torch.equal(got, want) and got[2] == 0 and got[3] < 3
    for row in range(5):
        alone = sample_rows(
            logits[row : row + 1], 1.0, 4, None, [torch.Generator().manual_seed(row)]
        )
        assert alone[0] == got[row]
    drawn = torch.stack(
        [sample(logits[1:2], 1.0, 4, None, torch.Generator().manual_seed(s)) for s in range(400)]
    )
    assert set(drawn.flatten().tolist()) == {7, 50, 90, 8, 60}  # both 19.5s kept


def _whole(logits, temperature, top_k, top_p, seeds):
    """`sample_rows`' ids as the whole row draws them: `draw(logits_to_probs(...))`."""
    from gptkiln.sampling import draw, row_uniforms

    twins = [torch.Generator().manual_seed(s) for s in seeds]
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    return draw(probs, uniforms=row_uniforms(twins, logits.device)), probs


def test_a_tie_made_by_the_shift_and_temperature_widens_the_candidates():
    """Distinct logits that the shift and the temperature make equal are a tie at the k-th:
    top-k keeps them all, and so do the candidates."""
    from gptkiln.sampling import sample_rows

    logits = torch.full((1, 100), -30.0)
    logits[0, 0] = 12.5
    logits[0, 1:41] = torch.arange(40) * 1e-8  # distinct; equal after the shift (-12.5)
    gens = [torch.Generator().manual_seed(s) for s in range(800)]
    drawn = {int(sample(logits, 10.0, 2, None, g)) for g in gens}
    assert drawn == set(range(41))  # more than the candidates' margin past the k-th
    got = sample_rows(logits, 10.0, 2, None, [torch.Generator().manual_seed(5)])
    assert torch.equal(got, _whole(logits, 10.0, 2, None, [5])[0])


def test_candidates_run_on_past_a_long_tie_at_the_k_th_and_keep_top_p():
    """A tie at the k-th longer than the candidates' margin: they are taken twice as wide until
    it ends; top-p then applies to every id top-k kept, as on the whole row."""
    from gptkiln.sampling import sample_rows

    logits = torch.full((1, 400), -10.0)
    logits[0, :2] = torch.tensor([9.0, 8.0])
    logits[0, 100:300] = 1.0  # top-k 3 keeps 202 ids: 9, 8 and 200 ones
    # top-p 0.25: 9 (0.19) and 8 (0.12) reach it before the ones (0.0035 each)
    for top_p, kept in ((0.25, {0, 1}), (None, {0, 1} | set(range(100, 300)))):
        drawn = set()
        for s in range(1500):
            got = sample_rows(logits, 2.0, 3, top_p, [torch.Generator().manual_seed(s)])
            assert torch.equal(got, _whole(logits, 2.0, 3, top_p, [s])[0])
            drawn.add(int(got))
        assert drawn <= kept and len(drawn) >= (2 if top_p else 100)


def test_a_top_k_draw_takes_one_uniform_a_row_from_its_generators():
    from gptkiln.sampling import sample_rows

    logits = torch.randn(5, 200, generator=torch.Generator().manual_seed(0)) * 3
    logits[1, [3, 9]] = 30.0  # tied at top-k 1
    for top_k in (1, 40):
        g, twin = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
        sample(logits, 0.8, top_k, 0.9, g)
        torch.rand((5, 1), generator=twin)
        assert torch.equal(g.get_state(), twin.get_state())
        gens = [torch.Generator().manual_seed(s) for s in range(5)]
        twins = [torch.Generator().manual_seed(s) for s in range(5)]
        sample_rows(logits, 0.8, top_k, 0.9, gens)
        for a, b in zip(gens, twins):
            torch.rand((1, 1), generator=b)
            assert torch.equal(a.get_state(), b.get_state())


def test_a_top_k_of_the_whole_vocabulary_or_more_draws_as_the_whole_row():
    from gptkiln.sampling import sample_rows

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    for top_k in (1, 49, 50, 51, 1000):
        got = sample_rows(
            logits, 0.9, top_k, 0.8, [torch.Generator().manual_seed(s) for s in range(3)]
        )
        drawn_as_whole(got, *_whole(logits, 0.9, top_k, 0.8, range(3)))


def test_bf16_and_fp16_logits_draw_from_their_candidates_as_from_the_whole_row():
    """Half-precision logits, many rows tied at their k-th: ranked in their own dtype, scaled in
    fp32 as `logits_to_probs` scales them."""
    from gptkiln.sampling import sample_rows

    gen = torch.Generator().manual_seed(6)
    for dtype in (torch.bfloat16, torch.float16):
        logits = (torch.randn(512, 2000, generator=gen) * 2.5).to(dtype)
        for top_k in (5, 400):
            seeds = [torch.Generator().manual_seed(s) for s in range(512)]
            got = sample_rows(logits, 0.8, top_k, None, seeds)
            drawn_as_whole(got, *_whole(logits, 0.8, top_k, None, range(512)))


def _topk_widths(monkeypatch) -> list[int]:
    """The k of every `torch.topk` call from now on."""
    seen, topk = [], torch.topk

    def spy(x, k, *args, **kwargs):
        seen.append(k)
        return topk(x, k, *args, **kwargs)

    monkeypatch.setattr(torch, "topk", spy)
    return seen


def test_a_row_with_fewer_possible_ids_than_k_is_not_widened_to_the_whole_row(monkeypatch):
    """A grammar's mask leaves fewer ids than top-k: the k-th is -inf, every possible id is a
    candidate already, and one topk suffices (widening it to V took 80 ms for 16 rows)."""
    from gptkiln.sampling import sample_rows

    logits = torch.randn(2, 50257, generator=torch.Generator().manual_seed(0))
    logits[:, 10:] = float("-inf")
    seen = _topk_widths(monkeypatch)
    got = sample_rows(logits, 0.8, 40, 0.9, [torch.Generator().manual_seed(s) for s in range(2)])
    assert len(seen) == 1 and seen[0] < 100, seen
    want, probs = _whole(logits, 0.8, 40, 0.9, range(2))
    drawn_as_whole(got, want, probs)


def test_a_long_tie_at_the_k_th_widens_the_candidates_twice_as_far_each_time(monkeypatch):
    from gptkiln.sampling import sample_rows

    logits = torch.full((1, 50257), -10.0)
    logits[0, :2] = torch.tensor([9.0, 8.0])
    logits[0, 100:20100] = 1.0  # top-k 3 keeps 20,002 ids
    seen = _topk_widths(monkeypatch)
    sample_rows(logits, 1.0, 3, None, [torch.Generator().manual_seed(0)])
    assert len(seen) <= 12 and all(b == 2 * a for a, b in zip(seen[:-2], seen[1:-1])), seen


def test_a_tie_at_the_nucleus_edge_running_past_4096_or_top_ks_k_is_ranked_whole():
    vocab, gen = 50257, torch.Generator().manual_seed(3)
    for head, tie, top_p, top_k in ((3000, 3000, 0.55, None), (200, 2000, 0.6, 1000)):
        row = torch.full((vocab,), 1e-7)
        row[:head], row[head : head + tie] = 0.5 / head, 0.45 / tie
        row = (row / row.sum())[torch.randperm(vocab, generator=gen)].log()[None]
        kept = logits_to_probs(row, 1.0, top_k, top_p) > 0
        assert int(kept.sum()) == head + tie
        assert torch.equal(kept, whole_sort_top_p(row, 1.0, top_k, top_p) > 0)


def test_a_prompt_of_0_d_tensors_is_one_prompt_of_their_ids(model):
    ids = generate(model, [torch.tensor(5), torch.tensor(6)], max_new_tokens=2, temperature=0)
    assert ids == generate(model, [5, 6], max_new_tokens=2, temperature=0)  # one prompt
    one = generate(model, torch.tensor(5), max_new_tokens=2, temperature=0)
    assert one == generate(model, [5], max_new_tokens=2, temperature=0)


@pytest.mark.parametrize(
    "prompts, settings, needle",
    [
        ("ROMEO:", {}, "takes token ids, not text"),
        ([5, 10**6], {}, "the prompt holds 1000000, not a token id of this model"),
        ([[5], [-1]], {}, "prompt 1 holds -1"),
        ([[5], [2.0]], {}, "prompt 1 holds 2.0"),
        ([1.0, 2.0], {}, "the prompt holds 1.0"),
        ([5, None], {}, "the prompt holds None"),
        ([None, 5], {}, "the prompt holds None"),
        ([torch.tensor(5), torch.tensor(99)], {}, "the prompt holds 99"),  # 0-d: one id each
        ([[torch.tensor([5, 6])]], {}, "prompt 0 holds tensor"),
        ([5], {"max_new_token": 3}, "no setting max_new_token; SampleConfig's are: max_new_tokens"),
    ],
)
def test_generate_from_python_says_what_is_wrong_in_one_line(model, prompts, settings, needle):
    """A learner's slips at generate(): text for ids, an id past the vocabulary, a misspelt
    setting; each one GptkilnError line, not an error deep in torch."""
    with pytest.raises(GptkilnError, match=needle):
        generate(model, prompts, max_new_tokens=2, **settings)


def test_a_batch_of_tensor_or_array_rows_is_the_batch_of_lists(model):
    import numpy as np

    lists = generate(model, [[1, 2, 3], [4, 5, 6]], max_new_tokens=3, temperature=0)
    rows = [torch.tensor([1, 2, 3]), np.array([4, 5, 6])]
    assert generate(model, rows, max_new_tokens=3, temperature=0) == lists


def test_generate_stream_decodes_in_eval_mode_and_takes_generates_arguments():
    """A model fresh from GPT() is in train mode: the stream turns dropout off as generate()
    does, and gives the mode back; one flat prompt and SampleConfig fields as keywords work."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=100, context_length=16, n_layer=2, n_head=2, n_embd=16,
                      dropout=0.5))  # fmt: skip
    cfg = SampleConfig(max_new_tokens=6, temperature=0)
    runs = [[t.tolist() for t in generate_stream(m, [[1, 2, 3]], cfg)] for _ in range(2)]
    assert runs[0] == runs[1] and m.training
    flat = [t.tolist() for t in generate_stream(m, [1, 2, 3], max_new_tokens=6, temperature=0)]
    assert flat == runs[0] and [t[0] for t in flat] == generate(m, [1, 2, 3], cfg)
    with pytest.raises(GptkilnError, match="generate_stream.. has no setting max_new"):
        next(generate_stream(m, [1, 2, 3], max_new=3))


def _kept_reference(model: GPT, prompt: list[int], new: int, keep: int) -> list[int]:
    """Greedy ids with no cache, each step's input built by hand: the whole sequence while it
    fits, else its first ``keep`` ids and its last ``ctx - keep``."""
    ctx, seq = model.config.context_length, list(prompt)
    for _ in range(new):
        window = seq if len(seq) <= ctx else seq[:keep] + seq[len(seq) - (ctx - keep) :]
        with torch.no_grad():
            seq.append(int(model(torch.tensor([window]))[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_sliding_window_keeps_the_first_ids_of_every_prompt(use_cache):
    """``keep`` (llama.cpp's n_keep: a Llama 3 BOS) stays at the window's start when a prompt is
    longer than the context and when the window slides, in every row of a left-padded batch,
    with and without the KV cache; ``keep=0`` is the book's window of the last ids."""
    torch.manual_seed(0)
    config = GPTConfig.from_name("llama3-baby", vocab_size=97, context_length=12, n_layer=2)
    model = GPT(config).eval()
    bos = 96
    prompts = [[bos, *range(5, 20)], [bos, 3, 4, 5], [bos, *range(30, 40)]]  # 16, 4, 11 ids
    rows = prompts if use_cache else prompts[:1]  # no cache: one row (no padding mask)
    for keep in (1, 0):
        steps = generate_stream(
            model, rows, max_new_tokens=20, temperature=0, keep=keep, use_cache=use_cache
        )
        got = torch.stack(list(steps), dim=1).tolist()
        for prompt, ids in zip(rows, got):
            assert ids == _kept_reference(model, prompt, 20, keep), (keep, prompt)
    with pytest.raises(GptkilnError, match="keep=12"):
        list(generate_stream(model, rows, max_new_tokens=2, keep=12))


def test_generating_with_a_llama3_tokenizer_keeps_its_bos_in_the_window(tmp_path):
    """`generate` with a tokenizer that begins every text with BOS keeps it first when the
    window slides (`kept_ids`); a prompt without it keeps nothing."""
    from hf_tokenizer_dirs import write_llama3_dir

    from gptkiln.sampling import kept_ids
    from gptkiln.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(write_llama3_dir(tmp_path / "tok"))
    torch.manual_seed(0)
    config = GPTConfig.from_name(
        "llama3-baby", vocab_size=tokenizer.vocab_size, context_length=10, n_layer=1
    )
    model = GPT(config).eval()
    ids = tokenizer.encode("to be or not to be, that is")
    assert ids[0] == tokenizer.bos_id and len(ids) > 2
    assert kept_ids(tokenizer, [ids], 10) == 1 and kept_ids(tokenizer, [ids[1:]], 10) == 0
    assert kept_ids(tokenizer, [ids], 1) == 0  # a context of one token has room for no more
    got = generate(
        model, ids, max_new_tokens=15, temperature=0, tokenizer=tokenizer, stop_at_eos=False
    )
    assert got == _kept_reference(model, ids, 15, 1)
    config = GPTConfig.from_name(
        "llama3-baby", vocab_size=tokenizer.vocab_size, context_length=1, n_layer=1
    )
    one = GPT(config).eval()  # a context of one token: the window is the last token alone
    assert len(generate(one, ids, max_new_tokens=3, tokenizer=tokenizer, stop_at_eos=False)) == 3
