"""Every gptkiln command on a tiny Llama 3 and a tiny Qwen3 model: train from a family preset and
resume exactly, DDP and FSDP2, generate, perplexity, inspect (one map per query head, its key/value
head named), the serving batcher, int8, fine-tuning (instruction, classification, LoRA on every
block linear) and info.

The GPT-2 path of each command has its own tests (test_cli, test_generate, test_serve_batcher,
test_finetune, ...); these reuse their helpers and check what a family changes.
"""

from __future__ import annotations

import json
import math
import random
import sys

import pytest
import torch
from instruction_data import WORDS, instructions
from test_cli import assert_one_line_error, cli
from test_finetune import CHARS, quick

from gptkiln.api import complete, perplexity_of_run
from gptkiln.checkpoint import save_model
from gptkiln.config import FinetuneConfig, GPTConfig, SampleConfig
from gptkiln.finetune import finetune
from gptkiln.finetune.lora import LoraSpec, add_lora, lora_parameter_count
from gptkiln.loading import load_model
from gptkiln.model import GPT, block_linears
from gptkiln.tokenizers import build_char_tokenizer
from gptkiln.train import read_metrics

FAMILIES = ["llama3", "qwen3"]
STEPS = 6


def train_flags(data, out, family: str, **overrides) -> list[str]:
    values = dict(
        model=f"{family}-baby",
        tokenizer="char",
        context_length=32,
        batch_size=4,
        max_steps=STEPS,
        eval_interval=3,
        eval_batches=1,
        checkpoint_interval=3,
        sample_interval=100,
        sample_tokens=4,
        warmup_steps=2,
        seed=3,
        # one precision for both runs: `auto` times fp32 against bf16 at each start, and on a busy
        # CPU with bf16 the whole run and the resumed one could choose differently
        precision="fp32",
    )
    values.update(overrides)
    flags = ["train", "--data", data, "--out", out, "--no-progress"]
    for key, value in values.items():
        flags += ["--" + key.replace("_", "-"), value]
    return flags


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def runs(family, play_path, tmp_path_factory):
    """A run of STEPS steps at once, and one of STEPS // 2 steps resumed to STEPS."""
    root = tmp_path_factory.mktemp(f"family-{family}")
    from gptkiln.cli import main

    assert main([str(a) for a in train_flags(play_path, root / "whole", family)]) == 0
    half = train_flags(play_path, root / "resumed", family, max_steps=STEPS // 2)
    assert main([str(a) for a in half]) == 0
    again = train_flags(play_path, root / "resumed", family)
    assert main([str(a) for a in [*again, "--resume"]]) == 0
    return root / "whole", root / "resumed"


# -- train, resume, info ----------------------------------------------------------------------
def test_a_family_preset_trains_and_resumes_to_the_same_losses(runs, family):
    whole, resumed = runs
    model = load_model(whole)
    assert model.config.family == family and model.config.kv_heads == 2
    assert model.h[0].attn.q_proj is not None
    rows, again = read_metrics(whole / "metrics.csv"), read_metrics(resumed / "metrics.csv")
    assert [r["step"] for r in rows] == [3, 6] == [r["step"] for r in again]
    for row, other in zip(rows, again, strict=True):
        assert row["train_loss"] == other["train_loss"] and row["val_loss"] == other["val_loss"]
    assert rows[-1]["val_loss"] < math.log(model.config.vocab_size)  # it learned something
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, load_model(resumed).state_dict()[name], rtol=0, atol=0)


def test_info_names_the_family_and_its_key_value_heads(runs, family, capsys):
    code, out, err = cli("info", runs[0], capsys=capsys)
    assert code == 0, err
    assert (
        f"{family}-baby preset (context_length 32): {family}, 4 layers, 4 heads (2 key/value)"
        in out
    )


def test_the_family_presets_reach_trains_help(capsys):
    code, out, _ = cli("train", "--help", capsys=capsys)
    assert code == 0
    for name in ("llama3-baby", "qwen3-baby", "llama3-124m", "qwen3-124m", "llama3.2-1b"):
        assert name in out


def test_a_gpt2_only_setting_on_a_family_preset_is_one_line(play_path, tmp_path, capsys):
    flags = train_flags(play_path, tmp_path / "r", "llama3", gelu="exact")
    code, _, err = cli(*flags, capsys=capsys)
    assert_one_line_error(code, err, "gelu 'exact'", "swiglu")


# -- generate, perplexity, inspect, int8 ---------------------------------------------------------
def test_generate_batched_sampled_and_stopped_equal_each_prompt_alone(runs):
    run = runs[0]
    prompts = ["ROMEO:", "a", "What say you", "I "]  # unequal lengths: left padding
    for cfg in (
        SampleConfig(max_new_tokens=12, temperature=0),
        SampleConfig(max_new_tokens=12, temperature=1.0, top_k=5, seed=4),
        SampleConfig(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=5),
    ):
        batch = complete(run, prompts, cfg)
        for prompt, got in zip(prompts, batch, strict=True):
            alone = complete(run, [prompt], cfg)[0]
            assert (got.text, got.token_ids) == (alone.text, alone.token_ids), (prompt, cfg)
    greedy = complete(run, ["ROMEO:"], SampleConfig(max_new_tokens=12, temperature=0))[0]
    stop = greedy.text[4:6]
    stopped = complete(
        run, ["ROMEO:"], SampleConfig(max_new_tokens=12, temperature=0, stop=(stop,))
    )
    assert stopped[0].text == greedy.text[: greedy.text.index(stop)]


def test_the_kv_cache_generates_what_the_full_forward_does(runs):
    from gptkiln.sampling import generate

    model = load_model(runs[0]).eval()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]  # ragged: left padding in one batch
    cached = generate(model, prompts, max_new_tokens=10, temperature=0)
    for prompt, row in zip(prompts, cached, strict=True):
        assert row == generate(model, prompt, max_new_tokens=10, temperature=0, use_cache=False)


def test_eval_gives_bits_per_character_of_the_models_loss(runs, play_path, capsys):
    run = runs[0]
    result = perplexity_of_run(run, play_path)
    assert result.bits_per_char == pytest.approx(
        result.loss * result.tokens / result.characters / math.log(2)
    )
    assert result.loss < math.log(load_model(run).config.vocab_size)
    code, out, err = cli("perplexity", run, "--data", play_path, capsys=capsys)
    assert code == 0, err
    assert f"{result.bits_per_char:.4f} bits/char" in out


def test_inspect_shows_each_query_heads_map_and_names_its_key_value_head(runs, tmp_path, capsys):
    run = runs[0]
    out = tmp_path / "a.json"
    code, _, err = cli(
        "inspect", run, "--prompt", "ROMEO: What", "--out", tmp_path / "a.png", "--json", out,
        capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["n_head"] == 4 and data["n_kv_head"] == 2 and data["kv_head_of"] == [0, 0, 1, 1]
    maps = torch.tensor(data["attention"])  # (L, nh, T, T)
    assert maps.shape[:2] == (4, 4)
    torch.testing.assert_close(maps.sum(-1), torch.ones(maps.shape[:3]), atol=1e-5, rtol=0)
    assert not torch.allclose(maps[0, 0], maps[0, 1])  # a group shares keys, not maps
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


def test_attention_panels_name_the_key_value_head_of_each_query_head():
    from gptkiln.plots import attention_figures

    weights = torch.softmax(torch.randn(1, 4, 3, 3), -1)
    [(fig, _)] = attention_figures(weights, ["a", "b", "c"], kv_heads=2)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == [f"layer 0 · head {h} · kv {h // 2}" for h in range(4)]
    [(fig, _)] = attention_figures(weights, ["a", "b", "c"])
    assert "kv" not in " ".join(ax.get_title() for ax in fig.axes)


def test_int8_on_load_and_convert_quantize_generate_the_same(runs, tmp_path, capsys):
    run = runs[0]
    code, _, err = cli("convert", "quantize", run, "--out", tmp_path / "q", capsys=capsys)
    assert code == 0, err
    args = ["--prompt", "ROMEO:", "--max-new-tokens", "10", "--temperature", "0"]
    code, on_load, err = cli("generate", run, *args, "--quantize", "int8", capsys=capsys)
    assert code == 0, err
    code, stored, err = cli("generate", tmp_path / "q", *args, capsys=capsys)
    assert code == 0, err
    assert on_load == stored and on_load.startswith("ROMEO:")


def test_int8_decode_equals_the_dequantized_reference(runs):
    from gptkiln.quantize import dequantize, quantize_model
    from gptkiln.sampling import generate

    model = load_model(runs[0]).eval()
    quantized = quantize_model(load_model(runs[0]).eval())
    reference = load_model(runs[0]).eval()  # float layers holding the int8 grid's values
    qmodules = dict(quantized.named_modules())
    with torch.no_grad():
        for name, module in reference.named_modules():
            q = qmodules[name]
            if hasattr(q, "scale") and q.weight.dtype == torch.int8:
                module.weight.copy_(dequantize(q.weight, q.scale))
    linears = [f"h.0.{n}" for n in block_linears(model.config)]
    assert all(qmodules[n].weight.dtype == torch.int8 for n in linears)
    x = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(quantized(x), reference(x), atol=1e-4, rtol=1e-4)
    prompts = [[1, 2, 3], [4, 5]]
    assert generate(quantized, prompts, max_new_tokens=8, temperature=0) == generate(
        reference, prompts, max_new_tokens=8, temperature=0
    )


# -- serve: the batcher --------------------------------------------------------------------------
def test_served_requests_at_their_own_positions_get_what_each_gets_alone(family):
    from test_serve_batcher import TEXT, check_each_equals_alone, run_batcher, staggered

    tokenizer = build_char_tokenizer([TEXT], with_eot=False)
    torch.manual_seed(0)
    config = GPTConfig.from_name(
        f"{family}-baby", vocab_size=tokenizer.vocab_size, context_length=48, tie_embeddings=False
    )
    model = GPT(config).eval()
    cfgs = [
        SampleConfig(max_new_tokens=12, temperature=0),
        SampleConfig(max_new_tokens=10, temperature=0.7, top_k=5, seed=2),
        SampleConfig(max_new_tokens=5, temperature=1.2, top_p=0.8, seed=3),
        SampleConfig(max_new_tokens=9, temperature=0),
    ]
    arrivals = staggered(tokenizer, cfgs)
    out, batcher = run_batcher(model, tokenizer, arrivals, max_batch=3)
    check_each_equals_alone(model, tokenizer, arrivals, out)
    assert batcher.steps < sum(c.max_new_tokens for c in cfgs)  # they shared steps


# -- fine-tuning ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(family, tmp_path_factory):
    """A random family-baby base run (char tokenizer with end-of-text) and its data."""
    root = tmp_path_factory.mktemp(f"ft-{family}")
    tokenizer = build_char_tokenizer([CHARS], with_eot=True)
    torch.manual_seed(0)
    config = GPTConfig.from_name(
        f"{family}-baby", vocab_size=tokenizer.vocab_size, context_length=256, n_layer=2
    )
    save_model(GPT(config), root / "base", tokenizer=tokenizer)
    (root / "instructions.json").write_text(json.dumps(instructions(40)))
    rng = random.Random(1)
    lines = ["text,label"]
    for _ in range(120):
        label = rng.choice(["good", "bad"])
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 4))]
        words.insert(rng.randint(0, len(words)), label)
        lines.append(f"{' '.join(words)},{label}")
    (root / "labelled.csv").write_text("\n".join(lines) + "\n")
    return root


def test_instruction_finetuning_lowers_the_loss(base):
    ft = FinetuneConfig(base=str(base / "base"), data=str(base / "instructions.json"))
    result = finetune(ft, quick(ft, base / "instruct", max_steps=6, eval_interval=3))
    rows = read_metrics(base / "instruct" / "metrics.csv")
    assert rows[-1]["train_loss"] < rows[0]["train_loss"], result
    assert load_model(base / "instruct").config.family == load_model(base / "base").config.family


def test_classification_finetuning_trains_a_family_model(base, capsys):
    ft = FinetuneConfig(base=str(base / "base"), data=str(base / "labelled.csv"), task="classify")
    settings = dict(batch_size=8, max_steps=6, eval_interval=3, lr=1e-3)
    result = finetune(ft, quick(ft, base / "classify", **settings))
    assert {"val_accuracy", "test_accuracy"} <= set(result.history[-1])
    model = load_model(base / "classify")
    assert model.config.num_classes == 2 and model.config.family in FAMILIES
    capsys.readouterr()  # the training's lines
    code, out, err = cli("classify", base / "classify", "--text", "good day", capsys=capsys)
    assert code == 0, err
    assert out.split("\t")[0] in ("good", "bad")


def test_lora_adapts_every_block_linear_and_merged_equals_unmerged(base):
    model = load_model(base / "base")
    spec = LoraSpec(rank=2, alpha=4)
    tuner = add_lora(model, spec)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    expected = {
        f"h.{i}.{name}" for i in range(model.config.n_layer) for name in block_linears(model.config)
    }
    assert adapted == expected
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == lora_parameter_count(model.config, spec)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)  # B starts at 0: give the adapters an effect
    x = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        unmerged = model(x)
        merged = tuner.merge_and_unload()
        assert not any("lora" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(x), unmerged, atol=1e-5, rtol=1e-5)
        assert (load_model(base / "base")(x) - unmerged).abs().max() > 1e-3


def test_a_lora_run_trains_and_loads_merged(base):
    ft = FinetuneConfig(base=str(base / "base"), data=str(base / "instructions.json"), lora_rank=2)
    finetune(ft, quick(ft, base / "lora", max_steps=4, eval_interval=2, sample_interval=100))
    merged = load_model(base / "lora")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    x = torch.randint(0, merged.config.vocab_size, (1, 12))
    with torch.no_grad():
        assert (load_model(base / "lora", adapters=False)(x) - merged(x)).abs().max() > 0


def test_fused_lora_on_separate_q_k_v_layers_is_one_line(base, tmp_path, capsys):
    args = [
        "finetune",
        base / "base",
        "--data",
        base / "instructions.json",
        "--out",
        tmp_path / "x",
    ]
    code, _, err = cli(*args, "--lora-rank", "2", "--lora-qkv", "fused", capsys=capsys)
    assert_one_line_error(code, err, "--lora-qkv fused", "q_proj")


# -- several processes ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads worker pids from /proc")
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_match_one_with_twice_the_batch(family, parallel, play_path, tmp_path):
    from safetensors.torch import load_file
    from test_distributed import B, Launches, flags, settings

    from gptkiln.config import TrainConfig
    from gptkiln.train import train

    values = dict(model=f"{family}-baby", max_steps=4, eval_interval=2, checkpoint_interval=2)
    reference = tmp_path / "one"
    train(TrainConfig(**settings(play_path, reference, batch_size=2 * B, **values)))
    out = tmp_path / parallel
    launches = Launches()
    try:
        cmd = [sys.executable, "-m", "gptkiln", "train", "--nproc", "2"]
        launches.run([*cmd, *flags(settings(play_path, out, parallel=parallel, **values))])
    finally:
        launches.close()
    rows, ref_rows = read_metrics(out / "metrics.csv"), read_metrics(reference / "metrics.csv")
    assert [r["step"] for r in rows] == [2, 4] == [r["step"] for r in ref_rows]
    for row, ref_row in zip(rows, ref_rows, strict=True):
        for key in ("train_loss", "val_loss"):
            assert row[key] == pytest.approx(ref_row[key], rel=1e-5), (row["step"], key)
    weights, ref_weights = (
        load_file(out / "model.safetensors"),
        load_file(reference / "model.safetensors"),
    )
    assert weights.keys() == ref_weights.keys()
    for name in weights:
        # atol 5e-5, not test_distributed's 1e-5: summed in another order, Qwen3's gradients
        # differ by rounding, which AdamW's normalised step magnifies where a gradient is tiny;
        # measured: one element of 16,384 of h.2.attn.q_proj 1.2e-5 apart, every other within
        # 1e-5 (a wrong gradient sync moves weights by ~lr = 3e-3).
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=1e-4, atol=5e-5)
    assert load_model(out).config.family == family
