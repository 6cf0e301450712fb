"""Packing (``gptkiln finetune --pack``): short examples end to end in one window, none attending
another. A packed row gives every example the logits and the loss it has alone (GPT-2's learned
positions and Qwen3's rotary ones, SDPA and the spelled-out attention), and the same row under a
plain causal mask does not (so the check sees attention that crosses); windows fill in order; a
packed chat run says what it packed, learns, and its packed batch's loss is the unpacked one's."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_tokenizer_dirs import write_qwen3_dir

from gptkiln.checkpoint import save_model
from gptkiln.config import FinetuneConfig, GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.finetune import finetune, train_config
from gptkiln.finetune.chat import collate_examples
from gptkiln.finetune.task import Example, collate_packed, pack
from gptkiln.model import GPT
from gptkiln.tokenizers import load_tokenizer
from gptkiln.train import read_metrics
from gptkiln.train.precision import measure_step_seconds as real_measure

QWEN3 = (Path(__file__).parent / "chat_templates" / "qwen3-0.6b.jinja").read_text("utf-8")


def random_examples(lengths, vocab: int, seed: int = 0) -> list[Example]:
    rng = random.Random(seed)
    return [
        Example(
            [rng.randrange(vocab) for _ in range(n)],
            [i > 0 and rng.random() < 0.7 for i in range(n)],
        )
        for n in lengths
    ]


def per_token_losses(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")


@pytest.mark.parametrize("family", ["tiny", "qwen3-baby"])
@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_a_packed_row_gives_each_example_its_logits_and_loss_alone(family, attention):
    torch.manual_seed(0)
    config = GPTConfig.from_name(family, vocab_size=50, attention=attention)
    model = GPT(config).eval()
    examples = random_examples([6, 10, 8], config.vocab_size)
    x, y = collate_packed([examples], pad_id=0)  # (1, 2, T): ids and segments
    assert x.shape == (1, 2, 5 + 9 + 7) and x[0, 1].tolist() == [0] * 5 + [1] * 9 + [2] * 7
    with torch.no_grad():
        packed = model(x[:, 0], segments=x[:, 1])[0]  # (T, V)
        crossing = model(x[:, 0])[0]  # the same row, every token attending all before it
    at, crossed = 0, []
    for e in examples:
        ex, ey = collate_examples([e], pad_id=0)
        with torch.no_grad():
            alone = model(ex)[0]  # (n, V)
        n = len(e.ids) - 1
        assert torch.equal(y[0, at : at + n], ey[0])  # the same learnt targets
        torch.testing.assert_close(packed[at : at + n], alone, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            per_token_losses(packed[None, at : at + n], ey), per_token_losses(alone[None], ey)
        )
        crossed.append(not torch.allclose(crossing[at : at + n], alone, atol=1e-3))
        at += n
    assert crossed == [False, True, True]  # without the mask, later examples see earlier ones


def test_windows_fill_in_order_and_never_split_an_example():
    assert pack([5, 5, 5, 3], width=9) == [[0, 1], [2, 3]]  # inputs 4 + 4, then 4 + 2
    assert pack([20, 3, 3], width=9) == [[0], [1, 2]]  # too long alone: a window of its own
    assert pack([10], width=9) == [[0]]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("packing")
    tokenizer = load_tokenizer(write_qwen3_dir(root / "tokenizer", template=QWEN3))
    torch.manual_seed(0)
    config = GPTConfig.from_name(
        "qwen3-baby", vocab_size=tokenizer.vocab_size, n_layer=2, context_length=256
    )
    save_model(GPT(config), root / "base", tokenizer=tokenizer)
    rows = []
    for i in range(40):
        a, b = i % 7, i % 5
        messages = [
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": f"It is {a + b}."},
        ]
        rows.append({"messages": messages})
    (root / "chat.json").write_text(json.dumps(rows))
    return root


def quick(ft: FinetuneConfig, out: Path, **settings):
    base = dict(out=str(out), batch_size=2, lr=3e-3, progress=False, precision="fp32")
    return train_config(ft, **{**base, "sample_interval": 100, **settings})


def test_a_packed_chat_run_says_what_it_packed_and_learns(work, tmp_path, capsys):
    ft = FinetuneConfig(
        base=str(work / "base"), data=str(work / "chat.json"), task="chat", pack=True
    )
    finetune(ft, quick(ft, tmp_path / "run", max_steps=6, eval_interval=3))
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("packing:"))
    assert "34 training examples into " in line and "windows of up to 256 tokens" in line
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    assert rows[-1]["val_loss"] < rows[0]["val_loss"]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["finetune"]["config"]
    assert saved["pack"] is True


def test_a_packed_batch_has_the_loss_of_its_examples_unpacked(work, tmp_path):
    from gptkiln.finetune.chat import ChatTuning
    from gptkiln.train import Trainer

    ft = FinetuneConfig(
        base=str(work / "base"), data=str(work / "chat.json"), task="chat", pack=True
    )
    trainer = Trainer(
        quick(ft, tmp_path / "run", max_steps=1), task=lambda ctx: ChatTuning(ctx, ft)
    )
    trainer.close()
    task = trainer.task
    x, y = task.batches.get(0, 0)
    assert x.dim() == 3 and (x[:, 1].amax(dim=1) > 0).all()  # windows of several examples
    examples = []
    for row in range(x.size(0)):  # each window's examples, back from its segments
        for s in range(int(x[row, 1].max()) + 1):
            ids = x[row, 0][x[row, 1] == s].tolist()
            i = next(i for i in task.train_ids if task.examples[i].ids[:-1] == ids)
            examples.append(task.examples[i])
    model = task.model.eval()
    with torch.no_grad():
        packed = task.training_loss(model, x, y)
        _, alone = model(*collate_examples(examples, task.pad_id))
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_pack_is_for_instruct_and_chat():
    with pytest.raises(GptkilnError, match="--pack"):
        FinetuneConfig(base="b", data="d", task="dpo", pack=True)


def test_packed_instructions_have_the_loss_of_their_book_batches(tmp_path):
    import string

    from instruction_data import instructions

    from gptkiln.finetune.instruct import InstructionTuning, collate_instructions
    from gptkiln.tokenizers import build_char_tokenizer
    from gptkiln.train import Trainer

    tokenizer = build_char_tokenizer([string.printable], with_eot=True)
    torch.manual_seed(0)
    config = GPTConfig.from_name("tiny", vocab_size=tokenizer.vocab_size, context_length=512)
    save_model(GPT(config), tmp_path / "base", tokenizer=tokenizer)
    (tmp_path / "data.json").write_text(json.dumps(instructions(30)))
    ft = FinetuneConfig(
        base=str(tmp_path / "base"), data=str(tmp_path / "data.json"), mask_prompt=True, pack=True
    )
    trainer = Trainer(
        quick(ft, tmp_path / "run", max_steps=1), task=lambda ctx: InstructionTuning(ctx, ft)
    )
    trainer.close()
    task = trainer.task
    x, y = task.batches.get(0, 0)
    assert x.dim() == 3 and (x[:, 1].amax(dim=1) > 0).all()
    rows = []
    for row in range(x.size(0)):
        for s in range(int(x[row, 1].max()) + 1):
            ids = x[row, 0][x[row, 1] == s].tolist()
            rows.append(next(i for i in task.train_ids if task.ids[i] == ids))
    model = task.model.eval()
    with torch.no_grad():
        packed = task.training_loss(model, x, y)
        lengths = [task.prompt_lengths[i] for i in rows]
        batch = collate_instructions([task.ids[i] for i in rows], task.pad_id, 512, lengths)
        _, alone = model(*batch)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_auto_precision_measures_a_packed_run_on_its_own_loss(work, tmp_path, monkeypatch, capsys):
    """`--precision auto` times the step the run takes: packed (B, 2, T) windows through the
    task's loss, not the model's own forward of them."""
    import gptkiln.train.precision as precision
    from gptkiln.finetune.chat import ChatTuning
    from gptkiln.train import Trainer

    measured = []

    def measure(model, x, y, tokens, loss):
        measured.append((x.shape, tokens, loss))
        return real_measure(model, x, y, tokens, budget_s=0.0, loss=loss)

    monkeypatch.setattr(precision, "cpu_bf16_features", lambda: ["AMX"])
    monkeypatch.setattr(precision, "measure_step_seconds", measure)
    ft = FinetuneConfig(
        base=str(work / "base"), data=str(work / "chat.json"), task="chat", pack=True
    )
    cfg = quick(ft, tmp_path / "run", max_steps=1, precision="auto")
    trainer = Trainer(cfg, task=lambda ctx: ChatTuning(ctx, ft))
    trainer.close()
    [(shape, tokens, loss)] = measured
    assert len(shape) == 3 and shape[1] == 2 and tokens == shape[0] * shape[2]
    assert loss == trainer.task.training_loss
    assert "a training step of this model measured" in capsys.readouterr().out
