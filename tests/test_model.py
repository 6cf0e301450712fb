"""The GPT-2 model: presets, parameter names and counts, initialisation, loss, purity."""

import ast
import math
from pathlib import Path

import pytest
import torch
import torch._dynamo  # before any test patches torch.compiler.is_compiling: see below
import torch.nn.functional as F

import gptkiln.losses
import gptkiln.model
import gptkiln.positions
from gptkiln.config import PRESETS, GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.model import GPT


def meta_model(name: str, **kw) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig.from_name(name, **kw))


@pytest.mark.parametrize(
    "name, expected",
    [
        ("gpt2", 124_439_808),
        ("book-124m", 163_009_536),
        ("gpt2-medium", 354_823_168),
        ("gpt2-large", 774_030_080),
        ("gpt2-xl", 1_557_611_200),
    ],
)
def test_parameter_counts(name, expected):
    assert meta_model(name).num_parameters() == expected


def test_gpt2_parameter_names_map_one_to_one():
    names = set(meta_model("gpt2").state_dict())
    for n in ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "lm_head.weight"]:
        assert n in names
    for part in [
        "ln_1.weight",
        "ln_1.bias",
        "attn.c_attn.weight",
        "attn.c_attn.bias",
        "attn.c_proj.weight",
        "attn.c_proj.bias",
        "ln_2.weight",
        "mlp.c_fc.weight",
        "mlp.c_fc.bias",
        "mlp.c_proj.weight",
        "mlp.c_proj.bias",
    ]:
        assert f"h.11.{part}" in names
    assert not any("mask" in n for n in names)  # no buffers in the checkpoint


def test_tied_and_untied_heads():
    tied = GPT(GPTConfig.from_name("tiny", vocab_size=20))
    untied = GPT(GPTConfig.from_name("tiny", vocab_size=20, tie_embeddings=False))
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.lm_head.weight is not untied.wte.weight
    assert untied.num_parameters() - tied.num_parameters() == 20 * 32
    assert "attn.c_attn.bias" not in str(
        list(
            dict(GPT(GPTConfig.from_name("tiny", vocab_size=20, qkv_bias=False)).named_parameters())
        )
    )


def test_gpt2_initialisation():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=500, context_length=64, n_layer=8, n_head=4, n_embd=256))
    assert model.h[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.h[0].mlp.c_proj.weight.std().item() == pytest.approx(
        0.02 / math.sqrt(16), rel=0.05
    )
    assert model.h[0].attn.c_proj.weight.std().item() == pytest.approx(
        0.02 / math.sqrt(16), rel=0.05
    )
    assert torch.all(model.h[0].attn.c_attn.bias == 0)
    assert torch.all(model.ln_f.weight == 1)


def test_initial_loss_is_near_uniform():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=300)).eval()
    idx, targets = torch.randint(0, 300, (2, 4, 32))
    logits, loss = model(idx, targets)
    assert logits.shape == (4, 32, 300)
    assert loss.item() == pytest.approx(math.log(300), abs=0.1)


def test_loss_ignores_minus_100_targets():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=30)).eval()
    idx = torch.randint(0, 30, (1, 8))
    targets = idx.clone()
    _, full = model(idx, targets)
    targets[0, 4:] = -100
    _, half = model(idx, targets)
    logits = model(idx)
    expected = torch.nn.functional.cross_entropy(logits[0, :4], idx[0, :4])
    torch.testing.assert_close(half, expected)
    assert not torch.isclose(half, full)


def test_sequence_longer_than_context_is_refused():
    model = GPT(GPTConfig.from_name("tiny", vocab_size=30, context_length=8))
    with pytest.raises(ValueError, match="beyond"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_training_mode_dropout_changes_outputs():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=30, dropout=0.5))
    idx = torch.randint(0, 30, (2, 16))
    model.train()
    assert not torch.allclose(model(idx), model(idx))
    model.eval()
    torch.testing.assert_close(model(idx), model(idx))


def test_model_file_imports_only_torch_and_config():
    # the model, its positions (RoPE, packed rows, windows) and its loss read as plain files:
    # torch only
    plain = {"__future__", "math", "torch"}
    for module, allowed in (
        (gptkiln.model, plain | {"gptkiln.config", "gptkiln.positions", "gptkiln.losses"}),
        (gptkiln.positions, plain),
        (gptkiln.losses, plain),
    ):
        tree = ast.parse(Path(module.__file__).read_text())
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                modules.add(node.module)
        assert modules <= allowed, modules


def test_presets_and_config_errors():
    assert {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "book-124m"} <= set(PRESETS)
    book = GPTConfig.from_name("book-124m")
    assert (book.qkv_bias, book.tie_embeddings, book.dropout) == (False, False, 0.1)
    with pytest.raises(GptkilnError, match="unknown model preset 'gpt5'"):
        GPTConfig.from_name("gpt5")
    with pytest.raises(GptkilnError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(GptkilnError, match="unknown key.*n_layers"):
        GPTConfig.from_dict({"n_layers": 3})
    assert GPTConfig.from_dict(book.to_dict()) == book


def test_gelu_is_gpt2s_tanh_form_unless_the_config_asks_for_the_exact_one():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50, context_length=8, n_layer=1, n_head=2, n_embd=16)
    tanh = GPT(config).eval()
    with torch.no_grad():  # unit-scale weights: pre-activations of order 1, where the forms differ
        for p in tanh.parameters():
            p.normal_()
    exact = GPT(GPTConfig(**{**config.to_dict(), "gelu": "exact"})).eval()
    exact.load_state_dict(tanh.state_dict())
    x = torch.randn(2, 8, 16)
    mlp = tanh.h[0].mlp
    u = mlp.c_fc(x)
    by_hand_tanh = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
    by_hand_exact = 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), mlp.c_proj(by_hand_tanh))
        torch.testing.assert_close(exact.h[0].mlp(x), mlp.c_proj(by_hand_exact))
        idx = torch.randint(0, 50, (2, 8))
        assert not torch.allclose(tanh(idx), exact(idx), rtol=0, atol=1e-5)
    with pytest.raises(GptkilnError, match="gelu must be 'tanh' or 'exact', got 'relu'"):
        GPTConfig(gelu="relu")


def test_flops_per_token_formula():
    model = meta_model("gpt2")
    n = 124_439_808 - 1024 * 768  # the tied embedding is the head's matmul: counted
    assert model.flops_per_token(1024) == 6 * n + 12 * 12 * 1024 * 768
    book = meta_model("book-124m")  # untied: the token embedding is a lookup, not a matmul
    n = 163_009_536 - 1024 * 768 - 50257 * 768
    assert book.flops_per_token(1024) == 6 * n + 12 * 12 * 1024 * 768


def test_book_preset_draws_the_books_pytorch_default_weights():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("book-124m", context_length=64, n_layer=2))
    assert model.wte.weight.std().item() == pytest.approx(1.0, rel=0.02)  # nn.Embedding: N(0, 1)
    bound = 1 / math.sqrt(768)  # nn.Linear: Kaiming-uniform within +-1/sqrt(fan_in)
    assert model.h[0].mlp.c_fc.weight.abs().max().item() <= bound
    assert model.h[0].mlp.c_fc.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.02)
    assert model.h[0].mlp.c_fc.bias.abs().sum() > 0  # PyTorch's biases are not zero
    with pytest.raises(GptkilnError, match="init"):
        GPTConfig(init="xavier")


def test_book_preset_under_the_books_seed_is_the_books_model_weight_for_weight():
    """``torch.manual_seed(123); GPTModel(cfg)`` in the book, ``torch.manual_seed(123);
    GPT(book-124m)`` here: the same draws in the same order, so the same numbers (shrunk)."""
    ch04 = pytest.importorskip("llms_from_scratch.ch04")
    from gptkiln.loading.book import book_state_dict_to_gptkiln

    cfg = {"vocab_size": 100, "context_length": 32, "emb_dim": 64, "n_heads": 4, "n_layers": 2,
           "drop_rate": 0.1, "qkv_bias": False}  # fmt: skip
    torch.manual_seed(123)
    book = ch04.GPTModel(cfg)
    torch.manual_seed(123)
    ours = GPT(GPTConfig.from_name("book-124m", vocab_size=100, context_length=32, n_embd=64,
                                   n_head=4, n_layer=2))  # fmt: skip
    _, expected = book_state_dict_to_gptkiln(book.state_dict(), n_head=4)
    got = ours.state_dict()
    assert expected.keys() <= got.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_gelu_by_sigmoid_is_the_tanh_gelu():
    x = torch.cat([torch.linspace(-30, 30, 10_001), torch.randn(10_000) * 3])
    torch.testing.assert_close(
        gptkiln.model.gelu_tanh_by_sigmoid(x), F.gelu(x, approximate="tanh"), rtol=1e-5, atol=1e-6
    )
    x64 = x.double().requires_grad_()  # and the same gradient
    (g_sig,) = torch.autograd.grad(gptkiln.model.gelu_tanh_by_sigmoid(x64).sum(), x64)
    (g_tanh,) = torch.autograd.grad(F.gelu(x64, approximate="tanh").sum(), x64)
    torch.testing.assert_close(g_sig, g_tanh)


class _Calls:
    """Counts the calls of a torch function that a test wraps."""

    def __init__(self, fn):
        self.fn, self.n = fn, 0

    def __call__(self, *args, **kwargs):
        self.n += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize(
    "T, fused",
    [(gptkiln.model.FUSED_ATTENTION_MAX_T, True), (gptkiln.model.FUSED_ATTENTION_MAX_T + 1, False)],
)
def test_a_graph_compiled_for_the_cpu_spells_out_gelu_and_short_attention(monkeypatch, T, fused):
    """Under torch.compile on the CPU the model writes the tanh GELU and (for short contexts)
    attention as plain ops that inductor fuses; the results are eager's within float error."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, context_length=T, n_layer=2, n_head=2, n_embd=16))
    idx = torch.randint(0, 50, (3, T))
    logits, loss = model(idx, idx)
    loss.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    gelu, sdpa = _Calls(F.gelu), _Calls(F.scaled_dot_product_attention)
    monkeypatch.setattr(F, "gelu", gelu)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced_logits, traced_loss = model(idx, idx)
    traced_loss.backward()
    assert gelu.n == 0  # the sigmoid form, in every layer
    assert sdpa.n == (0 if fused else 2)
    torch.testing.assert_close(traced_logits, logits)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g)
    with torch.no_grad():  # decoding with the KV cache keeps SDPA
        model.setup_cache(1, T)
        model(idx[:1, :4], start_pos=0)
        model.clear_cache()
    assert sdpa.n == (0 if fused else 2) + 2


@pytest.mark.parametrize("T", [16, gptkiln.model.EXPLICIT_GRAD_MAX_T + 1])
def test_a_short_bf16_training_step_on_the_cpu_spells_attention_out(monkeypatch, T):
    """SDPA's CPU kernel is slow at bf16's backward over short contexts: an eager bf16 forward
    that wants a gradient spells attention out up to EXPLICIT_GRAD_MAX_T positions, its loss
    and gradients SDPA's within bf16's rounding; longer contexts, fp32, and a forward without
    a gradient keep SDPA."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, context_length=T, n_layer=2, n_head=2, n_embd=16))
    idx = torch.randint(0, 50, (3, T))
    sdpa = _Calls(F.scaled_dot_product_attention)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)

    def bf16_step():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = bf16_step()
    assert sdpa.n == (0 if T <= gptkiln.model.EXPLICIT_GRAD_MAX_T else 2)
    monkeypatch.setattr(gptkiln.model, "EXPLICIT_GRAD_MAX_T", 0)
    sdpa.n = 0
    ref_loss, ref_grads = bf16_step()
    assert sdpa.n == 2
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=0.0)
    for g, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=0.05, atol=0.05 * float(ref.abs().max()))
    monkeypatch.undo()
    sdpa = _Calls(F.scaled_dot_product_attention)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    model(idx, idx)  # fp32
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx, idx)
    assert sdpa.n == 4


def test_other_devices_keep_the_aten_kernels_when_compiled(monkeypatch):
    # A meta forward's first reduction imports torch._dynamo, which records the
    # torch.compiler.is_compiling it finds as the one to trace: imported here, under the patch,
    # it would remember the lambda and break later tests' graphs on the real function. The
    # import at the top of this file keeps that from depending on which test ran first.
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50, context_length=16, n_layer=1, n_head=2, n_embd=16))
        idx = torch.zeros(2, 16, dtype=torch.long)
    gelu, sdpa = _Calls(F.gelu), _Calls(F.scaled_dot_product_attention)
    monkeypatch.setattr(F, "gelu", gelu)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    model(idx, idx)
    assert (gelu.n, sdpa.n) == (1, 1)


def test_dynamic_shapes_compile_the_whole_forward_in_one_graph():
    """With dropout in training mode and T symbolic, nothing in the forward may need a plain
    bool from a symbolic one (F.dropout's training flag, SDPA's is_causal): dynamo would split
    the graph there, and nothing around the split would be fused."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    limit = gptkiln.model.FUSED_ATTENTION_MAX_T
    config = GPTConfig(
        vocab_size=50, context_length=2 * limit, n_layer=1, n_head=2, n_embd=16, dropout=0.1
    )
    model = torch.compile(GPT(config).train(), backend=backend, dynamic=True)
    for T in (16, 32, limit + 8, limit + 16):  # one graph each side of the bound
        idx = torch.randint(0, 50, (2, T))
        model(idx, idx)[1].backward()
    assert len(graphs) == 2


def test_torch_compile_traces_the_spelled_out_forms_on_the_cpu():
    """What the graph torch.compile hands its backend holds (dynamo only, no code generation):
    the sigmoid form of the GELU at any T; no SDPA call at T = 16, SDPA beyond the bound."""
    torch._dynamo.reset()
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    for T in (16, gptkiln.model.FUSED_ATTENTION_MAX_T + 1):
        config = GPTConfig(vocab_size=50, context_length=T, n_layer=1, n_head=2, n_embd=16)
        idx = torch.randint(0, 50, (2, T))
        targets.clear()
        torch.compile(GPT(config), backend=backend)(idx, idx)
        ops = " ".join(targets)
        assert ("gelu" in ops, "scaled_dot_product_attention" in ops) == (False, T > 16), ops
        assert "sigmoid" in ops


def test_an_export_keeps_the_aten_kernels():
    """torch.export traces with dynamo too, but an exported graph is for other runtimes: no
    CPU-inductor rewriting there (and no T bound to constrain an exported dynamic T)."""
    model = GPT(GPTConfig(vocab_size=50, context_length=16, n_layer=1, n_head=2, n_embd=16))
    exported = torch.export.export(model.eval(), (torch.randint(0, 50, (2, 16)),))
    ops = " ".join(str(node.target) for node in exported.graph.nodes)
    assert "gelu" in ops and "scaled_dot_product_attention" in ops and "sigmoid" not in ops


@pytest.mark.parametrize("tied", [True, False])
def test_a_padded_vocabulary_is_the_same_model_over_the_tokenizers_ids(tied):
    """``padded_vocab_size``: the embedding and head hold the extra rows, but the logits, the
    loss and every gradient are those of the unpadded model with the same weights; the extra
    rows get no gradient and are never predicted, however large their weights."""
    V, rows = 61, 128
    config = GPTConfig.from_name("tiny", vocab_size=V, tie_embeddings=tied)
    torch.manual_seed(0)
    plain = GPT(config)
    padded = GPT(GPTConfig.from_name("tiny", vocab_size=V, padded_vocab_size=rows,
                                     tie_embeddings=tied))  # fmt: skip
    assert padded.wte.weight.shape == padded.lm_head.weight.shape == (rows, config.n_embd)
    with torch.no_grad():
        for name, p in padded.named_parameters():
            source = plain.get_parameter(name)
            p[: source.shape[0]] = source
        padded.lm_head.weight[V:] = 10.0  # were a padding row a logit, it would win
    idx = torch.randint(0, V, (2, 16))
    targets = torch.randint(0, V, (2, 16))
    logits, loss = padded(idx, targets)
    expected_logits, expected_loss = plain(idx, targets)
    assert logits.shape == (2, 16, V)
    torch.testing.assert_close(logits, expected_logits)
    torch.testing.assert_close(padded(idx), expected_logits)
    torch.testing.assert_close(padded.logits(padded.hidden(idx)), expected_logits)
    torch.testing.assert_close(loss, expected_loss)
    loss.backward()
    expected_loss.backward()
    for name, p in padded.named_parameters():
        reference = plain.get_parameter(name).grad
        torch.testing.assert_close(p.grad[: reference.shape[0]], reference)
        if name in ("wte.weight", "lm_head.weight"):
            assert not p.grad[V:].any()
    assert padded.flops_per_token(16) == plain.flops_per_token(16)
    assert padded.num_parameters() == plain.num_parameters() + (rows - V) * config.n_embd * (
        1 if tied else 2
    )


def test_a_padded_vocabulary_is_refused_below_the_vocabulary():
    with pytest.raises(GptkilnError, match="padded_vocab_size .* must be at least vocab_size"):
        GPTConfig.from_name("tiny", vocab_size=100, padded_vocab_size=64)


def test_the_books_chapter_4_generation_comes_out_of_book_124m_under_its_seed():
    """The book's section 4.7: its untrained GPT_CONFIG_124M model, built after
    torch.manual_seed(123), continues "Hello, I am" greedily with these six ids."""
    torch.manual_seed(123)
    model = GPT(GPTConfig.from_name("book-124m")).eval()
    idx = torch.tensor([[15496, 11, 314, 716]])  # "Hello, I am"
    with torch.no_grad():
        for _ in range(6):
            idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert idx.tolist() == [[15496, 11, 314, 716, 27018, 24086, 47843, 30961, 42348, 7267]]
