"""The loading package's seams: which format a directory is (one table), and the steps features
add to a load (`gptkiln.load_steps`)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import gptkiln
from gptkiln import load_steps
from gptkiln.checkpoint import save_model
from gptkiln.config import GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.interop import config_to_hf, gptkiln_state_dict_to_hf
from gptkiln.loading import (
    HF_FAMILIES,
    describe_weights,
    format_of,
    hf_gpt2,
    load_model,
    load_run_tokenizer,
    run,
    tokenizer_name,
)
from gptkiln.model import GPT

CONFIG = GPTConfig(vocab_size=60, context_length=16, n_layer=2, n_head=2, n_embd=16)
X = torch.arange(12).reshape(2, 6)


def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG).eval()


def hf_dir(path: Path, model_type: str = "gpt2") -> Path:
    """A Hugging Face GPT-2 directory of `tiny`, its config.json saying ``model_type``."""
    model = tiny()
    path.mkdir()
    save_file(gptkiln_state_dict_to_hf(model.state_dict(), CONFIG), path / "model.safetensors")
    cfg = {**config_to_hf(CONFIG), "model_type": model_type}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_a_directory_is_read_by_the_format_its_config_json_names(tmp_path):
    save_model(tiny(), tmp_path / "run")
    assert format_of({"format": 1, "model": {}}, tmp_path) is run
    assert format_of({"model_type": "gpt2"}, tmp_path) is hf_gpt2
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "run")(X), tiny()(X))
        assert torch.allclose(load_model(hf_dir(tmp_path / "hf"))(X), tiny()(X), atol=1e-6)


def test_an_unknown_hugging_face_model_type_is_one_line(tmp_path):
    path = hf_dir(tmp_path / "mistral", model_type="mistral")
    for read in (load_model, describe_weights, tokenizer_name, load_run_tokenizer):
        with pytest.raises(GptkilnError, match="model_type is 'mistral', not one gptkiln reads"):
            read(path)


def test_a_new_hugging_face_family_is_a_module_and_one_row(tmp_path, monkeypatch):
    """What the next family (Llama 3, Qwen3) takes: a module with read / tokenizer_name /
    tokenizer_source, and its model_type in HF_FAMILIES; every entry point then reads it."""
    calls = []

    def read(directory, cfg, weights=None, *, headers_only=False):
        calls.append(headers_only)
        return hf_gpt2.read(directory, {**cfg, "model_type": "gpt2"}, headers_only=headers_only)

    family = types.SimpleNamespace(
        read=read, tokenizer_name=lambda d, cfg: "kin", tokenizer_source=lambda d, cfg: "gpt2"
    )
    path = hf_dir(tmp_path / "kin", model_type="gpt2-kin")
    monkeypatch.setitem(HF_FAMILIES, "gpt2-kin", family)
    with torch.no_grad():
        assert torch.allclose(load_model(path)(X), tiny()(X), atol=1e-6)
    config, sd, files = describe_weights(path)
    assert config == CONFIG and sd["wte.weight"].is_meta and files == [path / "model.safetensors"]
    assert tokenizer_name(path) == "kin" and load_run_tokenizer(path).kind == "gpt2"
    assert calls == [False, True]


@pytest.fixture
def steps(monkeypatch):
    """The registry, restored after the test."""
    monkeypatch.setattr(load_steps, "_STEPS", dict(load_steps._STEPS))
    return load_steps


def test_a_load_step_runs_for_its_entry_on_the_built_model_before_the_move(tmp_path, steps):
    seen = []

    def doubled(model, entry, run_dir):  # a feature's step: reads its entry, returns the model
        seen.append((entry, run_dir, next(model.parameters()).dtype))
        with torch.no_grad():
            model.ln_f.weight.mul_(entry["by"])
        return model

    steps.register("doubling", doubled)
    save_model(tiny(), tmp_path / "plain")
    save_model(tiny(), tmp_path / "marked", extra={"doubling": {"by": 2.0}})
    save_model(tiny(), tmp_path / "null", extra={"doubling": None})
    model = load_model(tmp_path / "marked", dtype=torch.float64)
    assert seen == [({"by": 2.0}, tmp_path / "marked", torch.float32)]  # stored dtype, then moved
    assert model.ln_f.weight.dtype == torch.float64
    assert torch.equal(model.ln_f.weight, 2 * tiny().ln_f.weight.double())
    for path, adapters in ((tmp_path / "plain", True), (tmp_path / "null", True),
                           (tmp_path / "marked", False)):  # fmt: skip
        assert torch.equal(load_model(path, adapters=adapters).ln_f.weight, tiny().ln_f.weight)
    assert len(seen) == 1


def test_a_load_step_is_not_run_for_a_hugging_face_directory(tmp_path, steps):
    steps.register("model_type", lambda *a: pytest.fail("ran on a Hugging Face directory"))
    load_model(hf_dir(tmp_path / "hf"))


def test_one_step_an_entry_and_fine_tuning_registered_by_the_package(steps):
    assert load_steps.registered()["finetune"] is gptkiln._finetuned
    steps.register("finetune", gptkiln._finetuned)  # the same one again: as it was
    with pytest.raises(ValueError, match="'finetune' has a load step already"):
        steps.register("finetune", lambda model, entry, run_dir: model)
    assert load_steps.steps_for({"finetune": {}, "train": {}}) == [("finetune", gptkiln._finetuned)]
    assert load_steps.steps_for({"finetune": None}) == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weights_that_are_not_finite_are_refused_by_name(tmp_path, bad):
    model = tiny()
    with torch.no_grad():
        model.h[1].mlp.c_fc.weight[0, 3] = bad
    save_model(model, tmp_path / "run")
    with pytest.raises(GptkilnError, match=r"not finite .*: h\.1\.mlp\.c_fc\.weight;"):
        load_model(tmp_path / "run")
    save_model(tiny(), tmp_path / "good")
    load_model(tmp_path / "good")  # finite weights load


def test_a_run_saved_without_a_tokenizer_says_how_to_give_it_one(tmp_path):
    """...and one that keeps a Hugging Face tokenizer's files, as load_tokenizer's own advice
    says to copy in, loads with it."""
    import shutil

    from hf_tokenizer_dirs import write_llama3_dir

    save_model(tiny(), tmp_path / "run")  # no tokenizer: the model loads alone
    load_model(tmp_path / "run")
    with pytest.raises(GptkilnError, match=r"saved without its tokenizer .*tokenizer\.save\(dir\)"):
        load_run_tokenizer(tmp_path / "run")
    hf = write_llama3_dir(tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf / name, tmp_path / "run" / name)
    assert load_run_tokenizer(tmp_path / "run").kind == "hf"
