"""The CUDA-graph decode backend (`gptkiln.gpu`) held to the eager path on the CPU: the static
step's logits, the compiled step's greedy ids, the buckets, sampling on the device.

The step is compiled here as on CUDA (``fullgraph=True``, static shapes) with the ``aot_eager``
backend: the same trace and functionalised graph without inductor's ~30 s compile per graph
(one slow test runs inductor). The real capture is tests/test_gpu.py's.
"""

import dataclasses
from functools import partial

import pytest
import torch
from test_families import randomize_, small_config

from gptkiln.config import GPTConfig, SampleConfig
from gptkiln.gpu import (
    DeviceSampling,
    StaticState,
    bucket_length,
    bucket_rows,
    compile_options,
    decode_static,
    prepare_graphs,
)
from gptkiln.gpu.step import counter_uniform, sample_on_device
from gptkiln.model import GPT
from gptkiln.sampling import decode_one_token, generate, left_pad, logits_to_probs, prefill

PROMPTS = {"one": [[5, 6, 7, 8]], "padded": [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]}
graphs = partial(prepare_graphs, min_steps=0)


def tiny(family: str) -> GPT:
    """A random model of ``family``; ``"gpt2-padded"``: the GPT-2 one's weights in a model with
    its vocabulary padded to 128 rows (``--pad-vocab``, CUDA's default), the extra rows' head
    weights large, so that a step reading past the 97 ids would pick one."""
    torch.manual_seed(0)
    if family == "gpt2-padded":
        plain = tiny("gpt2")
        model = GPT(dataclasses.replace(plain.config, padded_vocab_size=128))
        with torch.no_grad():
            for name, p in model.named_parameters():
                source = plain.get_parameter(name)
                p[: source.shape[0]] = source
            model.lm_head.weight[plain.config.vocab_size :] = 5.0
        return model
    if family == "gpt2":  # untied: a fresh tied model's greedy output repeats its last token
        config = GPTConfig.from_name(
            "tiny", vocab_size=97, tie_embeddings=False, n_embd=64, n_head=4
        )
    else:
        config = small_config(family, n_layer=2)
    return randomize_(GPT(config))


@pytest.fixture(scope="module", params=("gpt2", "qwen3", "gpt2-padded"))
def model(request) -> GPT:
    return tiny(request.param)


@pytest.mark.parametrize("batch", PROMPTS)
def test_static_step_logits_equal_the_eager_steps(model, batch):
    idx, pads = left_pad(PROMPTS[batch], 0, "cpu")
    B, T = idx.shape
    tokens = torch.randint(0, 97, (B, 6), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model.setup_cache(B, T + 6, pads)
        prefill(model, idx)
        eager = [decode_one_token(model, tokens[:, i], T + i) for i in range(6)]
        model.setup_cache(B, T + 6, pads)
        prefill(model, idx)
        state = StaticState(model, 4, 32, torch.float32, "cpu")  # 4 rows, 32 slots: padding
        state.load(model, T, [0] * B, None)
        for i in range(6):
            state.token[:B] = tokens[:, i]
            static = decode_static(model, state.token, state.slots, state.pads)[:B]
            state.slots += 1
            torch.testing.assert_close(static, eager[i], atol=2e-5, rtol=1e-5)
        model.clear_cache()


@pytest.mark.parametrize("batch", PROMPTS)
def test_compiled_greedy_ids_equal_the_eager_ones(model, batch):
    eager = generate(model, PROMPTS[batch], max_new_tokens=12, temperature=0)
    assert len({t for row in eager for t in row}) > 1  # not one token repeated
    assert max(t for row in eager for t in row) < model.config.vocab_size  # no padding row
    assert generate(model, PROMPTS[batch], max_new_tokens=12, temperature=0, prepare=graphs) == (
        eager
    )
    T = max(len(p) for p in PROMPTS[batch])
    length = bucket_length(T + 11, model.config.context_length)
    state = model.graph_decoder.states[bucket_rows(len(eager)), length]
    assert state.slots.tolist() == [T + 11] * state.rows  # the graph fed the 11 later tokens


def test_graph_steps_read_a_step_behind_give_the_eager_ids_of_rows_that_end(model):
    """Rows ending at different steps (an end-of-text id, a stop string) while the next graph
    replay is queued before the host reads each step (`generate_stream`'s ``read_ahead``, on
    by itself on CUDA): the eager path's ids, one replay past the last step read."""
    from gptkiln.tokenizers import CharTokenizer

    tok = CharTokenizer([chr(0x41 + i) for i in range(model.config.vocab_size)], with_eot=False)
    prompts = PROMPTS["padded"]
    free = generate(model, prompts, max_new_tokens=16, temperature=0)
    kw = dict(max_new_tokens=16, temperature=0, eot_id=free[0][5])
    kw.update(stop=[tok.decode(free[1][8:10])], tokenizer=tok)
    eager = generate(model, prompts, **kw)
    assert eager != free and max(len(r) for r in eager) < 16  # every row ended early
    fed = {}
    for ahead in (False, True):
        model.__dict__.pop("graph_decoder", None)
        assert generate(model, prompts, prepare=graphs, read_ahead=ahead, **kw) == eager
        (state,) = model.graph_decoder.states.values()
        fed[ahead] = state.slots[0].item()
    assert fed[True] == fed[False] + 1  # the one replay queued ahead of the last read


@pytest.mark.parametrize(
    "penalties",
    [
        dict(frequency_penalty=0.8, presence_penalty=0.3),
        dict(repetition_penalty=1.6),
        dict(logit_bias={3: 4.0, 9: -100.0}),
    ],
)
def test_penalties_on_the_device_equal_the_eager_ones(model, penalties):
    kw = dict(max_new_tokens=12, temperature=0, **penalties)
    eager = generate(model, PROMPTS["padded"], **kw)
    assert eager != generate(model, PROMPTS["padded"], max_new_tokens=12, temperature=0)
    assert generate(model, PROMPTS["padded"], prepare=graphs, **kw) == eager


def test_min_p_on_the_device_keeps_what_the_eager_draw_keeps(model):
    """A min-p so high that only the likeliest token is left: the device's draw (its own
    uniforms) then picks the eager path's greedy ids, every step."""
    kw = dict(max_new_tokens=10, temperature=1.0, seed=3)
    greedy = generate(model, PROMPTS["padded"], max_new_tokens=10, temperature=0)
    assert generate(model, PROMPTS["padded"], **kw) != greedy  # a draw, without min-p
    assert generate(model, PROMPTS["padded"], prepare=graphs, min_p=1.0, **kw) == greedy
    assert generate(model, PROMPTS["padded"], min_p=1.0, **kw) == greedy


def test_a_window_that_slides_past_the_context_goes_on_eagerly():
    model = tiny("qwen3")  # context 32: 20 + 24 tokens slide the window
    prompt = list(range(1, 21))
    eager = generate(model, prompt, max_new_tokens=24, temperature=0)
    assert generate(model, prompt, max_new_tokens=24, temperature=0, prepare=graphs) == eager


def test_rows_map_onto_buckets():
    assert [bucket_rows(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]
    assert bucket_length(10, 1024) == 256  # the shortest bucket
    assert bucket_length(300, 1024) == 512
    assert bucket_length(900, 1024) == 1024
    assert bucket_length(40, 32) == 32  # never past the context
    with pytest.raises(ValueError):
        bucket_rows(0)


@pytest.mark.parametrize("temperature", (0, 0.9))
def test_padded_rows_never_reach_the_real_rows(model, temperature):
    """A row's tokens in a batch of 3 (bucket 4: one filler row, and left padding) are those it
    gets alone (bucket 1), greedy and seeded."""
    kw = dict(max_new_tokens=10, temperature=temperature, top_k=40, seed=7, prepare=graphs)
    model.__dict__.pop("graph_decoder", None)  # fresh buckets
    batch = generate(model, PROMPTS["padded"], **kw)
    assert batch == [generate(model, p, **kw) for p in PROMPTS["padded"]]
    assert sorted(rows for rows, _ in model.graph_decoder.states) == [1, 4]


def test_seeded_sampling_on_the_device_is_reproducible(model):
    kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.95, prepare=graphs)
    first = generate(model, PROMPTS["padded"], seed=3, **kw)
    assert first == generate(model, PROMPTS["padded"], seed=3, **kw)
    assert first != generate(model, PROMPTS["padded"], seed=4, **kw)
    assert first != generate(model, PROMPTS["padded"], max_new_tokens=16, temperature=0)


def test_sampling_on_the_device_draws_from_the_filtered_distribution():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)) * 2
    probs = logits_to_probs(logits, 0.8, top_k=10)
    n = 20_000
    seeds = torch.full((n,), 11)
    drawn = sample_on_device(logits.expand(n, -1), 0.8, 10, None, seeds, torch.arange(n))
    assert set(drawn.tolist()) <= set(probs.nonzero()[:, 1].tolist())  # top-k only
    freq = torch.bincount(drawn, minlength=50).float() / n
    assert (freq - probs[0]).abs().max() < 0.02  # 3.5 sigma of the largest p's frequency
    greedy = sample_on_device(logits, 0, None, None, seeds[:1], torch.zeros(1))
    assert greedy.tolist() == logits.argmax(-1).tolist()


def test_counter_uniforms_are_uniform_and_depend_on_seed_and_draw():
    u = counter_uniform(torch.tensor([1, 1, 2, 2**40]), torch.tensor([0, 1, 0, 0]), 4096)
    assert ((u > 0) & (u < 1)).all()
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    for a, b in ((0, 1), (0, 2), (0, 3)):
        assert (u[a] != u[b]).float().mean() > 0.99
    again = counter_uniform(torch.tensor([1]), torch.tensor([0]), 4096)
    assert torch.equal(again[0], u[0])


def test_short_decodings_and_the_switch_decline_the_graphs(model, monkeypatch):
    plan = prepare_graphs(model, 1, 3)  # fewer steps than GRAPHS_FROM
    assert plan.sampling_steps(None, [None], None, 4) is None
    monkeypatch.setenv("GPTKILN_CUDA_GRAPHS", "0")
    assert prepare_graphs(model, 1, 100) is None


def test_compile_options_capture_cuda_graphs_on_cuda_only():
    assert compile_options("cuda")["mode"] == "reduce-overhead"
    assert compile_options("cuda")["fullgraph"] and not compile_options("cuda")["dynamic"]
    assert compile_options("cpu")["backend"] == "aot_eager"
    assert compile_options("cpu", "inductor")["backend"] == "inductor"


def test_device_sampling_is_a_constant_of_the_graph():
    assert DeviceSampling(0.5, 3) == DeviceSampling(0.5, 3)  # equal settings: one graph
    assert hash(DeviceSampling(0.5, 3)) == hash(DeviceSampling(0.5, 3))
    assert DeviceSampling(0, presence_penalty=0.1).penalised and not DeviceSampling().penalised
    assert DeviceSampling(0, repetition_penalty=1.2).penalised
    cfg = SampleConfig(temperature=0.5, top_k=3, min_p=0.1, repetition_penalty=1.1)
    assert DeviceSampling.of(cfg) == DeviceSampling(0.5, 3, None, 0.0, 0.0, 0.1, 1.1, ())


def test_a_bucket_decodes_with_more_settings_than_dynamos_recompile_limit(monkeypatch):
    """Each sampling setting a bucket decodes with gets a compiled step of its own, so a process
    may use more settings than dynamo's recompile limit (8: one shared step failed at the
    ninth, fullgraph); past `KEPT_SETTINGS` the least recently used is dropped."""
    import gptkiln.gpu.graphs as graphs_module

    monkeypatch.setattr(graphs_module, "KEPT_SETTINGS", 4, raising=False)
    model = tiny("gpt2")
    temperatures = [0.5 + 0.1 * i for i in range(10)]
    first = [
        generate(model, [1, 2, 3], max_new_tokens=4, temperature=t, seed=1, prepare=graphs)
        for t in temperatures
    ]
    (key,) = model.graph_decoder.states
    kept = model.graph_decoder.steps[key]
    assert [s.temperature for s in kept] == temperatures[-4:]  # the most recent four
    again = generate(model, [1, 2, 3], max_new_tokens=4, temperature=0.5, seed=1, prepare=graphs)
    assert again == first[0] and next(reversed(kept)).temperature == 0.5  # compiled again
    t7, t8, t9 = temperatures[-3:]  # kept now: t7, t8, t9, 0.5
    step = next(v for s, v in kept.items() if s.temperature == t7)
    generate(model, [1, 2, 3], max_new_tokens=4, temperature=t7, prepare=graphs)  # used again
    generate(model, [1, 2, 3], max_new_tokens=4, temperature=2.0, prepare=graphs)  # one more
    assert [s.temperature for s in kept] == [t9, 0.5, t7, 2.0]  # t8, the least recent, dropped
    assert next(v for s, v in kept.items() if s.temperature == t7) is step  # not compiled again


@pytest.mark.slow
def test_inductor_compiled_step_gives_the_eager_greedy_ids():
    model = tiny("qwen3")
    eager = generate(model, PROMPTS["padded"], max_new_tokens=8, temperature=0)
    prepare = partial(prepare_graphs, backend="inductor", min_steps=0)
    assert generate(model, PROMPTS["padded"], max_new_tokens=8, temperature=0, prepare=prepare) == (
        eager
    )


def test_graphs_apply_to_float_models_on_cuda_only(model):
    from gptkiln.gpu import graphs_for

    assert graphs_for(model) is None  # on the CPU: the CPU backend's
    assert graphs_for(GPT(GPTConfig.from_name("tiny", vocab_size=97)).to("meta")) is None


def test_a_model_cast_to_another_dtype_gets_buckets_of_its_own():
    model = tiny("gpt2")
    generate(model, [1, 2, 3], max_new_tokens=4, temperature=0, prepare=graphs)
    (key,) = model.graph_decoder.states
    model.to(torch.bfloat16)
    ids = generate(model, [1, 2, 3], max_new_tokens=4, temperature=0, prepare=graphs)
    assert model.graph_decoder.states[key].dtype == torch.bfloat16 and len(ids) == 4


# -- serve's batcher: its decode forward compiled per bucket -----------------------------------
def test_the_batchers_requests_by_row_graphs_get_what_each_gets_alone(monkeypatch):
    """Requests joining and leaving the continuous batch at staggered steps, their decode
    forwards at static shapes in the buckets' compiled graphs: each gets what it gets alone."""
    import test_serve_batcher as serving

    from gptkiln.config import SampleConfig
    from gptkiln.gpu import RowGraphs
    from gptkiln.serve import batcher as batching
    from gptkiln.tokenizers import build_char_tokenizer

    calls = []
    step = RowGraphs.__call__

    def counted(self, tokens, positions):
        calls.append(tokens.size(0))
        return step(self, tokens, positions)

    monkeypatch.setattr(RowGraphs, "__call__", counted)
    monkeypatch.setattr(batching, "row_graphs_for", RowGraphs)  # as on CUDA
    tokenizer = build_char_tokenizer([serving.TEXT], with_eot=False)
    torch.manual_seed(0)
    config = GPTConfig.from_name(
        "tiny", vocab_size=tokenizer.vocab_size, context_length=48, tie_embeddings=False
    )
    model = GPT(config).eval()
    cfgs = [SampleConfig(max_new_tokens=n, temperature=0) for n in (12, 20, 5)]
    cfgs.append(SampleConfig(max_new_tokens=9, temperature=0.8, top_k=10, seed=3))
    arrivals = serving.staggered(tokenizer, cfgs)
    out, batcher = serving.run_batcher(model, tokenizer, arrivals, max_batch=3)
    serving.check_each_equals_alone(model, tokenizer, arrivals, out)
    assert len(set(calls)) > 1 and set(calls) <= {1, 2, 3}  # several buckets, each a graph
