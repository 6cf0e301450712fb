"""Hugging Face Llama and Qwen3 directories in and out: models built by ``transformers`` from
configs (random weights, several shapes per family) and saved with ``save_pretrained`` (once
sharded) give the same logits and the same greedy tokens through gptkiln's loader and KV cache;
import -> export -> import is bit-exact and the export loads in ``transformers``; the tokenizer's
files travel with the model; what gptkiln does not read is refused in one line.

Every model here is tiny and random, built locally; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gptkiln.cli import main
from gptkiln.config import GPTConfig
from gptkiln.convert import export_hf, import_hf, quantize_run
from gptkiln.errors import GptkilnError
from gptkiln.loading import HF_TOKENIZER_FILES, describe_weights, load_model, tokenizer_name
from gptkiln.loading.hf_llama import config_from_hf, to_gptkiln_name, to_hf_name
from gptkiln.model import GPT
from gptkiln.sampling import generate

transformers = pytest.importorskip("transformers")

V = 97  # vocabulary of every test model
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
# name -> (transformers class, config keywords): per family one with GQA and one with Llama 3's
# RoPE scaling; Qwen3's heads are not hidden_size / n_head wide; tied and untied; biases.
SHAPES = {
    "llama-gqa": ("LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="default", rope_theta=500_000.0),
    )),
    "llama-scaled-tied": ("LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
        rope_parameters=dict(LLAMA3_ROPE, rope_theta=500_000.0),
    )),
    "llama-biased": ("LlamaForCausalLM", dict(
        num_attention_heads=2, num_key_value_heads=1, attention_bias=True, mlp_bias=True,
    )),
    "qwen3-gqa": ("Qwen3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
    )),
    "qwen3-scaled-tied": ("Qwen3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
        rope_parameters=dict(LLAMA3_ROPE, rope_theta=1_000_000.0),
    )),
}  # fmt: skip


def hf_config(name: str):
    cls, kw = SHAPES[name]
    config_cls = transformers.LlamaConfig if cls == "LlamaForCausalLM" else transformers.Qwen3Config
    base = dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        max_position_embeddings=64,
        bos_token_id=None,  # no stop token: generation runs its 50 tokens
        eos_token_id=None,
        pad_token_id=None,
    )
    return config_cls(**{**base, **kw})


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every weight random at a scale where the logits are of order 1 and the greedy tokens
    vary, every norm's weight other than 1 and every bias other than 0, so that a swapped or
    dropped tensor shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if "embed" in name else 0.3))
    return model.eval()


def hf_model(name: str, seed: int = 0):
    cls = getattr(transformers, SHAPES[name][0])
    torch.manual_seed(seed)
    return randomize_(cls(hf_config(name)), seed)


@pytest.fixture(scope="module", params=list(SHAPES))
def saved(request, tmp_path_factory):
    """(name, transformers model, its save_pretrained directory)."""
    model = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param) / "hf"
    model.save_pretrained(path)
    return request.param, model, path


def ids(seed: int, shape=(2, 24)) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


def hf_logits(model, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx).logits


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor a Hugging Face directory's safetensors files hold (one file or shards)."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(path))
    return out


# -- reading what transformers saved -------------------------------------------------------
def test_logits_equal_transformers_in_fp32(saved):
    name, hf, path = saved
    model = load_model(path)
    family = "llama3" if name.startswith("llama") else "qwen3"
    assert model.config.family == family
    assert model.config.tie_embeddings == hf.config.tie_word_embeddings
    assert model.config.kv_heads == hf.config.num_key_value_heads
    assert model.config.head_size == hf.config.head_dim
    idx = ids(1)
    with torch.no_grad():
        ours = model(idx)
    theirs = hf_logits(hf, idx)
    assert theirs.abs().max() > 1  # far from 0: a wrong tensor would show
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_fifty_greedy_tokens_with_the_kv_cache_equal_transformers_generate(saved):
    _, hf, path = saved
    model = load_model(path)
    prompt = [5, 17, 42, 8, 91, 3]
    ours = generate(model, prompt, max_new_tokens=50, temperature=0)  # the KV cache
    assert len(ours) == 50 and len(set(ours)) > 5  # not one token over and over
    assert ours == hf_greedy(hf, prompt, 50)


def test_the_config_is_read_as_transformers_reads_it(saved):
    name, hf, path = saved
    config = load_model(path).config
    c = hf.config
    assert (config.n_layer, config.n_head, config.n_embd) == (
        c.num_hidden_layers,
        c.num_attention_heads,
        c.hidden_size,
    )
    assert config.context_length == c.max_position_embeddings
    assert config.intermediate_size == c.intermediate_size and config.norm_eps == c.rms_norm_eps
    assert config.rope_theta == c.rope_parameters["rope_theta"]
    assert config.qkv_bias == config.bias == c.attention_bias
    assert config.qk_norm == name.startswith("qwen3")
    if c.rope_parameters["rope_type"] == "llama3":
        assert config.rope_scaling == dict(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context_length=16
        )
    else:
        assert config.rope_scaling is None


def test_a_config_json_as_older_transformers_wrote_it_reads_the_same(tmp_path):
    """transformers 4 and the Hub's checkpoints: rope_theta beside rope_scaling (whose type may
    be under "type"), not transformers 5's rope_parameters."""
    hf = hf_model("llama-scaled-tied", seed=3)
    hf.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    theta = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "rope_theta": theta,
                                                             "rope_scaling": rope}))  # fmt: skip
    model = load_model(tmp_path / "hf")
    assert model.config.rope_scaling["original_context_length"] == 16
    idx = ids(2)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf_logits(hf, idx), rtol=0, atol=1e-4)


@pytest.mark.parametrize("scaling", ["llama3", ["llama3"], 8.0])
def test_a_rope_scaling_that_is_not_an_object_is_one_line(scaling):
    from gptkiln.errors import GptkilnError

    with pytest.raises(GptkilnError, match="should be a JSON object"):
        config_from_hf({"model_type": "llama", "rope_scaling": scaling})


def test_a_minimal_config_json_means_transformers_defaults():
    for model_type, cls in (("llama", "LlamaConfig"), ("qwen3", "Qwen3Config")):
        theirs = getattr(transformers, cls)().to_dict()
        assert config_from_hf({"model_type": model_type}) == config_from_hf(theirs), model_type


def test_sharded_pickles_are_named_as_what_is_not_read(tmp_path):
    from gptkiln.errors import GptkilnError

    hf = hf_model("qwen3-gqa", seed=4)
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()  # as older transformers saved shards:
    shard = "pytorch_model-00001-of-00001.bin"
    torch.save(hf.state_dict(), tmp_path / "hf" / shard)
    index = {"weight_map": dict.fromkeys(hf.state_dict(), shard)}
    (tmp_path / "hf" / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(GptkilnError, match=r"holds pytorch_model.bin shards \(pickles\)"):
        load_model(tmp_path / "hf")


def test_sharded_safetensors_read_as_one_file(tmp_path):
    hf = hf_model("qwen3-gqa", seed=4)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 3 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    _, sd, files = describe_weights(tmp_path / "hf")
    assert files == shards and sd["wte.weight"].is_meta
    model = load_model(tmp_path / "hf")
    idx = ids(3)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf_logits(hf, idx), rtol=0, atol=1e-4)
    prompt = [1, 2, 3]
    assert generate(model, prompt, max_new_tokens=50, temperature=0) == hf_greedy(hf, prompt, 50)


def test_a_missing_shard_is_one_line(tmp_path):
    hf_model("llama-gqa").save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    gone = sorted((tmp_path / "hf").glob("model-*.safetensors"))[1]
    gone.unlink()
    with pytest.raises(GptkilnError, match=f"but {gone.name} is not in the directory"):
        load_model(tmp_path / "hf")


# -- import -> export -> import --------------------------------------------------------------
def test_import_export_import_is_bit_exact_and_the_export_loads_in_transformers(saved, tmp_path):
    name, hf, path = saved
    import_hf(path, tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "out")
    import_hf(tmp_path / "out", tmp_path / "again")
    first, second = load_model(tmp_path / "run"), load_model(tmp_path / "again")
    assert first.config == second.config
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    original, exported = hf_tensors(path), hf_tensors(tmp_path / "out")  # HF's names and bytes
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert type(reloaded).__name__ == SHAPES[name][0]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert reloaded.config.rope_parameters == hf.config.rope_parameters
    assert reloaded.config.head_dim == hf.config.head_dim
    idx = ids(4)
    torch.testing.assert_close(
        hf_logits(reloaded.eval(), idx), hf_logits(hf, idx), rtol=0, atol=1e-5
    )


def test_an_export_past_max_shard_size_is_sharded_with_an_index(tmp_path):
    hf = hf_model("llama-gqa", seed=5)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "out", max_shard_size="30KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert not (tmp_path / "out" / "model.safetensors").exists()
    tensors = hf_tensors(tmp_path / "out")
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert all(Path(tmp_path / "out" / f).stat().st_size < 31_000 for f in shards)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    idx = ids(5)
    torch.testing.assert_close(hf_logits(reloaded, idx), hf_logits(hf, idx), rtol=0, atol=1e-5)
    # written again over it as one file: the shards and the index go
    export_hf(tmp_path / "run", tmp_path / "out", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors*")) == [
        "model.safetensors"
    ]
    with pytest.raises(GptkilnError, match="--max-shard-size '5 parsecs': give a size"):
        export_hf(tmp_path / "run", tmp_path / "bad", max_shard_size="5 parsecs")


def test_names_map_both_ways():
    for hf_name, ours in (
        ("model.embed_tokens.weight", "wte.weight"),
        ("model.layers.3.self_attn.k_norm.weight", "h.3.attn.k_norm.weight"),
        ("model.layers.0.post_attention_layernorm.weight", "h.0.ln_2.weight"),
        ("model.layers.12.mlp.gate_proj.bias", "h.12.mlp.gate_proj.bias"),
        ("model.norm.weight", "ln_f.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ):
        assert to_gptkiln_name(hf_name) == ours and to_hf_name(ours) == hf_name


def gptkiln_model(family: str, **kw) -> GPT:
    torch.manual_seed(0)
    values = dict(vocab_size=V, context_length=32, tie_embeddings=False, n_layer=2, n_embd=64,
                  intermediate_size=96)  # fmt: skip
    return randomize_(GPT(GPTConfig.from_name(f"{family}-baby", **{**values, **kw})), seed=6)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_a_gptkiln_run_exports_with_zero_biases_where_the_class_has_them(tmp_path, family):
    """A model with q/k/v biases but none on o_proj (and the MLP): Hugging Face's
    attention_bias covers all four, so o_proj's (and Llama's MLP's) are written as zeros."""
    from gptkiln.checkpoint import save_model

    model = gptkiln_model(family, qkv_bias=True, bias=False)
    save_model(model, tmp_path / "run")  # no tokenizer: the model alone is exported
    export_hf(tmp_path / "run", tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["attention_bias"] is True and cfg.get("mlp_bias", False) is (family == "llama3")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert not reloaded.model.layers[1].self_attn.o_proj.bias.any()
    idx = ids(6, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(reloaded, idx), model(idx), rtol=0, atol=1e-5)


def test_a_qwen3_model_with_mlp_biases_is_refused_by_export(tmp_path):
    from gptkiln.checkpoint import save_model

    save_model(gptkiln_model("qwen3", bias=True), tmp_path / "run")
    with pytest.raises(GptkilnError, match="Qwen3ForCausalLM cannot hold"):
        export_hf(tmp_path / "run", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- the tokenizer's files -----------------------------------------------------------------
CHAT_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def save_tokenizer(path: Path) -> None:
    """A small byte-level BPE in the shape of Llama 3's: BOS, EOS and a turn end as added
    tokens, a chat template, saved by transformers as a model's repository has it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin|>", "<|end|>", "<|start|>", "<|eot|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()[:60]  # fewer ids than the model's 97
    trainer = trainers.BpeTrainer(
        vocab_size=V, special_tokens=special, show_progress=False, initial_alphabet=alphabet
    )
    tok.train_from_iterator(["the tea is hot and the cat is not"] * 20, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|eot|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def test_the_tokenizers_files_travel_into_the_run_and_back_out(tmp_path):
    hf = hf_model("qwen3-gqa", seed=7)
    hf.config.bos_token_id, hf.config.eos_token_id = 0, [3, 1]
    hf.generation_config.eos_token_id = [3, 1]
    hf.save_pretrained(tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    carried = [n for n in HF_TOKENIZER_FILES if (tmp_path / "hf" / n).is_file()]
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(carried)
    assert tokenizer_name(tmp_path / "hf") == "hf"

    assert main(["convert", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    run_cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert run_cfg["tokenizer"] == "hf" and tokenizer_name(tmp_path / "run") == "hf"
    assert (run_cfg["bos_token_id"], run_cfg["eos_token_id"]) == (0, [3, 1])
    for name in carried:
        assert (tmp_path / "run" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()

    assert main(["convert", "to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    for name in carried:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (out_cfg["bos_token_id"], out_cfg["eos_token_id"]) == (0, [3, 1])
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    messages = [{"role": "user", "content": "the tea is hot"}]
    assert exported.apply_chat_template(messages, add_generation_prompt=True) == (
        theirs.apply_chat_template(messages, add_generation_prompt=True)
    )
    assert exported("the cat is not")["input_ids"] == theirs("the cat is not")["input_ids"]

    quantize_run(tmp_path / "run", tmp_path / "int8")  # a quantized copy keeps them too
    for name in carried:
        assert (tmp_path / "int8" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()
    assert json.loads((tmp_path / "int8" / "config.json").read_text())["eos_token_id"] == [3, 1]


def test_a_run_keeps_the_hugging_face_tokenizer_that_load_tokenizer_reads(tmp_path):
    """With a `load_tokenizer` that reads a Hugging Face tokenizer (kind "hf"), the run's is the
    directory's: the same ids as transformers', and its stop ids."""
    from gptkiln import tokenizers
    from gptkiln.loading import load_run_tokenizer

    if "hf" not in tokenizers.TOKENIZER_KINDS:
        pytest.skip("load_tokenizer reads no Hugging Face tokenizer here")
    hf_model("llama-gqa").save_pretrained(tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "run")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for directory in (tmp_path / "hf", tmp_path / "run"):
        ours = load_run_tokenizer(directory)
        assert ours.kind == "hf" and 3 in ours.stop_ids  # <|eot|>
        assert ours.encode("the tea is hot") == theirs("the tea is hot")["input_ids"]


# -- refused in one line -------------------------------------------------------------------
def edited(tmp_path: Path, **changes) -> Path:
    """A saved Llama directory whose config.json is changed (None removes a key)."""
    path = tmp_path / "hf"
    if not path.exists():
        hf_model("llama-gqa").save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return path


def one_line_error(capsys, *argv) -> str:
    capsys.readouterr()  # (what saving the test's model printed)
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "changes, needle",
    [
        (dict(model_type="mistral"), "model_type is 'mistral', not one gptkiln reads ('gpt2', "
                                     "'llama', 'qwen3'"),
        (dict(model_type="qwen3_moe"), "model_type is 'qwen3_moe', not one gptkiln reads"),
        (dict(model_type="mixtral"), "model_type is 'mixtral', not one gptkiln reads"),
        (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0)),
         "RoPE type 'yarn' is not one gptkiln computes"),
        (dict(rope_parameters=None, rope_theta=1e4, rope_scaling=dict(type="linear", factor=2.0)),
         "RoPE type 'linear' is not one gptkiln computes"),
        (dict(rope_parameters=None, rope_scaling=dict(rope_type="dynamic", factor=2.0)),
         "RoPE type 'dynamic' is not one gptkiln computes"),
        (dict(attention_bias=True), "attention_bias=True with mlp_bias=False"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=8.0)),
         "low_freq_factor, high_freq_factor, original_max_position_embeddings missing"),
    ],
)  # fmt: skip
def test_what_gptkiln_does_not_read_is_refused_in_one_line(tmp_path, capsys, changes, needle):
    path = edited(tmp_path, **changes)
    for argv in (("convert", "hf", path, "--out", tmp_path / "run"), ("info", path)):
        err = one_line_error(capsys, *argv)
        assert needle in err and str(path) in err
    assert not (tmp_path / "run").exists()


def test_qwen3_sliding_window_layers_are_refused(tmp_path):
    hf_model("qwen3-gqa").save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["layer_types"] = ["full_attention", "sliding_attention"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(GptkilnError, match="sliding-window attention layers"):
        load_model(tmp_path / "hf")
    del cfg["layer_types"]
    cfg.update(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(GptkilnError, match="sliding-window attention layers"):
        load_model(tmp_path / "hf")
    cfg["max_window_layers"] = 2  # every layer full: read
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    assert load_model(tmp_path / "hf").config.family == "qwen3"


def test_download_of_a_repo_id_checks_its_family_before_the_weights(tmp_path, monkeypatch):
    """The code path of ``gptkiln download owner/name`` (no network: the Hub client is
    replaced): config.json first, refused when gptkiln does not read it; else the weights and
    tokenizer files, imported."""
    import huggingface_hub

    from gptkiln.convert import download

    hf_model("qwen3-gqa").save_pretrained(tmp_path / "qwen")
    save_tokenizer(tmp_path / "qwen")
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs["allow_patterns"]))
        return str(tmp_path / ("mistral" if "mistral" in repo_id else "qwen"))

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    download("Qwen/Qwen3-Tiny", tmp_path / "run")
    assert [c[0] for c in calls] == ["Qwen/Qwen3-Tiny"] * 2
    assert calls[0][1] == ["config.json"]
    assert {"model-*-of-*.safetensors", "tokenizer.json"} <= set(calls[1][1])
    assert load_model(tmp_path / "run").config.family == "qwen3"
    assert tokenizer_name(tmp_path / "run") == "hf"

    edited(tmp_path / "m", model_type="mistral").rename(tmp_path / "mistral")
    calls.clear()
    with pytest.raises(GptkilnError, match="model_type is 'mistral', not one gptkiln reads"):
        download("mistralai/Mistral-Tiny", tmp_path / "run2")
    assert len(calls) == 1 and not (tmp_path / "run2").exists()
    with pytest.raises(GptkilnError, match="or give a Hugging Face repository id"):
        download("llama-9000", tmp_path / "run3")
