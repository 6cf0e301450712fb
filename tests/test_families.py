"""The Llama 3 and Qwen3 families of the one model: their presets (counted against
transformers'), the same logits as the book's ``Llama3Model`` / ``Qwen3Model`` and as
transformers' ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` given the same weights, decoding with
the KV cache (left padding, per-row positions), training, quantization, the config's checks,
and GPT-2 left exactly as it was.

Every model here is small and random, built locally; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from gptkiln.config import PRESETS, GPTConfig
from gptkiln.cpu import planned
from gptkiln.errors import GptkilnError
from gptkiln.model import GPT, Linear, block_linears
from gptkiln.sampling import generate, left_pad

FAMILIES = ("llama3", "qwen3")
# Llama 3.1's RoPE scaling, at a size the 32-token test models stretch (transformers warns of
# an original context that is not shorter than the model's).
SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context_length=16)


def small_config(family: str, **kw) -> GPTConfig:
    """The family's baby preset at a test's size: vocab 97, context 32, untied (a fresh tied
    model's greedy output repeats its last token), Llama with RoPE scaling, Qwen with a head
    size that is not n_embd / n_head (48 x 4 heads against 128)."""
    extra = dict(rope_scaling=SCALING) if family == "llama3" else dict(head_dim=48)
    values = dict(vocab_size=97, context_length=32, tie_embeddings=False, **extra)
    return GPTConfig.from_name(f"{family}-baby", **{**values, **kw})


def randomize_(model: GPT, seed: int = 0) -> GPT:
    """Every weight random at a scale where the logits are of order 1, and every norm's weight
    other than 1, so that a swapped or dropped tensor shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms (and biases)
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=FAMILIES)
def model(request) -> GPT:
    torch.manual_seed(0)
    return randomize_(GPT(small_config(request.param)))


# -- presets ---------------------------------------------------------------------------------
PRESET_COUNTS = {
    "llama3-baby": 7_171_328,
    "qwen3-baby": 7_171_584,
    "qwen3-baby-untied": 13_604_480,  # + the head's 50,257 x 128
    "llama3-124m": 124_730_880,
    "qwen3-124m": 124_732_416,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
}


def meta_model(config: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(config)


def hf_config(config: GPTConfig):
    """The transformers config of the same model (what an export to Hugging Face writes)."""
    transformers = pytest.importorskip("transformers")
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling:
        s = config.rope_scaling
        rope = {
            "rope_type": "llama3",
            "rope_theta": config.rope_theta,
            "factor": s["factor"],
            "low_freq_factor": s["low_freq_factor"],
            "high_freq_factor": s["high_freq_factor"],
            "original_max_position_embeddings": s["original_context_length"],
        }
    cls = transformers.LlamaConfig if config.family == "llama3" else transformers.Qwen3Config
    return cls(
        vocab_size=config.vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_size,
        max_position_embeddings=config.context_length,
        rms_norm_eps=config.norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=config.qkv_bias,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="eager",
    )


def hf_model_class(config: GPTConfig):
    transformers = pytest.importorskip("transformers")
    if config.family == "llama3":
        return transformers.LlamaForCausalLM
    return transformers.Qwen3ForCausalLM


@pytest.mark.parametrize("name", PRESET_COUNTS)
def test_preset_parameter_counts_equal_transformers_models_of_the_same_config(name):
    config = GPTConfig.from_name(name)
    assert meta_model(config).num_parameters() == PRESET_COUNTS[name]
    with torch.device("meta"):
        hf = hf_model_class(config)(hf_config(config))
    assert sum(p.numel() for p in hf.parameters()) == PRESET_COUNTS[name]


def test_published_presets_are_the_books_configs():
    llama3 = pytest.importorskip("llms_from_scratch.llama3", reason="the book's package")
    qwen3 = pytest.importorskip("llms_from_scratch.qwen3", reason="the book's package")
    pairs = {
        "llama3.2-1b": llama3.LLAMA32_CONFIG_1B,
        "llama3.2-3b": llama3.LLAMA32_CONFIG_3B,
        "qwen3-0.6b": qwen3.QWEN_CONFIG_06_B,
        "qwen3-1.7b": qwen3.QWEN3_CONFIG_1_7B,
    }
    for name, book in pairs.items():
        c = GPTConfig.from_name(name)
        ours = dict(
            vocab_size=c.vocab_size,
            context_length=c.context_length,
            emb_dim=c.n_embd,
            n_heads=c.n_head,
            n_layers=c.n_layer,
            hidden_dim=c.intermediate_size,
            n_kv_groups=c.n_kv_head,
            rope_base=c.rope_theta,
        )
        assert ours == {k: book[k] for k in ours}, name
        if c.family == "llama3":
            assert c.rope_scaling == book["rope_freq"] and c.norm_eps == 1e-5
        else:
            assert (c.head_dim, c.qk_norm, c.norm_eps) == (book["head_dim"], True, 1e-6)
        assert c.tie_embeddings and not c.qkv_bias and not c.bias


def test_block_linears_are_every_linear_layer_of_a_block():
    for name in ("baby", "llama3-baby", "qwen3-baby"):
        model = meta_model(GPTConfig.from_name(name))
        found = tuple(n for n, m in model.h[0].named_modules() if isinstance(m, Linear))
        assert found == block_linears(model.config), name


# -- the same logits as the book's models and transformers' ---------------------------------
def book_model(config: GPTConfig, model: GPT):
    """The book's Llama3Model / Qwen3Model of ``config`` holding ``model``'s weights.

    The book's names -> ours: tok_emb -> wte; trf_blocks.N.att.W_query / W_key / W_value /
    out_proj -> h.N.attn.q_proj / k_proj / v_proj / o_proj; att.q_norm / k_norm (``scale``) ->
    attn.q_norm / k_norm (``weight``); norm1 / norm2 -> ln_1 / ln_2 (Llama: ``weight``, Qwen:
    ``scale``); ff.fc1 / fc2 / fc3 -> mlp.gate_proj / up_proj / down_proj; final_norm ->
    ln_f; out_head -> lm_head. (Kept here until the book-import step puts it beside the GPT-2
    mapping in gptkiln's loading code.)
    """
    book = pytest.importorskip(f"llms_from_scratch.{config.family}", reason="the book's package")
    cfg = dict(
        vocab_size=config.vocab_size,
        context_length=config.context_length,
        emb_dim=config.n_embd,
        n_heads=config.n_head,
        n_layers=config.n_layer,
        hidden_dim=config.intermediate_size,
        n_kv_groups=config.kv_heads,
        rope_base=config.rope_theta,
        dtype=torch.float32,
    )
    if config.family == "llama3":
        theirs = book.Llama3Model({**cfg, "rope_freq": config.rope_scaling})
        norm = "weight"
    else:
        theirs = book.Qwen3Model({**cfg, "head_dim": config.head_dim, "qk_norm": config.qk_norm})
        norm = "scale"
    block = {
        "attn.q_proj.weight": "att.W_query.weight",
        "attn.k_proj.weight": "att.W_key.weight",
        "attn.v_proj.weight": "att.W_value.weight",
        "attn.o_proj.weight": "att.out_proj.weight",
        "attn.q_norm.weight": "att.q_norm.scale",
        "attn.k_norm.weight": "att.k_norm.scale",
        "ln_1.weight": f"norm1.{norm}",
        "ln_2.weight": f"norm2.{norm}",
        "mlp.gate_proj.weight": "ff.fc1.weight",
        "mlp.up_proj.weight": "ff.fc2.weight",
        "mlp.down_proj.weight": "ff.fc3.weight",
    }
    top = {"wte.weight": "tok_emb.weight", "ln_f.weight": f"final_norm.{norm}"}
    top["lm_head.weight"] = "out_head.weight"
    sd = {}
    for key, value in model.state_dict().items():
        m = re.fullmatch(r"h\.(\d+)\.(.+)", key)
        sd[f"trf_blocks.{m[1]}.{block[m[2]]}" if m else top[key]] = value
    theirs.load_state_dict(sd, strict=True)
    return theirs.eval()


def hf_model(config: GPTConfig, model: GPT):
    """transformers' model of ``config`` holding ``model``'s weights: ours are its names with
    ``model.embed_tokens`` for wte, ``model.layers`` for h, ``self_attn`` for attn,
    ``input_layernorm`` / ``post_attention_layernorm`` for ln_1 / ln_2, ``model.norm`` for
    ln_f."""
    theirs = hf_model_class(config)(hf_config(config))
    names = [("wte.", "model.embed_tokens."), ("ln_f.", "model.norm."), ("h.", "model.layers.")]
    names += [(".attn.", ".self_attn."), (".ln_1.", ".input_layernorm.")]
    names += [(".ln_2.", ".post_attention_layernorm.")]
    sd = {}
    for key, value in model.state_dict().items():
        for ours, hf in names:
            key = key.replace(ours, hf) if not key.startswith("lm_head") else key
        sd[key] = value
    theirs.load_state_dict(sd, strict=True)
    return theirs.eval()


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_logits_equal_the_books_model_with_the_same_weights(model, attention):
    config = dataclasses.replace(model.config, attention=attention)
    ours = GPT(config).eval()
    ours.load_state_dict(model.state_dict())
    theirs = book_model(config, ours)
    idx = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(idx)
        assert expected.abs().max() > 1  # logits far from 0: a difference would show
        torch.testing.assert_close(ours(idx), expected, rtol=0, atol=1e-5)


def test_logits_equal_transformers_model_with_the_same_weights(model):
    theirs = hf_model(model.config, model)
    idx = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), theirs(idx).logits, rtol=0, atol=1e-5)


def test_a_tied_model_shares_its_embedding_with_the_head_as_the_book_loader_does():
    torch.manual_seed(0)
    model = randomize_(GPT(small_config("qwen3", tie_embeddings=True)))
    assert model.lm_head.weight is model.wte.weight
    assert "lm_head.weight" in model.state_dict()  # (the tied head is stored under both names)
    theirs = book_model(model.config, model)
    idx = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), theirs(idx), rtol=0, atol=1e-5)


# -- decoding with the KV cache ------------------------------------------------------------
@pytest.mark.parametrize("prompt_len", [1, 5, 20, 32, 40])
def test_kv_cache_greedy_equals_no_cache(model, prompt_len):
    prompt = torch.randint(0, 97, (prompt_len,), generator=torch.Generator().manual_seed(4))
    with_cache = generate(model, prompt.tolist(), max_new_tokens=16, temperature=0)
    without = generate(model, prompt.tolist(), max_new_tokens=16, temperature=0, use_cache=False)
    assert with_cache == without and len(set(with_cache)) > 3


def test_cached_prefill_and_decode_logits_equal_the_full_forward(model):
    idx = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(idx)
        model.setup_cache(2, 32)
        try:
            cache = model.h[0].attn.kv_cache
            assert cache.k.shape == (2, model.config.n_kv_head, 32, model.config.head_size)
            steps = [model(idx[:, :12], start_pos=0)]
            steps += [model(idx[:, t : t + 1], start_pos=t) for t in range(12, 20)]
        finally:
            model.clear_cache()
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_left_padded_rows_give_each_rows_own_logits(model, attention):
    m = GPT(dataclasses.replace(model.config, attention=attention)).eval()
    m.load_state_dict(model.state_dict())
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    idx, pad_lens = left_pad(prompts, 0, torch.device("cpu"))
    nxt = torch.tensor([[12], [13], [14]])
    with torch.no_grad():
        m.setup_cache(3, 12, pad_lens)
        try:
            prefilled = m(idx, start_pos=0)  # (3, 7, V)
            stepped = m(nxt, start_pos=idx.size(1))  # (3, 1, V)
        finally:
            m.clear_cache()
        for row, prompt in enumerate(prompts):
            alone = m(torch.tensor([prompt + [int(nxt[row])]]))[0]  # (len + 1, V)
            pad = idx.size(1) - len(prompt)
            torch.testing.assert_close(prefilled[row, pad:], alone[:-1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(stepped[row, 0], alone[-1], atol=1e-5, rtol=1e-5)
    batch = generate(m, prompts, max_new_tokens=10, temperature=0)
    assert batch == [generate(m, p, max_new_tokens=10, temperature=0) for p in prompts]


def test_rows_at_their_own_positions_equal_each_sequence_alone(model):
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7], [10, 11, 12, 13, 14]]
    rows = [2, 0, 3]  # not in order, and row 1 left empty
    with torch.no_grad():
        model.setup_cache(4, 24)
        try:
            for seq, row in zip(seqs, rows):  # one prompt at a time into its own row
                model(torch.tensor([seq[:-1]]), start_pos=0, rows=slice(row, row + 1))
            idx = torch.zeros(4, 1, dtype=torch.long)
            pos = torch.zeros(4, dtype=torch.long)
            for seq, row in zip(seqs, rows):
                idx[row, 0], pos[row] = seq[-1], len(seq) - 1
            step = model(idx, start_pos=pos)  # (4, 1, V): each row at its own position
        finally:
            model.clear_cache()
        for seq, row in zip(seqs, rows):
            alone = model(torch.tensor([seq]))[0, -1]
            torch.testing.assert_close(step[row, 0], alone, atol=1e-5, rtol=1e-5)


def test_multi_query_attention_decodes_as_the_full_forward():
    torch.manual_seed(0)
    model = randomize_(GPT(small_config("llama3", n_kv_head=1)))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.no_grad():
        model.setup_cache(1, 32)
        assert model.h[0].attn.kv_cache.k.shape == (1, 1, 32, 32)  # one key/value head
        model.clear_cache()
    assert generate(model, prompt, max_new_tokens=12, temperature=0) == generate(
        model, prompt, max_new_tokens=12, temperature=0, use_cache=False
    )


def test_attention_weights_are_per_query_head(model):
    idx = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(6))
    weights: list[torch.Tensor] = []
    with torch.no_grad():
        logits = model(idx, attentions=weights)
    assert len(weights) == model.config.n_layer
    for w in weights:
        assert w.shape == (2, model.config.n_head, 10, 10)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, model.config.n_head, 10))
        assert torch.all(w.triu(1) == 0)  # causal
    torch.testing.assert_close(logits, model(idx), rtol=1e-5, atol=1e-5)  # the same forward


# -- training, initialisation, FLOPs -------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_a_few_training_steps_reduce_the_loss(family):
    torch.manual_seed(0)
    model = GPT(small_config(family, dropout=0.1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 97, (4, 33), generator=torch.Generator().manual_seed(7))
    x, y = idx[:, :-1], idx[:, 1:]
    losses = []
    for _ in range(8):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(97), abs=0.15)  # a fresh model: uniform
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("family", FAMILIES)
def test_initialisation_is_gpt2s_scheme_on_the_new_layers(family):
    torch.manual_seed(0)
    config = GPTConfig.from_name(f"{family}-baby", vocab_size=500, n_layer=8, n_embd=256)
    block = GPT(config).h[0]
    residual = 0.02 / math.sqrt(16)
    for layer, std in [("attn.q_proj", 0.02), ("mlp.gate_proj", 0.02), ("attn.o_proj", residual)]:
        weight = block.get_submodule(layer).weight
        assert weight.std().item() == pytest.approx(std, rel=0.05), layer
    assert block.mlp.down_proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    norms = [block.ln_1.weight, block.ln_2.weight]
    if config.qk_norm:
        norms += [block.attn.q_norm.weight, block.attn.k_norm.weight]
    assert all(torch.all(w == 1) for w in norms)


def test_flops_count_every_query_head_and_no_position_embedding():
    model = meta_model(GPTConfig.from_name("qwen3-0.6b"))
    n = 596_049_920  # tied: the head's matmul counts; RoPE adds no parameters
    assert model.num_parameters(exclude_position_embeddings=True) == n
    assert model.flops_per_token(4096) == 6 * n + 12 * 28 * 4096 * 16 * 128  # nh hs = 2048


# -- the loader's hook, dtypes, quantization -----------------------------------------------
def test_a_model_built_on_meta_and_assigned_needs_init_buffers(model):
    """What loading does: build on meta, assign the weights, then ``init_buffers()``."""
    with torch.device("meta"):
        loaded = GPT(model.config)
    assert loaded.rope_cos.is_meta
    loaded.load_state_dict(model.state_dict(), assign=True)
    loaded.init_buffers()
    assert loaded.rope_cos.device.type == "cpu" and loaded.rope_cos.dtype == torch.float32
    assert "rope_cos" not in loaded.state_dict()  # never stored
    idx = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(idx), model(idx))


def test_bfloat16_weights_decode_as_the_full_forward(model):
    m = GPT(model.config).eval()
    m.load_state_dict(model.state_dict())
    m.to(torch.bfloat16)
    prompt = [5, 6, 7, 8]
    assert generate(m, prompt, max_new_tokens=8, temperature=0) == generate(
        m, prompt, max_new_tokens=8, temperature=0, use_cache=False
    )


def test_int8_quantization_reaches_every_new_layer_and_decodes(model, monkeypatch):
    from gptkiln.cpu import prepare_for_decoding, products, specs
    from gptkiln.quantize import Int8Linear, dequantize, int8_modules, quantize_model

    real = specs.offered
    only = {"dequantize": products.dequantize_linear}
    monkeypatch.setattr(specs, "offered", lambda w, p: only if w == "int8" else real(w, p))
    q = GPT(model.config).eval()
    q.load_state_dict(model.state_dict())
    quantize_model(q)
    int8 = [name for name, m in q.named_modules() if isinstance(m, Int8Linear)]
    assert int8 == [n for n in int8_modules(q.config, True) if n != "wte"]
    assert "h.0.mlp.up_proj" in int8 and "h.0.attn.k_proj" in int8
    assert isinstance(q.h[0].ln_1, torch.nn.RMSNorm)  # norms stay float
    # the int8 model is the float model of its dequantized weights
    rounded = GPT(model.config).eval()
    rounded.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name in int8_modules(q.config, True):
            layer = q.get_submodule(name)
            rounded.get_submodule(name).weight.copy_(dequantize(layer.weight, layer.scale))
    idx = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        full, quantized = model(idx), q(idx)
        torch.testing.assert_close(quantized, rounded(idx), rtol=1e-5, atol=1e-5)
    assert 0 < (quantized - full).abs().max() < 0.1 * full.abs().max()
    prompt = [1, 2, 3]
    prepare = prepare_for_decoding
    assert generate(q, prompt, max_new_tokens=8, temperature=0, prepare=prepare) == generate(
        q, prompt, max_new_tokens=8, temperature=0, use_cache=False
    )
    assert planned.few_row_kernels(q.h[0].mlp.gate_proj)  # the decode tuner reached the new layers


def test_the_decode_tuner_reaches_every_new_linear_layer(model):
    from gptkiln.cpu.tuner import tune_decoding

    m = GPT(model.config).eval()
    m.load_state_dict(model.state_dict())
    picked = tune_decoding(m, rows=1, repeats=1)
    for name in block_linears(m.config):
        layer = m.h[1].get_submodule(name)
        assert 1 in planned.few_row_kernels(layer), name
        assert tuple(layer.weight.shape) in picked


# -- the config ----------------------------------------------------------------------------
def test_a_config_without_the_family_keys_is_gpt2_as_before():
    old = dict(vocab_size=65, context_length=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0,
               qkv_bias=True, tie_embeddings=True, attention="sdpa", gelu="tanh", init="gpt2",
               num_classes=None)  # fmt: skip
    config = GPTConfig.from_dict(old)
    assert config == GPTConfig.from_name("baby", vocab_size=65)
    assert (config.family, config.norm, config.positions, config.mlp) == (
        "gpt2",
        "layernorm",
        "learned",
        "gelu",
    )
    assert (config.head_size, config.kv_heads, config.mlp_size) == (32, 4, 512)
    assert GPTConfig.from_dict(config.to_dict()) == config
    llama = GPTConfig.from_name("llama3.2-1b")
    assert GPTConfig.from_dict(llama.to_dict()) == llama  # rope_scaling survives JSON


def test_gpt2_logits_are_the_golden_ones_of_the_code_before_the_families():
    """Logits of a seeded tiny GPT-2, as the model computed them before the other families
    were added (same init order, same forward)."""
    torch.manual_seed(0)
    config = GPTConfig.from_name("tiny", vocab_size=64, context_length=24, tie_embeddings=False)
    model = GPT(config)
    idx = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(idx)
    assert logits.double().sum().item() == pytest.approx(4.6195185199121624, abs=1e-4)
    expected = torch.tensor([0.1476283073, 0.0064320951, 0.0465251841])
    torch.testing.assert_close(logits[0, 0, :3], expected, rtol=0, atol=1e-6)
    assert "wpe.weight" in model.state_dict() and not hasattr(model, "rope_cos")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(n_kv_head=3), "n_head \\(4\\) must be a multiple of n_kv_head \\(3\\)"),
        (dict(n_kv_head=0), "n_kv_head must be a positive integer"),
        (dict(head_dim=15), "head size must be even, got 15"),
        (dict(intermediate_size=None), "swiglu MLP needs intermediate_size .*e.g. 352"),
        (dict(gelu="exact"), "gelu 'exact' is the activation of a gelu MLP"),
        (dict(rope_scaling={"factor": 8.0}), "rope_scaling must have exactly the keys"),
        (dict(rope_scaling={**SCALING, "factor": -1}), "rope_scaling factor must be a number > 0"),
        (dict(rope_scaling={**SCALING, "high_freq_factor": 1.0}), "greater than low_freq"),
        (dict(qk_norm=True), "family 'llama3' does not have qk_norm True"),
        (dict(norm="layernorm"), "family 'llama3' does not have norm 'layernorm'"),
        (dict(norm="batchnorm"), "norm must be one of 'layernorm', 'rmsnorm'"),
        (dict(family="gpt3"), "family must be one of 'gpt2', 'llama3', 'qwen3'"),
        (dict(rope_theta=0.0), "rope_theta must be a number > 0"),
        (dict(norm_eps=-1e-5), "norm_eps must be a number > 0"),
        (dict(family="gpt2"), "family 'gpt2' does not have norm 'rmsnorm'"),
    ],
)
def test_impossible_combinations_are_one_error_each(overrides, message):
    with pytest.raises(GptkilnError, match=message) as e:
        GPTConfig.from_name("llama3-baby", **overrides)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(n_kv_head=2), "family 'gpt2' does not have n_kv_head 2"),
        (dict(positions="rope"), "family 'gpt2' does not have positions 'rope'"),
        (dict(rope_scaling=SCALING), "positions is 'learned'"),
        (dict(bias=False), "family 'gpt2' does not have bias False"),
        (dict(head_dim=64), "family 'gpt2' does not have head_dim 64"),
    ],
)
def test_gpt2_refuses_the_other_families_choices(overrides, message):
    with pytest.raises(GptkilnError, match=message):
        GPTConfig.from_name("baby", **overrides)


def test_every_preset_builds_and_names_its_family():
    for name in PRESETS:
        config = GPTConfig.from_name(name)
        assert config.family in ("gpt2", "llama3", "qwen3")
        assert (config.family != "gpt2") == name.startswith(("llama", "qwen")), name


@pytest.mark.parametrize("family", FAMILIES)
def test_dynamic_shapes_compile_the_whole_forward_in_one_graph(family):
    """As GPT-2's (tests/test_model.py): nothing in the RoPE, GQA or SwiGLU path splits the
    graph under dynamic shapes with dropout on; one graph each side of the fused-attention
    bound."""
    import gptkiln.model

    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    limit = gptkiln.model.FUSED_ATTENTION_MAX_T
    config = small_config(family, context_length=2 * limit, n_layer=1, dropout=0.1)
    model = torch.compile(GPT(config).train(), backend=backend, dynamic=True)
    for T in (16, 32, limit + 8, limit + 16):
        idx = torch.randint(0, 97, (2, T))
        model(idx, idx)[1].backward()
    assert len(graphs) == 2


def test_bf16_autocast_steps_use_the_fused_norm_and_warn_nothing():
    """Under CPU bf16 autocast Qwen3's q/k norms get bf16 input: normalized in fp32, as
    transformers' Qwen3RMSNorm, without torch's dtype-mismatch warning (seen once on every
    default `gptkiln train` while --precision auto measured)."""
    import warnings

    torch.manual_seed(0)
    m = GPT(small_config("qwen3"))
    idx = torch.randint(0, 97, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, loss = m(idx, idx)
        loss.backward()
    assert logits.dtype == torch.bfloat16 and torch.isfinite(loss)
    q = torch.randn(2, 4, 8, 48, dtype=torch.bfloat16)
    norm = m.h[0].attn.q_norm
    expected = torch.nn.functional.rms_norm(q.float(), (48,), norm.weight, norm.eps)
    assert norm(q).dtype == torch.bfloat16
    torch.testing.assert_close(norm(q).float(), expected, atol=1e-2, rtol=1e-2)
