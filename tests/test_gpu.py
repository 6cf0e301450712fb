"""CUDA paths: bf16 autocast training, torch.compile, cached generation, harness scoring on the GPU.

Skipped without a GPU (CI has none); run them on a machine with one: ``pytest -m gpu``.
"""

import pytest
import torch

from gptkiln.config import GPTConfig, TrainConfig
from gptkiln.model import GPT
from gptkiln.sampling import generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_bf16_autocast_training_step_on_cuda():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("baby", vocab_size=512)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    idx = torch.randint(0, 512, (8, 64), device="cuda")
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(idx, idx.roll(-1, dims=1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


def test_compiled_model_matches_eager_on_cuda():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=256)).cuda().eval()
    compiled = torch.compile(model)
    idx = torch.randint(0, 256, (2, 32), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(compiled(idx), model(idx), atol=1e-4, rtol=1e-4)


def test_kv_cache_generation_on_cuda_equals_no_cache():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=256, context_length=32)).cuda().eval()
    prompt = torch.randint(0, 256, (5,)).tolist()
    cached = generate(model, prompt, max_new_tokens=30, temperature=0)
    assert cached == generate(model, prompt, max_new_tokens=30, temperature=0, use_cache=False)


@pytest.mark.parametrize("model", ["tiny", "qwen3-baby"])  # GPT-2, and a family preset
def test_trainer_picks_cuda_and_trains_in_bf16_auto(tmp_path, model, capsys):
    """On CUDA, unset: bf16 autocast, the model compiled, its vocabulary padded to 64 rows a
    multiple (the char alphabet's few dozen ids to 64)."""
    import json

    from gptkiln.devices import resolve_device
    from gptkiln.train import train

    assert resolve_device("auto") == "cuda"
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question. " * 200)
    result = train(
        TrainConfig(
            data=str(text),
            out=str(tmp_path / "run"),
            model=model,
            tokenizer="char",
            context_length=32,
            batch_size=8,
            max_steps=30,
            eval_interval=30,
            sample_interval=30,
            sample_prompt="to be",
            progress=False,
        )
    )
    assert result.val_loss < 3.0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["train"]["precision"] == "bf16"  # auto on CUDA
    assert config["model"]["padded_vocab_size"] == 64 > config["model"]["vocab_size"]
    assert "compiling the model with torch.compile" in capsys.readouterr().out


def test_int8_model_on_cuda_in_bf16_generates_as_on_the_cpu(tmp_path):
    from gptkiln.checkpoint import save_model
    from gptkiln.loading import load_model
    from gptkiln.quantize import quantize_model

    torch.manual_seed(0)
    model = quantize_model(GPT(GPTConfig.from_name("tiny", vocab_size=256)).eval())
    save_model(model, tmp_path / "q")
    gpu = load_model(tmp_path / "q", device="cuda", dtype=torch.bfloat16)
    assert gpu.h[0].attn.c_attn.weight.dtype == torch.int8  # int8 stays int8 under dtype=bf16
    assert gpu.h[0].attn.c_attn.weight.device.type == "cuda"
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        cpu_logits = model(idx)
        gpu_logits = gpu(idx.cuda()).float().cpu()
    torch.testing.assert_close(gpu_logits, cpu_logits, atol=0.05, rtol=0.05)  # bf16 activations
    prompt = idx[0, :5].tolist()
    cached = generate(gpu, prompt, max_new_tokens=20, temperature=0)
    assert cached == generate(gpu, prompt, max_new_tokens=20, temperature=0, use_cache=False)


# -- the Llama 3 and Qwen3 families on CUDA ---------------------------------------------------
@pytest.fixture(params=("llama3", "qwen3"))
def family_model(request) -> GPT:
    from test_families import randomize_, small_config

    torch.manual_seed(0)
    return randomize_(GPT(small_config(request.param)))


def test_family_logits_on_cuda_equal_the_cpus(family_model):
    idx = torch.randint(0, 97, (2, 32))
    with torch.no_grad():
        cpu_logits = family_model(idx)
        gpu = family_model.cuda()
        torch.testing.assert_close(gpu(idx.cuda()).cpu(), cpu_logits, atol=1e-4, rtol=1e-4)
        bf16_logits = gpu.to(torch.bfloat16)(idx.cuda()).float().cpu()
    torch.testing.assert_close(bf16_logits, cpu_logits, atol=0.25, rtol=0.05)


def test_family_cached_and_left_padded_generation_on_cuda(family_model):
    gpu = family_model.cuda()
    prompts = [[5, 9, 11], [7, 3, 2, 8, 1, 4], [13]]
    alone = [generate(gpu, p, max_new_tokens=12, temperature=0) for p in prompts]
    for p, out in zip(prompts, alone):
        assert out == generate(gpu, p, max_new_tokens=12, temperature=0, use_cache=False)
    assert generate(gpu, prompts, max_new_tokens=12, temperature=0) == alone  # left-padded
    bf16 = gpu.to(torch.bfloat16)
    idx = torch.tensor([alone[1]], device="cuda")
    with torch.no_grad():
        full = bf16(idx)[0, -1].float()
        bf16.setup_cache(1, idx.size(1))
        try:
            bf16(idx[:, :-1], start_pos=0)
            step = bf16(idx[:, -1:], start_pos=idx.size(1) - 1)[0, -1].float()
        finally:
            bf16.clear_cache()
    torch.testing.assert_close(step, full, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_family_compiled_bf16_training_reduces_the_loss_on_cuda(family):
    from test_families import small_config

    torch.manual_seed(0)
    model = GPT(small_config(family)).cuda()
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    idx = torch.randint(0, 97, (8, 32), device="cuda")
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = compiled(idx, idx.roll(-1, dims=1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


# -- lm-evaluation-harness scoring on CUDA -----------------------------------------------------
@pytest.mark.parametrize("shared", [True, False], ids=["shared-context", "whole-rows"])
def test_harness_scoring_on_cuda_equals_the_cpus(monkeypatch, shared):
    from test_evaluate import chain_model, some_pairs

    import gptkiln.evaluate.scoring as ev

    monkeypatch.setattr(ev, "_cheaper_shared", lambda pairs: shared)
    model = chain_model(n_embd=32)
    pairs = some_pairs(model)
    cpu = ev.score_pairs(model, pairs, batch_size=4)
    gpu = ev.score_pairs(model.cuda(), pairs, batch_size=4)
    assert [g for _, g in gpu] == [g for _, g in cpu]
    for (a, _), (b, _) in zip(gpu, cpu):
        assert a == pytest.approx(b, abs=1e-3, rel=1e-4)


# -- sampling on CUDA ---------------------------------------------------------------------------
def test_a_draw_on_cuda_never_picks_an_id_that_top_p_or_a_grammar_dropped():
    """A single row's running sum on CUDA is a parallel scan (CUB's), which may step by an ulp
    over an id of probability 0: `draw` makes it flat there, so a dropped id is never drawn."""
    from gptkiln.sampling import draw, flat_over_zeros, logits_to_probs

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(1, 50257, device="cuda", generator=g) * 3
    logits[0, ::2] = float("-inf")  # a grammar's mask: every other id forbidden
    probs = logits_to_probs(logits, 1.0, top_p=0.9)
    zero = probs[0] == 0
    picked = torch.cat([draw(probs, g) for _ in range(4000)])  # one row at a time: CUB's scan
    picked = torch.cat([picked, draw(probs.expand(100_000, -1), g)])
    assert not zero[picked].any()
    flat = flat_over_zeros(probs, probs.cumsum(dim=-1))[0]  # what draw searches on CUDA
    steps = flat.diff()
    assert (steps >= 0).all() and (steps[zero[1:]] == 0).all()
    print(
        f"CUDA's scan of one row: {int((probs[0].cumsum(0).diff()[zero[1:]] != 0).sum())} zero ids "
        f"off by an ulp, {int((probs[0].cumsum(0).diff() < 0).sum())} falls (flattened here)"
    )


# -- CUDA-graph decoding (gptkiln.gpu) --------------------------------------------------------
GRAPH_PROMPTS = ([[5, 6, 7, 8]], [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]])


@pytest.mark.parametrize("prompts", GRAPH_PROMPTS, ids=("one", "padded"))
def test_cuda_graph_decoding_gives_the_eager_greedy_ids(family_model, prompts):
    from gptkiln.gpu import prepare_graphs

    model = family_model.cuda()
    eager = generate(model, prompts, max_new_tokens=24, temperature=0)
    graphs = generate(model, prompts, max_new_tokens=24, temperature=0, prepare=prepare_graphs)
    assert graphs == eager
    assert model.graph_decoder.states  # the graphs ran


def test_cuda_graph_steps_read_ahead_of_the_host_and_give_the_eager_ids_of_a_row_that_ends():
    """On CUDA `generate_stream` queues each replay before it reads the step before (the
    tokens copied into pinned memory behind an event): a row ending at an end-of-text id gets
    the eager path's ids, one replay more is run than read, and the stream yields the host's
    copy of each step. (One family, one row: one compile more for the lease's test run; rows
    ending at different steps are tests/test_gpu_graphs.py's, on the CPU.)"""
    from test_families import randomize_, small_config

    from gptkiln.config import SampleConfig
    from gptkiln.gpu import prepare_graphs
    from gptkiln.sampling import generate_stream

    torch.manual_seed(0)
    model = randomize_(GPT(small_config("qwen3"))).cuda()
    prompts = GRAPH_PROMPTS[0]
    free = generate(model, prompts, max_new_tokens=24, temperature=0)[0]
    eot = next(t for i, t in enumerate(free) if i >= 4 and t not in free[:i])  # mid-row
    kw = dict(max_new_tokens=24, temperature=0, eot_id=eot)
    eager = generate(model, prompts, **kw)
    assert eager == [free[: free.index(eot)]]
    fed = {}
    for read_ahead in (False, None):  # None: on CUDA, read ahead for the graph's steps
        ids = generate(model, prompts, prepare=prepare_graphs, read_ahead=read_ahead, **kw)
        assert ids == eager
        (state,) = model.graph_decoder.states.values()
        fed[read_ahead] = state.slots[0].item()
    assert fed[None] == fed[False] + 1  # one replay queued past the last step read
    cfg = SampleConfig(max_new_tokens=24, temperature=0)
    steps = list(generate_stream(model, prompts, cfg, eot, prepare=prepare_graphs))
    assert all(s.device.type == "cpu" and s.is_pinned() for s in steps)
    assert [int(s[0]) for s in steps] == eager[0] + [eot]


def test_cuda_graph_decoding_captures_once_and_replays():
    """One compile for every position of a decoding, nothing skipped by the CUDA-graph trees, and
    a second decoding of the bucket compiles nothing more."""
    from torch._dynamo.utils import counters

    from gptkiln.gpu import prepare_graphs

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=256)).cuda().eval()
    counters.clear()
    generate(model, [1, 2, 3], max_new_tokens=40, temperature=0, prepare=prepare_graphs)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["inductor"].get("cudagraph_skips")
    generate(model, [4, 5], max_new_tokens=40, temperature=0.8, seed=1, prepare=prepare_graphs)
    generate(model, [4, 5], max_new_tokens=40, temperature=0.8, seed=1, prepare=prepare_graphs)
    assert counters["stats"]["unique_graphs"] == 2  # the sampled settings: one graph more
    assert not counters["inductor"].get("cudagraph_skips")


def test_seeded_cuda_graph_sampling_is_reproducible(family_model):
    from gptkiln.gpu import prepare_graphs

    model = family_model.cuda()
    kw = dict(max_new_tokens=24, temperature=0.9, top_k=20, top_p=0.9, prepare=prepare_graphs)
    first = generate(model, GRAPH_PROMPTS[1], seed=5, **kw)
    assert first == generate(model, GRAPH_PROMPTS[1], seed=5, **kw)
    assert first != generate(model, GRAPH_PROMPTS[1], seed=6, **kw)


def test_cuda_graph_decoding_is_faster_than_eager_at_batch_1():
    import time

    from gptkiln.gpu import prepare_graphs

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("baby", vocab_size=512)).cuda().to(torch.bfloat16).eval()

    def tokens_per_s(prepare) -> float:
        generate(model, [1, 2, 3], max_new_tokens=100, temperature=0, prepare=prepare)  # warm
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        generate(model, [1, 2, 3], max_new_tokens=100, temperature=0, prepare=prepare)
        torch.cuda.synchronize()
        return 100 / (time.perf_counter() - t0)

    eager, graphs = tokens_per_s(None), tokens_per_s(prepare_graphs)
    print(f"baby, bf16, batch 1: eager {eager:.0f} tok/s, CUDA graphs {graphs:.0f} tok/s")
    assert graphs > 2 * eager


def test_generate_and_chat_decode_by_cuda_graphs_on_cuda():
    from gptkiln import api
    from gptkiln.gpu import prepare_graphs
    from gptkiln.quantize import quantize_model

    model = GPT(GPTConfig.from_name("tiny", vocab_size=256)).eval()
    assert api._decoding(model.cuda(), None) is prepare_graphs
    assert api._decoding(quantize_model(GPT(model.config).eval()).cuda(), None) is None


def test_the_batcher_on_cuda_decodes_by_row_graphs_and_each_request_gets_what_it_gets_alone():
    import test_serve_batcher as serving

    from gptkiln.config import SampleConfig
    from gptkiln.gpu import RowGraphs
    from gptkiln.tokenizers import build_char_tokenizer

    tokenizer = build_char_tokenizer([serving.TEXT], with_eot=False)
    torch.manual_seed(0)
    config = GPTConfig.from_name(
        "tiny", vocab_size=tokenizer.vocab_size, context_length=48, tie_embeddings=False
    )
    model = GPT(config).cuda().eval()
    cfgs = [SampleConfig(max_new_tokens=n, temperature=0) for n in (12, 20, 5)]
    cfgs.append(SampleConfig(max_new_tokens=9, temperature=0.8, top_k=10, seed=3))
    arrivals = serving.staggered(tokenizer, cfgs)
    out, batcher = serving.run_batcher(model, tokenizer, arrivals, max_batch=3)
    assert isinstance(batcher.graphs, RowGraphs)
    serving.check_each_equals_alone(model, tokenizer, arrivals, out)
    assert batcher.plan is None  # the CPU backend's tuner and 2 MB pages are the CPU's alone


def test_serving_a_float_run_in_bf16_on_cuda_casts_its_weights(tmp_path):
    from gptkiln.api import load_for_decoding
    from gptkiln.checkpoint import save_model
    from gptkiln.tokenizers import CharTokenizer

    tokenizer = CharTokenizer([chr(c) for c in range(32, 95)], with_eot=True)
    config = GPTConfig.from_name("llama3-baby", vocab_size=64, context_length=24)
    run = save_model(GPT(config), tmp_path / "run", tokenizer=tokenizer)
    model, _, _, precision = load_for_decoding(run, "cuda", None, "bf16")
    assert precision == "bf16" and model.wte.weight.device.type == "cuda"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope_cos.dtype == torch.float32 and model.rope_cos.is_cuda
    ids = generate(model.eval(), [[1, 2, 3]], max_new_tokens=4, temperature=0)
    assert len(ids[0]) == 4


def test_the_trainers_batches_are_read_ahead_into_pinned_memory_on_cuda():
    from gptkiln.train.optimizer_step import OptimizerStep
    from gptkiln.train.prefetch import Prefetched

    class Source:
        def get(self, step, micro):
            gen = torch.Generator().manual_seed(step)
            return tuple(torch.randint(0, 64, (2, 16), generator=gen) for _ in "xy")

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=64, context_length=16)).cuda()
    cfg = TrainConfig(out="unused", grad_accum=2, precision="bf16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = OptimizerStep(model, model, optimizer, Source(), cfg, "cuda")
    assert isinstance(step.batches, Prefetched)
    x, _ = step.batches.get(0, 0)
    assert x.is_pinned() and torch.equal(x, Source().get(0, 0)[0])
    losses = [step(s, 20, 0.0)[1] for s in range(6)]
    assert all(loss == loss for loss in losses) and step.batches._ahead[0] == (6, 0)
