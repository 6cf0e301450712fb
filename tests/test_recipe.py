"""The speedrun recipe: Muon beside AdamW (split, state, exact resume), the warm-up-stable-decay
schedule, and the model choices (ReLU², logit soft-cap, zero-initialised output projections),
each off unless a config has it."""

import copy
import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F

from gptkiln.config import PRESETS, GPTConfig, TrainConfig
from gptkiln.errors import GptkilnError
from gptkiln.interop import config_to_hf
from gptkiln.model import GPT
from gptkiln.optim import MuonAdamW, hidden_matrices, lr_at, make_optimizer
from gptkiln.train import read_metrics


def tiny_qwen(**choices) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("qwen3-baby", vocab_size=40, context_length=16, **choices))


def a_step(model: GPT, optimizer: torch.optim.Optimizer, seed: int = 0) -> float:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 40, (2, 16), generator=g)
    _, loss = model(x, x.roll(-1, 1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


# -- Muon ---------------------------------------------------------------------------------------
def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = tiny_qwen()
    opt = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95), "muon", momentum=0.9)
    assert isinstance(opt, MuonAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = [names[id(p)] for p in opt.muon.param_groups[0]["params"]]
    adamw = [names[id(p)] for g in opt.adamw.param_groups for p in g["params"]]
    assert muon == [names[id(p)] for p in hidden_matrices(model)]
    assert len(muon) == 4 * 7  # q, k, v, o, gate, up, down in each of 4 blocks
    assert all(n.startswith("h.") and n.endswith("proj.weight") for n in muon)
    assert "wte.weight" in adamw and "ln_f.weight" in adamw and "h.0.attn.q_norm.weight" in adamw
    assert sorted(muon + adamw) == sorted(names.values())  # every parameter, once (head tied)
    assert opt.muon.param_groups[0]["momentum"] == 0.9
    assert opt.param_groups == [*opt.muon.param_groups, *opt.adamw.param_groups]
    # the trainer sets the learning rate on the one list: both optimizers see it
    for group in opt.param_groups:
        group["lr"] = 0.5
    assert {g["lr"] for g in opt.muon.param_groups + opt.adamw.param_groups} == {0.5}


def test_adamw_lr_gives_adamws_part_its_own_peak_on_the_same_schedule():
    from gptkiln.train.optimizer_step import OptimizerStep

    model = tiny_qwen()
    opt = make_optimizer(model, 2e-3, 0.1, (0.9, 0.95), "muon", adamw_lr=8e-3)
    assert opt.muon.param_groups[0]["lr"] == 2e-3
    assert {g["lr"] for g in opt.adamw.param_groups} == {8e-3}
    x = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(0))
    batches = type("One", (), {"get": lambda self, step, micro: (x, x.roll(-1, 1))})()
    cfg = TrainConfig(lr=2e-3, warmup_steps=4, grad_clip=0.0, precision="fp32")
    lr, _ = OptimizerStep(model, model, opt, batches, cfg, "cpu")(1, 10, 0.0)
    assert lr == pytest.approx(1e-3)  # step 1 of 4 of the warm-up
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert {round(g["lr"], 9) for g in opt.adamw.param_groups} == {4e-3}  # 4x, as the peaks
    copied = copy.deepcopy(opt.state_dict())  # a resume keeps the ratio
    again = make_optimizer(tiny_qwen(), 2e-3, 0.1, (0.9, 0.95), "muon")
    again.load_state_dict(copied)
    assert {g.get("lr_scale") for g in again.adamw.param_groups} == {4.0}
    with pytest.raises(GptkilnError, match="adamw_lr must be"):
        TrainConfig(optimizer="muon", adamw_lr=0.0)


def test_embedding_lr_gives_the_input_embedding_its_own_peak_apart_from_the_head():
    model = tiny_qwen(tie_embeddings=False)
    opt = make_optimizer(model, 2e-3, 0.1, (0.9, 0.95), "muon", adamw_lr=8e-3, embedding_lr=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    peak = {
        names[id(p)]: (g["lr"], g["lr_scale"]) for g in opt.adamw.param_groups for p in g["params"]
    }
    assert peak["wte.weight"] == (0.1, pytest.approx(50.0))
    assert peak["lm_head.weight"] == (8e-3, pytest.approx(4.0))  # the head keeps --adamw-lr
    assert peak["ln_f.weight"] == (8e-3, pytest.approx(4.0))
    assert sorted(peak) == sorted(
        set(names.values()) - {names[id(p)] for p in hidden_matrices(model)}
    )
    before = model.wte.weight.detach().clone()
    a_step(model, opt)
    assert not torch.equal(before, model.wte.weight)
    with pytest.raises(GptkilnError, match="embedding_lr must be"):
        TrainConfig(optimizer="muon", embedding_lr=-1.0)


def test_a_muon_step_is_an_orthogonalised_update_of_the_matrices():
    """One step from zero momentum: each matrix moves by lr x 0.2 sqrt(max(rows, cols)) x the
    Newton-Schulz orthogonalisation of its gradient (singular values near 1), not by Adam's
    sign-like step (whose largest singular value, at this scale, is about 17)."""
    model = tiny_qwen()
    opt = make_optimizer(model, 1e-2, 0.0, (0.9, 0.95), "muon")
    w = model.h[0].mlp.gate_proj.weight  # (352, 128)
    before = w.detach().clone()
    x = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(0))
    model(x, x.roll(-1, 1))[1].backward()
    opt.step()
    update = (before - w.detach()) / (1e-2 * 0.2 * math.sqrt(352))
    singular = torch.linalg.svdvals(update.float())  # descending
    # 32 tokens make a gradient of rank <= 32: its directions all near 1, none far above
    assert singular[:16].min() > 0.5 and singular.max() < 1.6


def test_muon_state_round_trips_and_the_steps_after_it_are_the_same():
    model = tiny_qwen()
    opt = make_optimizer(model, 1e-2, 0.1, (0.9, 0.95), "muon")
    for seed in range(2):
        a_step(model, opt, seed)
    saved = copy.deepcopy(opt.state_dict())  # as from disk: no tensor shared with opt's
    kinds = {frozenset(s) for s in saved["state"].values()}
    assert frozenset({"momentum_buffer"}) in kinds  # Muon's
    assert frozenset({"step", "exp_avg", "exp_avg_sq"}) in kinds  # AdamW's
    again = tiny_qwen()
    again.load_state_dict(model.state_dict())
    opt2 = make_optimizer(again, 1e-2, 0.1, (0.9, 0.95), "muon")
    opt2.load_state_dict(saved)
    assert opt2.muon.state is opt2.state and opt2.adamw.param_groups == opt2.param_groups[1:]
    for seed in (2, 3):
        assert a_step(model, opt, seed) == a_step(again, opt2, seed)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, again.state_dict()[name], rtol=0, atol=0)


def test_muon_refuses_settings_out_of_range():
    TrainConfig(optimizer="muon", parallel="fsdp")  # each update gathered whole: test_distributed
    with pytest.raises(GptkilnError, match="muon_momentum must be in"):
        TrainConfig(optimizer="muon", muon_momentum=1.0)
    with pytest.raises(GptkilnError, match="optimizer must be"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(GptkilnError, match="cooldown must be in"):
        TrainConfig(schedule="wsd", cooldown=0.0)


@pytest.fixture(scope="module")
def muon_runs(play_path, tmp_path_factory):
    """A Muon run of 6 steps at once, and one of 3 steps resumed to 6."""
    from gptkiln.cli import main

    root = tmp_path_factory.mktemp("muon")

    def flags(out, steps):
        values = dict(model="qwen3-baby", tokenizer="char", context_length=32, batch_size=4,
                      max_steps=steps, eval_interval=3, eval_batches=1, checkpoint_interval=3,
                      sample_interval=100, sample_tokens=4, warmup_steps=2, seed=3,
                      optimizer="muon", precision="fp32", schedule="wsd", relu2=True,
                      logit_softcap=10.0, zero_init_out=True, value_embeds=1,
                      attention_windows="0,8,8,0")  # fmt: skip
        out = ["train", "--data", str(play_path), "--out", str(root / out), "--no-progress"]
        for key, value in values.items():
            if value is True:
                out.append("--" + key.replace("_", "-"))
            else:
                out += ["--" + key.replace("_", "-"), str(value)]
        return out

    assert main(flags("whole", 6)) == 0
    assert main(flags("resumed", 3)) == 0
    assert main([*flags("resumed", 6), "--resume"]) == 0
    return root / "whole", root / "resumed", flags


def test_a_resumed_muon_run_ends_where_an_uninterrupted_one_does(muon_runs):
    from gptkiln.loading import load_model

    whole, resumed, _ = muon_runs
    state = torch.load(whole / "trainer_state.pt", weights_only=True)
    assert state["optimizer_kind"] == "muon"
    assert any("momentum_buffer" in s for s in state["optimizer"]["state"].values())
    rows, again = read_metrics(whole / "metrics.csv"), read_metrics(resumed / "metrics.csv")
    assert [r["step"] for r in rows] == [3, 6] == [r["step"] for r in again]
    for row, other in zip(rows, again, strict=True):
        assert row["train_loss"] == other["train_loss"] and row["val_loss"] == other["val_loss"]
    a, b = load_model(whole), load_model(resumed)
    assert a.config.recipe_choices() == [
        "relu2", "logit_softcap", "zero_init_out", "value_embeds", "attention_windows"
    ]  # fmt: skip
    for name, tensor in a.state_dict().items():
        torch.testing.assert_close(tensor, b.state_dict()[name], rtol=0, atol=0)


def test_a_resume_with_the_other_optimizer_is_one_line(muon_runs, capsys):
    from gptkiln.cli import main

    whole, _, flags = muon_runs
    argv = [*flags("whole", 9), "--resume", "--optimizer", "adamw"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "trained with --optimizer muon and this resume asks for adamw" in err
    assert "Traceback" not in err


# -- the schedule -------------------------------------------------------------------------------
def test_warmup_stable_decay_holds_the_peak_then_falls_straight_to_the_floor():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110, schedule="wsd", cooldown=0.3)
    assert lr_at(0, **kw) == pytest.approx(0.1) and lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == lr_at(50, **kw) == lr_at(80, **kw) == 1.0  # stable to 70%
    assert lr_at(95, **kw) == pytest.approx(1.0 - 0.9 * 15 / 30)  # half-way down the line
    assert lr_at(110, **kw) == pytest.approx(0.1)
    lrs = [lr_at(s, **kw) for s in range(80, 111)]
    steps = [a - b for a, b in zip(lrs, lrs[1:])]
    assert all(s == pytest.approx(0.9 / 30) for s in steps)  # a straight line
    assert lr_at(20, **kw, time_used=0.85) == pytest.approx(0.55)  # a time budget leads it too


# -- the model choices --------------------------------------------------------------------------
def test_relu2_gates_the_mlp_with_relu_squared():
    model = tiny_qwen(relu2=True)
    mlp = model.h[0].mlp
    x = torch.randn(2, 3, 128)
    want = mlp.down_proj(F.relu(mlp.gate_proj(x)) ** 2 * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), want)
    plain = tiny_qwen()
    assert not torch.allclose(plain.h[0].mlp(x), mlp(x))  # SiLU otherwise (same weights)
    with pytest.raises(GptkilnError, match="relu2 replaces the SiLU gate of a swiglu MLP"):
        GPTConfig.from_name("baby", relu2=True)


def test_the_logit_softcap_bounds_every_logit_and_scoring_sees_it():
    model = tiny_qwen(logit_softcap=2.0)
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # logits far past the cap
        x = torch.randint(0, 40, (2, 16))
        logits = model(x)
        raw = model.head(model.hidden(x))
    assert logits.abs().max() <= 2.0 and raw.abs().max() > 4.0
    torch.testing.assert_close(logits, 2.0 * torch.tanh(raw / 2.0))
    torch.testing.assert_close(model.logits(model.hidden(x)), logits)  # what evaluate scores
    with pytest.raises(GptkilnError, match="logit_softcap must be a number > 0"):
        GPTConfig.from_name("qwen3-baby", logit_softcap=0.0)


def test_zero_init_out_starts_every_block_as_the_identity():
    model = tiny_qwen(zero_init_out=True)
    for block in model.h:
        assert not block.attn.o_proj.weight.any() and not block.mlp.down_proj.weight.any()
        assert block.mlp.up_proj.weight.std() > 0.01
        x = torch.randn(1, 4, 128)
        torch.testing.assert_close(block(x), x)
    with pytest.raises(GptkilnError, match="zero_init_out .* init 'gpt2'"):
        GPTConfig.from_name("book-124m", zero_init_out=True)


def test_value_embeddings_enter_the_values_of_the_first_and_last_blocks_and_learn():
    model = tiny_qwen(value_embeds=2)
    assert len(model.value_embeds) == 2 and model.value_embeds[0].weight.shape == (40, 64)
    x = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = tiny_qwen()
    plain.load_state_dict(model.state_dict(), strict=False)  # the same weights but theirs
    assert not torch.allclose(model(x), plain(x))
    with torch.no_grad():  # b = 0 and a = 1 in every block: the plain model's output again
        for block in model.h:
            block.attn.value_mix.copy_(torch.tensor([1.0, 0.0]))
        torch.testing.assert_close(model(x), plain(x))
        for block in model.h:
            block.attn.value_mix.fill_(0.5)
    _, loss = model(x, x.roll(-1, 1))
    loss.backward()
    for p in [*model.value_embeds.parameters(), *(b.attn.value_mix for b in model.h)]:
        assert p.grad is not None and p.grad.abs().sum() > 0
    # U-shaped: blocks 0, 1 take embeddings 0, 1, and blocks 2, 3 the same two again
    from gptkiln.positions import value_index

    assert [value_index(i, 2, 6) for i in range(6)] == [0, 1, None, None, 0, 1]
    in_between = GPT(GPTConfig.from_name("qwen3-baby", vocab_size=40, n_layer=6, value_embeds=2))
    assert [b.attn.value_mix is not None for b in in_between.h] == [1, 1, 0, 0, 1, 1]
    with pytest.raises(GptkilnError, match="value_embeds must be in"):
        GPTConfig.from_name("qwen3-baby", value_embeds=3)


def test_a_sliding_window_masks_what_lies_beyond_it_in_training_and_decoding():
    from gptkiln.positions import window_mask

    got = window_mask(None, 6, None, 3, torch.device("cpu"))[0, 0]
    i, j = torch.arange(6)[:, None], torch.arange(6)
    assert torch.equal(got, (j <= i) & (j > i - 3))  # the reference: causal, 3 back at most
    assert window_mask(None, 6, None, 0, torch.device("cpu")) is None  # 0: the whole context
    attentions: list[torch.Tensor] = []
    model = tiny_qwen(attention_windows=[0, 3, 3, 0]).eval()
    x = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x, attentions=attentions)
        assert attentions[1][..., 5, :3].abs().max() == 0  # query 5 sees keys 3, 4, 5 only
        assert attentions[1][..., 5, 3:6].sum(-1).allclose(torch.ones(1))
        assert attentions[0][..., 5, :3].abs().min() > 0  # the whole context in block 0
        plain = tiny_qwen().eval()
        assert not torch.allclose(plain(x), full)  # the same weights without windows
        model.setup_cache(2, 16)  # a decode masks the same keys: the same logits
        steps = [model(x[:, :4], start_pos=0)]
        steps += [model(x[:, t : t + 1], start_pos=t) for t in range(4, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(GptkilnError, match="attention_windows must be a list of 4"):
        GPTConfig.from_name("qwen3-baby", attention_windows=[4, 4])
    assert GPTConfig.from_name("qwen3-baby", attention_windows=[0] * 4).attention_windows is None


def test_aligned_windows_start_at_the_end_of_text_where_they_would_cross_it():
    import numpy as np

    from gptkiln.data.windows import AlignedWindowDataset, RandomWindowDataset

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 50, 2000)
    tokens[rng.choice(2000, 40, replace=False)] = 0  # 0: the end of text
    aligned = AlignedWindowDataset(tokens, 16, 500, 7, eot_id=0)
    plain = RandomWindowDataset(tokens, 16, 500, 7)
    moved = 0
    for k in range(500):
        start, first = plain.offset(k), aligned.offset(k)
        x, _ = aligned[k]
        crosses = (tokens[start + 1 : start + 16] == 0).any()  # the next document follows
        if crosses and first + 16 < len(tokens):
            assert first > start and x[0] == 0 and tokens[start + 1 : first].all()
            moved += 1
        else:
            assert first == start
    assert moved > 100


def test_aligned_windows_over_a_large_corpus_cost_no_memory_of_their_own():
    """Nothing is indexed over the whole token array: a corpus of billions of tokens is read
    only where the windows fall."""
    import tracemalloc

    import numpy as np

    from gptkiln.data.windows import AlignedWindowDataset

    tokens = np.ones(50_000_000, dtype=np.uint16)
    tracemalloc.start()
    aligned = AlignedWindowDataset(tokens, 64, 1000, 7, eot_id=0)
    aligned[3]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1_000_000, peak


def test_the_choices_are_off_in_every_preset_and_block_an_export():
    for name in PRESETS:
        assert GPTConfig.from_name(name).recipe_choices() == [], name
    config_to_hf(GPTConfig.from_name("qwen3-baby", zero_init_out=True))  # only the start differs
    choices = (dict(value_embeds=1), dict(attention_windows=[0, 8, 8, 0]))
    for choice in (dict(relu2=True), dict(logit_softcap=15.0), *choices):
        with pytest.raises(GptkilnError, match="Hugging Face's classes do not compute"):
            config_to_hf(GPTConfig.from_name("qwen3-baby", **choice))


def test_train_flags_set_the_choices_and_0_takes_the_cap_off():
    from gptkiln.train.task import model_config_for

    cfg = TrainConfig(relu2=True, logit_softcap=15.0, zero_init_out=True, value_embeds=2)
    model = model_config_for(cfg, 100)
    assert (model.relu2, model.logit_softcap, model.zero_init_out) == (True, 15.0, True)
    assert model.value_embeds == 2
    windows = model_config_for(TrainConfig(attention_windows="0,16,16,0"), 100)
    assert windows.attention_windows == [0, 16, 16, 0]
    with pytest.raises(GptkilnError, match="attention_windows must be whole numbers"):
        model_config_for(TrainConfig(attention_windows="16;16"), 100)
    assert model_config_for(TrainConfig(logit_softcap=0.0), 100).logit_softcap is None
    assert model_config_for(TrainConfig(), 100).recipe_choices() == []


def test_a_run_with_a_computed_choice_is_refused_by_both_exports(muon_runs, tmp_path):
    from gptkiln.export.gguf import export_gguf
    from gptkiln.export.hf import export_hf

    whole = muon_runs[0]
    choices = "relu2, logit_softcap, value_embeds, attention_windows"
    with pytest.raises(GptkilnError, match=f"{choices}, which llama.cpp"):
        export_gguf(whole, tmp_path / "m.gguf")
    named = f"^{re.escape(str(whole))}: this model uses {choices}, which Hugging Face"
    with pytest.raises(GptkilnError, match=named):  # the run named, as the GGUF export names it
        export_hf(whole, tmp_path / "hf")
    assert not (tmp_path / "m.gguf").exists()


def test_the_batched_muon_step_is_torchs_muon_step():
    """MuonAdamW orthogonalises the matrices of one shape together: the same update as
    torch.optim.Muon's loop over them (given the same gradients), to bf16's rounding."""
    ours, theirs = tiny_qwen(), tiny_qwen()
    opt = make_optimizer(ours, 1e-2, 0.1, (0.9, 0.95), "muon")
    ref = torch.optim.Muon(
        hidden_matrices(theirs), lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
    )
    start = [p.detach().clone() for p in hidden_matrices(ours)]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):  # momentum carries the first steps into the third
        for p, q in zip(hidden_matrices(ours), hidden_matrices(theirs), strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, q, before in zip(hidden_matrices(ours), hidden_matrices(theirs), start, strict=True):
        moved = (q.detach() - before).abs().max()
        assert moved > 1e-3
        assert (p.detach() - q.detach()).abs().max() < 0.05 * moved  # bf16's rounding


def test_the_bundled_speedrun_recipe_makes_its_model_and_optimizer():
    from gptkiln.cli.train import load_recipe
    from gptkiln.train.task import model_config_for

    # laid over the run before it, the recipe alone makes every choice of the default's run
    cfg = TrainConfig(**{**load_recipe("baseline"), **load_recipe("speedrun")})
    model = model_config_for(cfg, 100)
    assert (cfg.optimizer, cfg.schedule, cfg.adamw_lr) == ("muon", "wsd", 8e-3)
    assert (cfg.batch_size, cfg.max_steps, cfg.cooldown, cfg.lr) == (12, 1100, 0.5, 2e-3)
    assert cfg.sampling == "windows"  # each window once: 0.015 bits/char over random offsets
    assert not model.tie_embeddings and model.recipe_choices() == []  # it exports
    default = TrainConfig()
    assert model_config_for(default, 100) == dataclasses.replace(model, tie_embeddings=False)
    assert {k: getattr(default, k) for k in load_recipe("speedrun") if k != "tie_embeddings"} == {
        k: getattr(cfg, k) for k in load_recipe("speedrun") if k != "tie_embeddings"
    }


def test_the_default_run_is_the_recipe_and_the_baseline_recipe_is_the_run_before_it():
    from gptkiln.cli import build_parser, train_config_from_args
    from gptkiln.config import FinetuneConfig
    from gptkiln.finetune import train_config
    from gptkiln.train.task import model_config_for

    def chosen(*argv: str) -> TrainConfig:
        return train_config_from_args(build_parser().parse_args(["train", *argv]))

    new, old = chosen(), chosen("--config", "baseline")
    assert (new.optimizer, new.lr, new.adamw_lr) == ("muon", 2e-3, 8e-3)
    assert (new.schedule, new.cooldown) == ("wsd", 0.5)
    assert (new.batch_size, new.max_steps, new.sampling) == (12, 1100, "windows")
    assert (old.optimizer, old.lr, old.schedule) == ("adamw", 1e-3, "cosine")
    assert old.sampling == "random"
    assert (old.batch_size, old.max_steps, old.warmup_steps, old.min_lr) == (8, 1800, 30, 1e-4)
    assert (new.model, old.model) == ("qwen3-baby-untied", "qwen3-baby")
    assert new.tokenizer == old.tokenizer == "bpe:16384"
    assert model_config_for(old, 100).tie_embeddings  # the run before: qwen3-baby, tied
    untied = model_config_for(new, 100)
    assert not untied.tie_embeddings and untied.recipe_choices() == []  # it exports
    assert untied == dataclasses.replace(model_config_for(old, 100), tie_embeddings=False)
    # the other bundled recipes keep the optimizer and schedule they were measured with
    for name in ("book-verdict", "gpt2-124m", "mini-shakespeare", "shakespeare-char"):
        recipe = chosen("--config", name)
        assert (recipe.optimizer, recipe.schedule) == ("adamw", "cosine"), name
    # and fine-tuning keeps AdamW, the cosine and the book's batch
    loop = train_config(FinetuneConfig(base="runs/x", data="d.json"), out="o")
    assert (loop.optimizer, loop.schedule, loop.batch_size) == ("adamw", "cosine", 8)


def test_a_run_of_the_default_before_the_recipe_resumes_with_config_baseline(
    play_path, tmp_path, capsys
):
    from gptkiln.cli import main

    run = tmp_path / "old"
    argv = ["train", "--data", str(play_path), "--out", str(run), "--no-progress"]
    argv += ["--tokenizer", "char", "--context-length", "32", "--eval-interval", "2"]
    argv += ["--eval-batches", "1", "--sample-interval", "100", "--precision", "fp32"]
    assert main([*argv, "--config", "baseline", "--max-steps", "2"]) == 0
    capsys.readouterr()
    # a resume takes the run's recorded settings, not today's defaults (Muon, untied, 12
    # windows, WSD, which would refuse its model): --resume alone continues it
    from gptkiln.config import TrainConfig
    from gptkiln.errors import GptkilnError
    from gptkiln.train import train

    today = TrainConfig(data=str(play_path), out=str(run), tokenizer="char", max_steps=3)
    with pytest.raises(GptkilnError, match="which are now --config baseline"):
        train(today, resume=True)  # from Python: today's defaults, named in one line
    assert main(["train", "--out", str(run), "--max-steps", "3", "--resume"]) == 0
    assert main([*argv, "--config", "baseline", "--max-steps", "3", "--resume"]) == 0
    # its recipe with a setting changed on purpose resumes as before
    assert (
        main([*argv, "--config", "baseline", "--max-steps", "4", "--lr", "5e-4", "--resume"]) == 0
    )
    assert [r["step"] for r in read_metrics(run / "metrics.csv")] == [2, 3, 4]
