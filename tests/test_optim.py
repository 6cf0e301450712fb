"""AdamW parameter groups and the warm-up + cosine schedule."""

import math

import pytest
import torch

from gptkiln.config import GPTConfig
from gptkiln.model import GPT
from gptkiln.optim import lr_at, make_optimizer, param_groups


def test_weight_decay_only_on_matrices():
    model = GPT(GPTConfig.from_name("tiny", vocab_size=20))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and len(decay["params"]) > 0
    assert all(p.dim() == 1 for p in no_decay["params"]) and len(no_decay["params"]) > 0
    total = len(decay["params"]) + len(no_decay["params"])
    assert total == len(list(model.parameters()))
    opt = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95))
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["betas"] == (0.9, 0.95)
    # the optimizer takes those groups, and on CPU the fused kernel (bench/adamw.py: 4-9x)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in opt.param_groups] == [
        len(decay["params"]),
        total - len(decay["params"]),
    ]
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]


def test_warmup_then_cosine_to_floor():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.1 + 0.5 * 0.9)  # half-way down the cosine
    assert lr_at(110, **kw) == pytest.approx(0.1) and lr_at(500, **kw) == pytest.approx(0.1)
    lrs = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # monotone decay
    assert lr_at(80, **{**kw, "decay": False}) == 1.0
    assert lr_at(35, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.25)))


def test_a_time_budget_further_along_than_the_steps_leads_the_cosine():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert lr_at(60, **kw, time_used=0.2) == lr_at(60, **kw)  # the steps are further: theirs
    assert lr_at(20, **kw, time_used=0.5) == pytest.approx(0.1 + 0.5 * 0.9)  # half the time
    assert lr_at(20, **kw, time_used=1.0) == 0.1 and lr_at(20, **kw, time_used=1.3) == 0.1
    assert lr_at(5, **kw, time_used=0.9) == lr_at(5, **kw)  # warm-up is counted in steps
    assert lr_at(5, **kw, time_used=1.0) == 0.1  # ... until the budget ends in it: the floor
    assert lr_at(20, **{**kw, "decay": False}, time_used=0.7) == 1.0
