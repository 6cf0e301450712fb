"""`--precision auto`: bf16 autocast where a measurement on this CPU says it pays, fp32
elsewhere, said in the run's first line, recorded, and kept on resume.

The conftest makes auto's measurement find no gain in every other test; here it is replaced by
one that finds what each test needs, and run for real once.
"""

from __future__ import annotations

import dataclasses
import json
import math

import torch
from test_train import tiny_config

import gptkiln.train.precision as precision
from gptkiln import devices
from gptkiln.config import GPTConfig
from gptkiln.distributed import World
from gptkiln.model import GPT
from gptkiln.train import Trainer, train
from gptkiln.train.precision import (
    MARGIN,
    choose_precision,
    precision_for_run,
    resumed_precision,
)
from gptkiln.train.precision import measure_step_seconds as real_measure


def never() -> tuple[float, float]:
    raise AssertionError("measured where nothing needs measuring")


def test_auto_on_a_bf16_cpu_takes_bf16_when_it_measures_faster_by_the_margin():
    amx = lambda: ["AMX", "AVX512-BF16"]  # noqa: E731
    faster = choose_precision("auto", "cpu", lambda: (1.0, 0.6), amx)
    assert faster.precision == "bf16"
    assert "AMX and AVX512-BF16" in faster.reason and "1.67x" in faster.reason
    assert faster.line().startswith("precision: bf16 (auto: ")
    slower = choose_precision("auto", "cpu", lambda: (1.0, 1.25), amx)
    assert slower.precision == "fp32" and "0.80x" in slower.reason
    # a gain inside the margin is noise, not a reason to round coarser
    marginal = choose_precision("auto", "cpu", lambda: (1.0, 1.0 / (MARGIN - 0.02)), amx)
    assert marginal.precision == "fp32" and f"bf16 needs {MARGIN:.2f}x" in marginal.reason


def test_auto_without_bf16_instructions_is_fp32_without_measuring():
    plain = choose_precision("auto", "cpu", never, lambda: [])
    assert plain.precision == "fp32"
    assert plain.reason == "auto: this CPU has neither AMX nor AVX512-BF16"


def test_auto_keeps_its_rule_on_gpus_and_an_explicit_precision_is_taken_as_asked():
    assert choose_precision("auto", "cuda:1", never, never).precision == "bf16"
    assert choose_precision("auto", "mps", never, never).precision == "fp32"
    for asked in ("fp32", "bf16"):
        choice = choose_precision(asked, "cpu", never, never)
        assert (choice.precision, choice.reason) == (
            asked,
            "as asked (--precision, or the run's recipe)",
        )


def test_every_process_must_measure_bf16_faster(monkeypatch):
    model = GPT(GPTConfig.from_name("tiny", vocab_size=11, context_length=8))
    batch = (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    monkeypatch.setattr(precision, "cpu_bf16_features", lambda: ["AMX"])
    monkeypatch.setattr(precision, "measure_step_seconds", lambda *a, **kw: (1.0, 0.5))
    alone = precision_for_run("auto", "cpu", model, batch, World())
    assert alone.precision == "bf16"
    monkeypatch.setattr(precision.dist_utils, "any_rank", lambda flag, world: True)
    outvoted = precision_for_run("auto", "cpu", model, batch, World())
    assert outvoted.precision == "fp32" and "another process" in outvoted.reason


def test_the_measurement_leaves_the_model_and_the_random_generator_as_they_were():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=11, context_length=64, dropout=0.1))
    model.train()
    x = torch.randint(0, 11, (4, 64))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    fp32_s, bf16_s = real_measure(model, x, x, tokens=x.numel(), budget_s=0.0)
    assert 0 < fp32_s < math.inf and 0 < bf16_s < math.inf
    assert torch.equal(torch.get_rng_state(), rng)  # dropout's draws are the run's own
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_bf16_features_come_from_torch_or_else_from_cpuinfo(monkeypatch):
    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    monkeypatch.setattr(devices, "_cpuinfo_flags", lambda: {"avx512f", "avx512_bf16"})
    assert devices.cpu_bf16_features() == ["AVX512-BF16"]
    monkeypatch.setattr(devices, "_cpuinfo_flags", lambda: {"avx2", "amx_bf16", "amx_tile"})
    assert devices.cpu_bf16_features() == ["AMX"]
    monkeypatch.setattr(devices, "_cpuinfo_flags", lambda: {"avx2"})
    assert devices.cpu_bf16_features() == []


def measuring(monkeypatch, fp32_s: float, bf16_s: float) -> None:
    """auto on a CPU with AMX that measures these step times."""
    monkeypatch.setattr(precision, "cpu_bf16_features", lambda: ["AMX"])
    monkeypatch.setattr(precision, "measure_step_seconds", lambda *a, **kw: (fp32_s, bf16_s))


def saved_precision(run) -> tuple[str, str]:
    """(the trainer state's precision, config.json's)."""
    state = torch.load(run / "trainer_state.pt", weights_only=True)
    return state["precision"], json.loads((run / "config.json").read_text())["train"]["precision"]


def test_a_run_says_what_auto_chose_trains_in_it_and_records_it(
    play_path, tmp_path, monkeypatch, capsys
):
    measuring(monkeypatch, 1.0, 0.5)
    cfg = tiny_config(play_path, tmp_path / "run", max_steps=4)
    trainer = Trainer(cfg)
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("precision: bf16 (auto: this CPU has AMX;") and "2.00x" in first
    x, y = trainer.batches.get(0, 0)
    with trainer.autocast:
        logits, _ = trainer.model(x, y)
    assert logits.dtype == torch.bfloat16
    trainer.close()
    train(cfg, overwrite=True)
    assert saved_precision(tmp_path / "run") == ("bf16", "bf16")


def test_a_resumed_run_keeps_the_precision_it_started_with(
    play_path, tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    measuring(monkeypatch, 1.0, 0.5)
    cfg = tiny_config(play_path, run, max_steps=4)
    train(cfg)
    capsys.readouterr()
    # the machine now measures bf16 slower: a fresh run would take fp32, the resume does not
    monkeypatch.setattr(precision, "measure_step_seconds", lambda *a, **kw: never())
    train(dataclasses.replace(cfg, max_steps=8), resume=True)
    assert capsys.readouterr().out.splitlines()[0] == "precision: bf16 (kept from the run's start)"
    assert saved_precision(run) == ("bf16", "bf16")
    measuring(monkeypatch, 1.0, 2.0)
    fresh = Trainer(dataclasses.replace(cfg, out=str(tmp_path / "fresh")))
    assert fresh.precision.precision == "fp32"
    fresh.close()
    # a checkpoint from before the choice was recorded resumes as auto was then: fp32 on CPU
    state = torch.load(run / "trainer_state.pt", weights_only=True)
    del state["precision"]
    torch.save(state, run / "trainer_state.pt")
    resumed = Trainer(dataclasses.replace(cfg, max_steps=12), resume=True)
    assert resumed.precision.precision == "fp32" and "no record" in resumed.precision.reason
    resumed.close()
    assert resumed_precision("fp32", "bf16", "cpu").precision == "fp32"  # asked: as asked


def test_a_real_auto_run_on_this_machine_measures_where_the_cpu_has_bf16(
    play_path, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(precision, "measure_step_seconds", real_measure)
    result = train(tiny_config(play_path, tmp_path / "run", max_steps=4))
    first = capsys.readouterr().out.splitlines()[0]
    chosen = saved_precision(tmp_path / "run")[0]
    assert first.startswith(f"precision: {chosen} (auto: ")
    if devices.cpu_bf16_features():
        assert "a training step of this model measured" in first
    else:
        assert chosen == "fp32" and "neither AMX nor AVX512-BF16" in first
    assert math.isfinite(result.val_loss)
