"""Continuous batching: cache rows at their own positions, and a request's tokens not depending
on what else is in the batch (greedy, seeded, penalties, stop strings, staggered arrivals)."""

import asyncio
import copy
import types

import pytest
import torch

from gptkiln.config import GPTConfig, SampleConfig
from gptkiln.model import GPT
from gptkiln.sampling import generate
from gptkiln.serve.batcher import Batcher, QueueFull
from gptkiln.serve.events import Done, Failed, PromptLogprobs, Sequence, Token
from gptkiln.serve.prefill import prefill_groups
from gptkiln.text_stream import TextStream
from gptkiln.tokenizers import build_char_tokenizer

TEXT = "the quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer([TEXT], with_eot=False)  # no end-of-text: rows run their length


@pytest.fixture(scope="module")
def model(tokenizer) -> GPT:
    # Untied, as in test_sampling: a fresh tied model's greedy output repeats the last token.
    torch.manual_seed(0)
    config = GPTConfig.from_name(
        "tiny", vocab_size=tokenizer.vocab_size, context_length=48, tie_embeddings=False
    )
    return GPT(config).eval()


# -- the model: rows of one cache, each at its own position ------------------------------------
@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_a_rows_logits_equal_its_sequence_run_alone(model, attention):
    import dataclasses

    m = GPT(dataclasses.replace(model.config, attention=attention)).eval()
    m.load_state_dict(model.state_dict())
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7], [10, 11, 12, 13, 14]]
    rows = [2, 0, 3]  # not in order, and row 1 left empty
    with torch.no_grad():
        m.setup_cache(4, 24)
        prefilled = []
        for seq, row in zip(seqs, rows):  # one prompt at a time into its own row
            prefilled.append(m(torch.tensor([seq[:-2]]), start_pos=0, rows=slice(row, row + 1)))
        # two decode steps feed every row one token at its own position; row 1 holds nothing
        steps = []
        for k in (2, 1):
            idx = torch.zeros(4, 1, dtype=torch.long)
            pos = torch.zeros(4, dtype=torch.long)
            for seq, row in zip(seqs, rows):
                idx[row, 0], pos[row] = seq[-k], len(seq) - k
            steps.append(m(idx, start_pos=pos))  # (4, 1, V)
        # and rows picked by an index tensor: the same logits
        again = m(
            torch.tensor([[seqs[0][-1]]]),
            start_pos=torch.tensor([len(seqs[0]) - 1]),
            rows=torch.tensor([rows[0]]),
        )
        m.clear_cache()
        for i, (seq, row) in enumerate(zip(seqs, rows)):
            alone = m(torch.tensor([seq]))[0]  # (T, V), no cache
            torch.testing.assert_close(prefilled[i][0], alone[:-2], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(steps[0][row, 0], alone[-2], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(steps[1][row, 0], alone[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(again[0, 0], steps[1][rows[0], 0])


def test_per_row_positions_refuse_a_left_padded_cache(model):
    with torch.no_grad():
        model.setup_cache(2, 8, torch.tensor([1, 0]))
        try:
            with pytest.raises(ValueError, match="left padding"):
                model(torch.tensor([[1], [2]]), start_pos=torch.tensor([3, 4]))
        finally:
            model.clear_cache()


# -- the batcher -------------------------------------------------------------------------------
def run_batcher(model, tokenizer, arrivals, **options):
    """Start a batcher over a copy of the model; submit each (step, Sequence) once the loop
    has run that many steps; return each sequence's events, and the batcher."""
    batcher = Batcher(copy.deepcopy(model), tokenizer, **options)

    async def main():
        await batcher.start()
        try:
            for step, seqs in sorted(arrivals, key=lambda a: a[0]):
                while batcher.steps < step:
                    await asyncio.sleep(0.001)
                batcher.submit(seqs)
            out = {}
            for _, seqs in arrivals:
                for seq in seqs:
                    out[id(seq)] = await collect(seq)
            return out
        finally:
            await batcher.stop()

    return asyncio.run(main()), batcher


async def collect(seq: Sequence) -> dict:
    ids, text, prompt = [], "", None
    while True:
        event = await seq.events.get()
        if isinstance(event, PromptLogprobs):
            prompt = event.entries
        elif isinstance(event, Token):
            ids.append(event.id)
            text += event.text
        elif isinstance(event, Done):
            return dict(
                ids=ids, text=text + event.text, reason=event.reason, n=event.tokens, prompt=prompt
            )
        else:
            raise AssertionError(event)


def alone(model, tokenizer, prompt, cfg):
    """What `generate` gives the prompt by itself: ids (end-of-text excluded) and the text."""
    ids = generate(copy.deepcopy(model), prompt, cfg, tokenizer.eot_id, tokenizer=tokenizer)
    stream = TextStream(tokenizer.decode, cfg.stop, tokenizer.eot_id)
    text = "".join(stream.push(t) for t in ids) + stream.flush()
    return ids, text


PROMPTS = ["the quick", "a", "over the lazy dog. the quick brown", "jumps"]


def staggered(tokenizer, cfgs):
    """Requests of different lengths arriving at different steps, while others decode."""
    return [
        (step, [Sequence(tokenizer.encode(p), cfg, asyncio.Queue(), index=0)])
        for step, p, cfg in zip([0, 0, 3, 7], PROMPTS, cfgs)
    ]


def check_each_equals_alone(model, tokenizer, arrivals, out):
    for _, seqs in arrivals:
        seq = seqs[0]
        ids, text = alone(model, tokenizer, seq.prompt, seq.cfg)
        got = out[id(seq)]
        assert got["ids"][: len(ids)] == ids, tokenizer.decode(seq.prompt)
        assert got["text"] == text


def test_greedy_requests_arriving_at_staggered_steps_get_what_each_gets_alone(model, tokenizer):
    cfgs = [SampleConfig(max_new_tokens=n, temperature=0) for n in (12, 20, 5, 9)]
    arrivals = staggered(tokenizer, cfgs)
    out, batcher = run_batcher(model, tokenizer, arrivals, max_batch=3)
    check_each_equals_alone(model, tokenizer, arrivals, out)
    assert len({tuple(o["ids"]) for o in out.values()}) == 4  # not one text for all
    assert batcher.steps < sum(c.max_new_tokens for c in cfgs)  # they did share steps


def test_rows_that_sample_alike_are_drawn_together_and_each_gets_what_it_gets_alone(
    model, tokenizer, monkeypatch
):
    """At each decode step the rows with one temperature, top-k and top-p draw in one
    `sample_rows` call (one read of their tokens, not one a row), as on a GPU: a seeded row with
    a uniform from its own generator, a penalised row from its own penalised logits, so each
    gets what it gets alone. On the CPU greedy rows each take their own argmax. The first
    tokens, after the prompts' prefills, are drawn together as well."""
    from gptkiln.serve import choosing as batching

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not batching.draws_together(cpu, 0) and batching.draws_together(cpu, 0.8)
    assert batching.draws_together(cuda, 0) and batching.draws_together(cuda, 0.8)
    monkeypatch.setattr(batching, "draws_together", lambda device, temperature: True)  # a GPU
    sizes = []
    real = batching.sample_rows

    def counted(logits, *args):
        sizes.append(logits.shape[0])
        return real(logits, *args)

    monkeypatch.setattr(batching, "sample_rows", counted)
    greedy = SampleConfig(max_new_tokens=10, temperature=0)
    top1 = SampleConfig(max_new_tokens=10, temperature=0.8, top_k=1)  # sampled, yet one token
    seeded = SampleConfig(max_new_tokens=10, temperature=1.0, seed=4)
    penalised = SampleConfig(
        max_new_tokens=10, temperature=1.0, seed=5, presence_penalty=0.3, frequency_penalty=0.7
    )
    greedy_seeded = SampleConfig(max_new_tokens=10, temperature=0, seed=9)  # greedy: no draw
    free = SampleConfig(max_new_tokens=10, temperature=1.0)  # unseeded: torch's generator
    prompts = PROMPTS + ["the lazy", "brown", "fox", "dog", "over"]
    cfgs = [greedy, greedy, greedy_seeded, top1, top1, seeded, penalised, free, free]
    arrivals = [
        (0, [Sequence(tokenizer.encode(p), cfg, asyncio.Queue(), index=0)])
        for p, cfg in zip(prompts, cfgs)
    ]
    out, _ = run_batcher(model, tokenizer, arrivals, max_batch=9)
    check_each_equals_alone(model, tokenizer, arrivals[:7], out)
    for _, (seq,) in arrivals[7:]:  # unseeded: their own length, ids and text
        got = out[id(seq)]
        assert got["n"] == 10 and tokenizer.decode(got["ids"]) == got["text"]
    # the first tokens and 9 decode steps: 3 greedy rows, 2 top-1, 4 at temperature 1
    assert sizes.count(3) == 10 and sizes.count(2) == 10 and sizes.count(4) == 10
    assert len(sizes) == 30  # no row drawn alone, its first token neither


def test_a_groups_bf16_logits_are_penalised_in_fp32_as_a_row_alone():
    """A row drawn with its group gets the logits it gets alone: penalised in fp32 (the counts'
    dtype), never rounded back to the model's bf16."""
    from gptkiln.logits_processors import apply_penalties
    from gptkiln.serve.choosing import Chooser

    logits = torch.randn(3, 1, 40).mul(30).to(torch.bfloat16)  # (rows, 1, V), as a bf16 model's
    counts = torch.randint(0, 3, (3, 40)).float()

    def slot(row, presence, frequency):
        cfg = SampleConfig(temperature=1.0, presence_penalty=presence, frequency_penalty=frequency)
        seq = types.SimpleNamespace(cfg=cfg, constraint=None)
        return types.SimpleNamespace(row=row, seq=seq, counts=counts[row : row + 1], in_prompt=None)

    group = [slot(0, 0.3, 0.0), slot(2, 0.0, 0.37), slot(1, 0.13, 0.7)]
    chooser = Chooser(torch.device("cpu"), types.SimpleNamespace(vocab_size=40))
    rows = chooser._chosen_logits([(s, logits[s.row, -1:]) for s in group], {})
    assert rows.dtype == torch.float32
    for i, s in enumerate(group):
        cfg = s.seq.cfg
        alone = apply_penalties(
            logits[s.row, -1:], s.counts, cfg.presence_penalty, cfg.frequency_penalty
        )
        assert torch.equal(rows[i : i + 1], alone)


def test_a_group_whose_draw_fails_puts_each_rows_generator_back_and_draws_it_alone(
    model, tokenizer, monkeypatch
):
    from gptkiln.serve import choosing as batching

    monkeypatch.setattr(batching, "draws_together", lambda device, temperature: True)
    real = batching.sample_rows

    def fails_together(logits, *args):
        tokens = real(logits, *args)  # every seeded row's generator has moved on
        if logits.shape[0] > 1:
            raise RuntimeError("out of memory (pretend)")
        return tokens

    monkeypatch.setattr(batching, "sample_rows", fails_together)
    cfgs = [SampleConfig(max_new_tokens=8, temperature=1.0, seed=s) for s in (1, 2, 3)]
    arrivals = [
        (0, [Sequence(tokenizer.encode(p), cfg, asyncio.Queue(), index=0)])
        for p, cfg in zip(PROMPTS, cfgs)
    ]
    out, _ = run_batcher(model, tokenizer, arrivals, max_batch=4)
    check_each_equals_alone(model, tokenizer, arrivals, out)


TOGETHER = ["the quick", "the lazy", "brown fox", "jumps"]  # 9, 8, 9, 5 characters


def counting_prefills(batcher, fail_batched: bool = False) -> list[int]:
    """Record the number of rows of every prefill forward (several prompts at once when > 1);
    with ``fail_batched``, a forward of several prompts raises."""
    real, rows = batcher.model.forward, []

    def forward(idx, *args, start_pos=None, **kwargs):
        if not isinstance(start_pos, torch.Tensor):  # a prefill (start_pos 0), not a decode
            rows.append(idx.size(0))
            if fail_batched and idx.size(0) > 1:
                raise RuntimeError("out of memory (pretend)")
        return real(idx, *args, start_pos=start_pos, **kwargs)

    batcher.model.forward = forward
    return rows


def submitted_together(batcher, seqs) -> list[dict]:
    """Run ``batcher`` with ``seqs`` submitted at once; each sequence's events (`collect`)."""

    async def main():
        await batcher.start()
        try:
            batcher.submit(seqs)
            return [await collect(seq) for seq in seqs]
        finally:
            await batcher.stop()

    return asyncio.run(main())


@pytest.mark.parametrize("fail_batched", [False, True])
def test_prompts_of_similar_length_are_prefilled_together_and_get_what_each_gets_alone(
    model, tokenizer, fail_batched
):
    cfg = SampleConfig(max_new_tokens=10, temperature=0)
    seqs = [Sequence(tokenizer.encode(p), cfg, asyncio.Queue()) for p in TOGETHER]
    batcher = Batcher(copy.deepcopy(model), tokenizer, max_batch=4)
    prefills = counting_prefills(batcher, fail_batched)

    out = submitted_together(batcher, seqs)
    for seq, got in zip(seqs, out):
        assert got["ids"] == alone(model, tokenizer, seq.prompt, cfg)[0], tokenizer.decode(
            seq.prompt
        )
    # one forward for the four (right-padded to 9); if it fails, each prompt alone, none lost
    assert prefills == ([4, 1, 1, 1, 1] if fail_batched else [4])


def test_a_prompt_admitted_n_times_is_prefilled_once_and_each_sample_gets_what_it_gets_alone(
    model, tokenizer
):
    """A request's n samples (one prompt, seeds s, s+1, ...) start from one prefill: the other
    rows get its keys and values, so sample j is what seed s + j gives alone, bit for bit (a
    forward of several rows may round otherwise than one of one)."""
    prompt = tokenizer.encode(TOGETHER[0])
    cfgs = [SampleConfig(max_new_tokens=8, temperature=1.0, seed=s) for s in (3, 4, 5)]
    seqs = [Sequence(prompt, cfg, asyncio.Queue(), index=j) for j, cfg in enumerate(cfgs)]
    seqs.append(Sequence(tokenizer.encode(TOGETHER[1]), cfgs[0], asyncio.Queue()))
    batcher = Batcher(copy.deepcopy(model), tokenizer, max_batch=4)
    prefills = counting_prefills(batcher)

    out = submitted_together(batcher, seqs)
    assert prefills[0] == 2  # the prompt once, beside the other prompt: not four rows
    for seq, got in zip(seqs, out):
        assert got["ids"] == alone(model, tokenizer, seq.prompt, seq.cfg)[0]
    assert len({tuple(got["ids"]) for got in out[:3]}) == 3


def test_a_requests_n_samples_count_their_prompt_once_against_the_prefill_budget(model, tokenizer):
    """The n samples of a request are prefilled once (the other rows copied), so the prefill
    budget counts their prompt once: a budget of one prompt admits all four samples in one step
    (before, it charged each sample the prompt and admitted one a step), and the next prompt in
    the step after."""
    prompt = tokenizer.encode(TOGETHER[0])
    cfgs = [SampleConfig(max_new_tokens=2, temperature=1.0, seed=s) for s in range(4)]
    seqs = [Sequence(prompt, cfg, asyncio.Queue(), index=j) for j, cfg in enumerate(cfgs)]
    seqs.append(Sequence(tokenizer.encode(TOGETHER[1]), cfgs[0], asyncio.Queue()))
    batcher = Batcher(copy.deepcopy(model), tokenizer, max_batch=5, prefill_tokens=len(prompt))
    prefills = counting_prefills(batcher)
    admitted = []  # the sequences each step admits
    real_admit = batcher._admit

    def admit():
        slots = real_admit()
        admitted.append(len(slots))
        return slots

    batcher._admit = admit
    out = submitted_together(batcher, seqs)
    assert [n for n in admitted if n] == [4, 1] and prefills == [1, 1]
    for seq, got in zip(seqs, out):
        assert got["ids"] == alone(model, tokenizer, seq.prompt, seq.cfg)[0]


def test_n_samples_of_a_prompt_whose_prefix_is_cached_are_prefilled_once(model, tokenizer):
    """A request's samples whose prompt begins with a cached prefix: the first loads it and
    prefills the rest, the others copy its row (before, each loaded and prefilled the rest
    alone), each sample what it gets alone."""
    from gptkiln.serve.prefix_cache import PrefixCache

    cfgs = [SampleConfig(max_new_tokens=4, temperature=1.0, seed=s) for s in (7, 8, 9)]
    warm = Sequence(tokenizer.encode("the quick brown fox "), cfgs[0], asyncio.Queue())
    prompt = tokenizer.encode("the quick brown fox jumps")
    seqs = [Sequence(prompt, cfg, asyncio.Queue(), index=j) for j, cfg in enumerate(cfgs)]

    def small_blocks(batcher):
        batcher.prefix_cache = PrefixCache(batcher.model, block_tokens=4)

    got, batcher = run_together(model, tokenizer, seqs, small_blocks, [warm], max_batch=4)
    cache = batcher.prefix_cache
    assert (cache.lookups, cache.hits, cache.hit_tokens) == (2, 1, 20)  # warm's, then once
    for seq, events in zip(seqs, got):
        assert ids_and_text(events) == alone(model, tokenizer, seq.prompt, seq.cfg)
        assert seq.cached == 20  # each sample's usage says what the cache held


def test_prefill_groups_keep_the_padding_small():
    def slots(*lengths):
        return [types.SimpleNamespace(seq=types.SimpleNamespace(prompt=[0] * n)) for n in lengths]

    def lengths(groups):
        return [[len(s.seq.prompt) for s in g] for g in groups]

    # by length; 96 joins the 160s (480 padded for 416), 48 not 96 (192 padded for 144)
    groups = prefill_groups(slots(160, 16, 96, 48, 16, 160))
    assert lengths(groups) == [[16, 16], [48], [96, 160, 160]]
    assert lengths(prefill_groups(slots(9, 8, 9, 5))) == [[5, 8, 9, 9]]  # 36 padded for 31
    assert lengths(prefill_groups(slots(1, 9))) == [[1], [9]]  # 18 for 10: apart
    assert prefill_groups([]) == []


def test_seeded_sampling_penalties_and_top_k_p_equal_alone(model, tokenizer):
    cfgs = [
        SampleConfig(max_new_tokens=15, temperature=1.0, seed=1),
        SampleConfig(max_new_tokens=10, temperature=0.7, top_k=5, seed=2),
        SampleConfig(max_new_tokens=12, temperature=1.2, top_p=0.8, seed=3, frequency_penalty=1.5),
        SampleConfig(max_new_tokens=8, temperature=0, presence_penalty=2.0),
    ]
    arrivals = staggered(tokenizer, cfgs)
    out, _ = run_batcher(model, tokenizer, arrivals, max_batch=4)
    check_each_equals_alone(model, tokenizer, arrivals, out)


def test_repetition_penalty_and_min_p_equal_alone(model, tokenizer):
    """A row's repetition penalty counts its own prompt, never another row's; min-p groups
    with the rows that sample alike."""
    cfgs = [
        SampleConfig(max_new_tokens=12, temperature=0, repetition_penalty=1.5),
        SampleConfig(max_new_tokens=12, temperature=1.1, min_p=0.2, seed=4),
        SampleConfig(max_new_tokens=12, temperature=1.1, min_p=0.2, seed=6),
        SampleConfig(max_new_tokens=12, temperature=0.9, repetition_penalty=1.3, seed=5),
    ]
    arrivals = staggered(tokenizer, cfgs)
    out, _ = run_batcher(model, tokenizer, arrivals, max_batch=4)
    check_each_equals_alone(model, tokenizer, arrivals, out)
    plain = SampleConfig(max_new_tokens=12, temperature=0)
    assert (
        out[id(arrivals[0][1][0])]["ids"]
        != alone(model, tokenizer, arrivals[0][1][0].prompt, plain)[0]
    )


def test_a_stop_string_ends_a_row_and_is_not_returned(model, tokenizer):
    prompt = tokenizer.encode("the quick")
    free = alone(model, tokenizer, prompt, SampleConfig(max_new_tokens=20, temperature=0))[1]
    stop = free[5:7]  # a string the greedy text is known to produce
    cfg = SampleConfig(max_new_tokens=20, temperature=0, stop=(stop,))
    arrivals = [(0, [Sequence(prompt, cfg, asyncio.Queue())])]
    out, _ = run_batcher(model, tokenizer, arrivals)
    got = out[id(arrivals[0][1][0])]
    assert got["reason"] == "stop" and got["text"] == free[: free.index(stop)]
    assert got["text"] == alone(model, tokenizer, prompt, cfg)[1]
    assert got["n"] < 20


def test_prompt_logprobs_are_the_models_own(model, tokenizer):
    prompt = tokenizer.encode("the lazy dog")
    cfg = SampleConfig(max_new_tokens=0)
    seq = Sequence(prompt, cfg, asyncio.Queue(), logprobs=2, prompt_logprobs=True)
    out, _ = run_batcher(model, tokenizer, [(0, [seq])])
    got = out[id(seq)]
    assert got["reason"] == "length" and got["ids"] == []
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt]))[0], -1)  # (T, V)
    assert got["prompt"][0] is None
    for t, entry in enumerate(got["prompt"][1:]):
        assert entry.logprob == pytest.approx(float(logp[t, prompt[t + 1]]), abs=1e-5)
        assert [i for i, _ in entry.top] == logp[t].topk(2).indices.tolist()


def test_a_cancelled_sequence_frees_its_slot_at_the_next_step(model, tokenizer):
    batcher = Batcher(copy.deepcopy(model), tokenizer, max_batch=1, max_queue=1)
    cfg = SampleConfig(max_new_tokens=40, temperature=0)
    first = Sequence(tokenizer.encode("the"), cfg, asyncio.Queue())
    second = Sequence(
        tokenizer.encode("a"), SampleConfig(max_new_tokens=3, temperature=0), asyncio.Queue()
    )

    async def main():
        await batcher.start()
        try:
            batcher.submit([first])
            await first.events.get()  # it is decoding
            batcher.submit([second])
            with pytest.raises(QueueFull):  # one row busy, one waiting: full
                batcher.submit([Sequence([1], cfg, asyncio.Queue())])
            first.cancelled = True
            got = await asyncio.wait_for(collect(second), timeout=10)
            return got, first.events.qsize()
        finally:
            await batcher.stop()

    got, first_events = asyncio.run(main())
    assert got["n"] == 3
    assert first_events < 38  # first stopped long before its 40 tokens


def test_a_full_cache_row_count_is_never_exceeded(model, tokenizer):
    cfg = SampleConfig(max_new_tokens=6, temperature=0)
    seqs = [Sequence(tokenizer.encode(p), cfg, asyncio.Queue()) for p in PROMPTS * 2]
    seen = []
    batcher = Batcher(
        copy.deepcopy(model),
        tokenizer,
        max_batch=3,
        max_queue=8,
        on_token=lambda first, s: seen.append(batcher.active),
    )

    async def main():
        await batcher.start()
        try:
            batcher.submit(seqs)
            return [await collect(s) for s in seqs]
        finally:
            await batcher.stop()

    results = asyncio.run(main())
    assert max(seen) == 3 and all(r["n"] == 6 for r in results)


def test_a_row_that_fails_ends_alone(model, tokenizer):
    cfg = SampleConfig(max_new_tokens=12, temperature=0)
    doomed, fine = tokenizer.encode("a"), tokenizer.encode("dog")
    bad = alone(model, tokenizer, doomed, cfg)[0][3]  # the 4th token "a" gets, its first one
    assert bad not in alone(model, tokenizer, fine, cfg)[0]

    class Fussy:  # a tokenizer that cannot decode one id
        eot_id = tokenizer.eot_id

        def decode(self, ids):
            if bad in ids:
                raise KeyError(bad)
            return tokenizer.decode(ids)

    seqs = [Sequence(doomed, cfg, asyncio.Queue()), Sequence(fine, cfg, asyncio.Queue())]
    batcher = Batcher(copy.deepcopy(model), Fussy(), max_batch=2)

    async def main():
        await batcher.start()
        try:
            batcher.submit(seqs)
            events = []
            while not events or not isinstance(events[-1], Failed):
                events.append(await seqs[0].events.get())
            return events, await collect(seqs[1])
        finally:
            await batcher.stop()

    events, other = asyncio.run(main())
    assert "KeyError" in events[-1].message and len(events) == 4  # 3 tokens, then the failure
    assert other["text"] == alone(model, tokenizer, fine, cfg)[1]


def test_a_failed_step_ends_its_sequences_and_the_loop_goes_on(model, tokenizer):
    batcher = Batcher(copy.deepcopy(model), tokenizer, max_batch=2)
    real = batcher.model.forward
    calls = {"decode": 0}

    def flaky(idx, *args, start_pos=None, **kwargs):
        if isinstance(start_pos, torch.Tensor):
            calls["decode"] += 1
            if calls["decode"] == 2:  # the second decode step fails
                raise RuntimeError("out of memory (pretend)")
        return real(idx, *args, start_pos=start_pos, **kwargs)

    batcher.model.forward = flaky
    cfg = SampleConfig(max_new_tokens=8, temperature=0)
    first = [Sequence(tokenizer.encode(p), cfg, asyncio.Queue()) for p in ("the", "fox")]
    later = Sequence(tokenizer.encode("dog"), cfg, asyncio.Queue())

    async def main():
        await batcher.start()
        try:
            batcher.submit(first)
            failed = []
            for seq in first:
                event = await seq.events.get()
                while not isinstance(event, Failed):
                    event = await seq.events.get()
                failed.append(event.message)
            batcher.submit([later])
            return failed, await collect(later)
        finally:
            await batcher.stop()

    failed, got = asyncio.run(main())
    assert all("out of memory (pretend)" in m for m in failed)
    assert got["text"] == alone(model, tokenizer, later.prompt, cfg)[1]


def test_the_cpu_backend_plans_a_servers_decoding_on_the_cpu_only(model, tokenizer, monkeypatch):
    import gptkiln.serve.batcher as batcher_module

    planned = []
    monkeypatch.setattr(
        batcher_module, "prepare_for_decoding", lambda m, buckets, **kw: planned.append(buckets)
    )
    on_cpu = Batcher(copy.deepcopy(model), tokenizer, max_batch=4)
    on_cpu._prepare()
    assert planned == [[1, 2, 4]]  # every bucket's kernels, timed on this machine's cores
    elsewhere = Batcher(copy.deepcopy(model).to("meta"), tokenizer, max_batch=4)  # as a GPU
    elsewhere._prepare()
    assert planned == [[1, 2, 4]] and elsewhere.plan is None and elsewhere.graphs is None


# -- the first tokens of a step's prompts, chosen together -------------------------------------
def run_together(model, tokenizer, seqs, setup=None, warm=(), **options):
    """Submit ``warm`` one by one (each to its end), then ``seqs`` at once: each one's events,
    up to its `Done` or `Failed`; and the batcher."""
    batcher = Batcher(copy.deepcopy(model), tokenizer, **options)
    if setup is not None:
        setup(batcher)

    async def main():
        await batcher.start()
        try:
            for seq in warm:
                batcher.submit([seq])
                await collect(seq)
            batcher.submit(seqs)
            got = []
            for seq in seqs:
                events = []
                while not events or not isinstance(events[-1], (Done, Failed)):
                    events.append(await seq.events.get())
                got.append(events)
            return got
        finally:
            await batcher.stop()

    return asyncio.run(main()), batcher


def ids_and_text(events):
    ids = [e.id for e in events if isinstance(e, Token)]
    return ids, "".join(e.text for e in events if isinstance(e, (Token, Done)))


def draw_sizes(monkeypatch) -> list[int]:
    """The rows of every `sample_rows` call the chooser makes, in order."""
    from gptkiln.serve import choosing

    sizes, real = [], choosing.sample_rows

    def counted(logits, *args):
        sizes.append(logits.shape[0])
        return real(logits, *args)

    monkeypatch.setattr(choosing, "sample_rows", counted)
    return sizes


@pytest.mark.parametrize("where", ["after its group's draw", "in its group's draw"])
def test_a_row_whose_first_token_fails_ends_alone_beside_its_group(
    model, tokenizer, monkeypatch, where
):
    """Three seeded rows of one setting, their first tokens drawn together; one row's choosing
    fails at its first token (after the group's draw picked it, or while its logits are made
    for the draw, which then falls back to each row alone): that row gets `Failed` and
    nothing else, the others what they get alone."""
    from gptkiln.serve import choosing

    sizes = draw_sizes(monkeypatch)
    cfg = SampleConfig(
        max_new_tokens=6, temperature=1.0, seed=3, presence_penalty=0.5, frequency_penalty=0.5
    )
    seqs = [Sequence(tokenizer.encode(p), cfg, asyncio.Queue()) for p in PROMPTS[:3]]
    doomed = seqs[1]
    after = where.startswith("after")
    method = "_choose" if after else "_row_logits"
    real = getattr(choosing.Chooser, method)

    def fussy(self, slot, *args, **kwargs):
        if slot.seq is doomed and slot.generated == 0:
            raise RuntimeError("this row's own fault (pretend)")
        return real(self, slot, *args, **kwargs)

    monkeypatch.setattr(choosing.Chooser, method, fussy)
    got, _ = run_together(model, tokenizer, seqs, max_batch=4)
    assert len(got[1]) == 1 and "own fault" in got[1][0].message
    for i in (0, 2):
        assert ids_and_text(got[i]) == alone(model, tokenizer, seqs[i].prompt, cfg)
    # the first tokens in one draw, then the two left; or, the group's draw failed, each alone
    assert sizes[:2] == ([3, 2] if after else [1, 1])


def test_a_cached_prefix_a_fresh_and_a_scored_prompts_first_tokens_are_drawn_together(
    model, tokenizer, monkeypatch
):
    """A prompt whose prefix the cache holds (its rest prefilled alone), two fresh ones
    (prefilled together) and a scored one: their first tokens in one draw, each what it gets
    alone, the scored one's `PromptLogprobs` before its first `Token`; one asking for no
    tokens just `Done`."""
    from gptkiln.serve.prefix_cache import PrefixCache

    sizes = draw_sizes(monkeypatch)
    cfg = SampleConfig(max_new_tokens=5, temperature=1.0, seed=11)
    warm = Sequence(tokenizer.encode("the quick brown fox "), cfg, asyncio.Queue())
    cached = Sequence(tokenizer.encode("the quick brown fox jumps"), cfg, asyncio.Queue())
    fresh = [Sequence(tokenizer.encode(p), cfg, asyncio.Queue()) for p in ("over", "lazy")]
    scored = Sequence(tokenizer.encode("a dog"), cfg, asyncio.Queue(), prompt_logprobs=True)
    none = Sequence(tokenizer.encode("dog"), SampleConfig(max_new_tokens=0), asyncio.Queue())
    seqs = [cached, *fresh, scored, none]

    def small_blocks(batcher):
        batcher.prefix_cache = PrefixCache(batcher.model, block_tokens=4)

    got, batcher = run_together(model, tokenizer, seqs, small_blocks, [warm], max_batch=6)
    assert batcher.prefix_cache.hit_tokens == 20  # the cached prompt reused 5 blocks
    for seq, events in zip(seqs[:4], got):
        tokens = [e for e in events if not isinstance(e, PromptLogprobs)]
        assert ids_and_text(tokens) == alone(model, tokenizer, seq.prompt, cfg)
    assert isinstance(got[3][0], PromptLogprobs) and isinstance(got[3][1], Token)
    assert got[4] == [Done(0, "length", "", 0)]
    assert sizes[5] == 4  # the warm prompt's 5 draws alone, then the 4 first tokens in one
