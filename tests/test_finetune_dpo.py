"""Preference tuning (DPO): the loss equals TRL's ``DPOTrainer`` on the same model, batch and
beta; it is ln 2 while the policy is the reference; training raises the reward accuracy on the
training pairs above 0.5, in full and with LoRA (whose reference is the base, adapters off); a
resumed run ends where an uninterrupted one does; bad pairs are one line.

The models are tiny and random, built here (a Hugging Face Qwen3 with the real Qwen3-0.6B
template for the comparison with TRL)."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from hf_tokenizer_dirs import write_qwen3_dir
from test_cli import assert_one_line_error, cli

from gptkiln.chat_template import load_chat_template
from gptkiln.cli import main
from gptkiln.config import FinetuneConfig
from gptkiln.errors import GptkilnError
from gptkiln.finetune import finetune, train_config
from gptkiln.finetune.chat import ConversationEncoder, collate_examples
from gptkiln.finetune.dpo import answer_only, dpo_loss, sequence_log_probs
from gptkiln.loading import load_model
from gptkiln.tokenizers import load_tokenizer
from gptkiln.train import read_metrics
from gptkiln.train.precision import measure_step_seconds as real_measure

QWEN3 = (Path(__file__).parent / "chat_templates" / "qwen3-0.6b.jinja").read_text("utf-8")


def pairs(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = i % 7, i % 5
        rows.append(
            {
                "prompt": f"What is {a} plus {b}?",
                "chosen": f"It is {a + b}.",
                "rejected": f"I do not know, maybe {a * b + 3}?",
            }
        )
    return rows


def hf_qwen3(path: Path, vocab_size: int, seed: int):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A tiny Hugging Face Qwen3 (random; its tokenizer with the real Qwen3-0.6B template), the
    reference, and preference pairs."""
    root = tmp_path_factory.mktemp("dpo")
    tokenizer_dir = write_qwen3_dir(root / "tokenizer", template=QWEN3)
    hf_qwen3(root / "reference", load_tokenizer(tokenizer_dir).vocab_size, seed=0)
    for f in tokenizer_dir.iterdir():
        if f.name != "config.json":
            (root / "reference" / f.name).write_bytes(f.read_bytes())
    (root / "pairs.json").write_text(json.dumps(pairs(40)), encoding="utf-8")
    return root


def our_batch(directory: Path, rows: list[dict]):
    """(encoder, chosen and rejected examples, the (2B, T) batch) as PreferenceTuning makes."""
    tokenizer = load_tokenizer(directory)
    encoder = ConversationEncoder(load_chat_template(directory), tokenizer)
    chosen, rejected = [], []
    for row in rows:
        prompt = [{"role": "user", "content": row["prompt"]}]
        for answers, key in ((chosen, "chosen"), (rejected, "rejected")):
            answer = {"role": "assistant", "content": row[key]}
            answers.append(answer_only(encoder.encode([*prompt, answer])))
    return encoder, chosen, rejected, collate_examples(chosen + rejected, tokenizer.eot_id)


def nudged(path: Path):
    """The policy: the model of ``path`` nudged (seeded) away from it."""
    model = load_model(path)
    with torch.no_grad():
        torch.manual_seed(1)
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_the_loss_equals_trls_dpo_trainer_on_the_same_model_batch_and_beta(work, tmp_path, kind):
    trl = pytest.importorskip("trl", reason="TRL (a test-only peer: pip install trl)")
    transformers = pytest.importorskip("transformers")
    from datasets import Dataset
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    beta, rows = 0.3, pairs(4)
    _, chosen, rejected, (x, y) = our_batch(work / "reference", rows)
    reference, policy = load_model(work / "reference"), nudged(work / "reference")
    n = (y != -100).sum(-1)
    with torch.no_grad():
        pi = sequence_log_probs(policy(x), y)
        ref = sequence_log_probs(reference(x), y)
        ours = dpo_loss(pi[:4], pi[4:], ref[:4], ref[4:], beta, kind, (n[:4], n[4:]))
    conversations = [  # TRL renders them in the template itself
        {
            "prompt": [{"role": "user", "content": row["prompt"]}],
            "chosen": [{"role": "assistant", "content": row["chosen"]}],
            "rejected": [{"role": "assistant", "content": row["rejected"]}],
        }
        for row in rows
    ]

    hf_policy = transformers.Qwen3ForCausalLM.from_pretrained(work / "reference").eval()
    hf_policy.load_state_dict(_hf_state_dict(policy, hf_policy))
    hf_reference = transformers.Qwen3ForCausalLM.from_pretrained(work / "reference").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = transformers.AutoTokenizer.from_pretrained(work / "reference")
        trainer = trl.DPOTrainer(
            model=hf_policy,
            ref_model=hf_reference,
            args=trl.DPOConfig(
                output_dir=str(tmp_path),
                beta=beta,
                loss_type=[kind],
                report_to=[],
                use_cpu=True,
                bf16=False,  # TRL's default autocasts to bf16; gptkiln's side is fp32
            ),
            train_dataset=Dataset.from_list(conversations),
            processing_class=tokenizer,
        )
    examples = []
    for c, r, theirs in zip(chosen, rejected, trainer.train_dataset, strict=True):
        start = c.trained.index(True)
        assert c.ids[:start] == r.ids[:start]  # one prompt, two answers
        ours_ids = {"prompt_ids": c.ids[:start], "chosen_ids": c.ids[start:],
                    "rejected_ids": r.ids[start:]}  # fmt: skip
        assert ours_ids == {k: list(theirs[k]) for k in ours_ids}  # TRL's own tokens
        examples.append(ours_ids)
    batch = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)(examples)
    with torch.no_grad():
        theirs = trainer.compute_loss(hf_policy, batch)
    assert abs(ours.loss.item() - theirs.item()) < 1e-5, (ours.loss.item(), theirs.item())
    # TRL's logged rewards: beta * (policy - reference) of each answer, summed for ipo too
    logged = next(m for m in trainer._metrics.values() if m.get("rewards/chosen"))  # its mode's
    assert abs(ours.chosen_rewards.mean().item() - logged["rewards/chosen"][-1]) < 1e-5
    assert abs(ours.rejected_rewards.mean().item() - logged["rewards/rejected"][-1]) < 1e-5


def _hf_state_dict(model, hf_model) -> dict:
    """``model``'s weights under transformers' names (gptkiln's export mapping)."""
    from gptkiln.interop import gptkiln_state_dict_to_hf

    sd = gptkiln_state_dict_to_hf(model.state_dict(), model.config)
    return {k: v for k, v in sd.items() if k in hf_model.state_dict()}


# -- training ------------------------------------------------------------------------------------
def quick(ft: FinetuneConfig, out: Path, **settings):
    base = dict(out=str(out), batch_size=4, progress=False, precision="fp32", sample_interval=100)
    return train_config(ft, **{**base, **settings})


def step_zero(ft: FinetuneConfig, out: Path) -> dict:
    """The task's evaluation before any step: the policy is the reference."""
    from gptkiln.finetune.dpo import PreferenceTuning
    from gptkiln.train import Trainer
    from gptkiln.train.optimizer_step import autocast_for

    trainer = Trainer(quick(ft, out, max_steps=1), task=lambda ctx: PreferenceTuning(ctx, ft))
    trainer.close()
    return trainer.task.evaluate(trainer.task.model, autocast_for("cpu", "fp32"))


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_the_loss_is_ln_2_while_the_policy_is_the_reference(work, tmp_path, lora):
    ft = FinetuneConfig(
        base=str(work / "reference"), data=str(work / "pairs.json"), task="dpo", lora_rank=lora
    )
    values = step_zero(ft, tmp_path / "run")
    assert values["val_loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert values["val_reward_margin"] == 0 and values["val_reward_accuracy"] == 0


@pytest.fixture(scope="module")
def dpo_runs(work):
    """Full DPO trained 8 steps at once, and 4 steps then resumed to 8; LoRA DPO 8 steps."""
    data, base = str(work / "pairs.json"), str(work / "reference")
    ft = FinetuneConfig(base=base, data=data, task="dpo", beta=0.5)
    settings = dict(max_steps=8, eval_interval=4, checkpoint_interval=4, eval_train=True, lr=2e-3)
    finetune(ft, quick(ft, work / "dpo", **settings))
    finetune(ft, quick(ft, work / "dpo-resumed", **{**settings, "max_steps": 4}))
    finetune(ft, quick(ft, work / "dpo-resumed", **settings), resume=True)
    lora = FinetuneConfig(base=base, data=data, task="dpo", beta=0.5, lora_rank=4)
    finetune(lora, quick(lora, work / "dpo-lora", **{**settings, "lr": 1e-2}))
    return work / "dpo", work / "dpo-resumed", work / "dpo-lora"


def test_dpo_raises_the_reward_accuracy_on_its_training_pairs(dpo_runs):
    for run in (dpo_runs[0], dpo_runs[2]):
        rows = read_metrics(run / "metrics.csv")
        assert rows[-1]["train_reward_accuracy"] > 0.5, rows[-1]
        assert rows[-1]["train_reward_margin"] > 0 and rows[-1]["train_loss"] < math.log(2)
        header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
        for column in ("val_rewards_chosen", "val_rewards_rejected", "val_reward_margin"):
            assert column in header


def test_a_resumed_dpo_run_ends_where_an_uninterrupted_one_does(dpo_runs):
    whole, resumed, _ = dpo_runs

    def rows(run):
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in read_metrics(run)]

    assert rows(whole / "metrics.csv") == rows(resumed / "metrics.csv")
    x = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        assert torch.equal(load_model(whole)(x), load_model(resumed)(x))


def test_a_lora_dpo_run_keeps_its_base_by_reference_and_chats(dpo_runs, capsys, monkeypatch):
    run = dpo_runs[2]
    assert not (run / "model.safetensors").exists() and (run / "adapter.safetensors").is_file()
    assert load_chat_template(run).source == QWEN3
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("What is 1 plus 1?\n"))
    try:
        code = main(["chat", str(run), "--plain", "--max-new-tokens", "3"])
    except SystemExit as e:
        code = e.code
    assert code in (0, None), capsys.readouterr().err


def test_show_examples_of_pairs_are_the_chosen_and_rejected_rows(work, capsys):
    argv = ["finetune", work / "reference", "--task", "dpo", "--data", work / "pairs.json"]
    code, out, err = cli(*argv, "--show-examples", 2, "--json", capsys=capsys)
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    _, chosen, rejected, _ = our_batch(work / "reference", pairs(2))
    expected = [
        {"answer": label, "ids": e.ids, "trained": e.trained}
        for c, r in zip(chosen, rejected, strict=True)
        for label, e in (("chosen", c), ("rejected", r))
    ]
    assert lines == expected and all(not x["trained"][0] and x["trained"][-1] for x in lines)
    code, out, err = cli(*argv, "--show-examples", 1, capsys=capsys)
    assert code == 0, err
    assert "--- pair 1, chosen" in out and "--- pair 1, rejected" in out
    # the answer runs to the end of what the template renders (TRL's): the newline after too
    assert "It is 0.<|im_end|>\n»" in out and "I do not know, maybe 3?<|im_end|>\n»" in out
    code, out, err = cli(*argv, "--show-examples", 1, "--max-length", 4, capsys=capsys)
    assert (
        "--- pair 1, chosen: dropped, the pair's longer conversation (prompt and answer) is" in out
    )
    assert "tokens, past 4" in out
    assert "--- pair 1, rejected: dropped" in out  # the pair goes whole, as training drops it
    assert "pair 2" not in out and "more pairs dropped, not shown" in out  # N said, the rest not
    assert "trained ---" not in out  # none fits: refused, as training refuses it
    assert_one_line_error(code, err, "no pair fits: the trainer drops every one")
    code, out, err = cli(*argv, "--show-examples", 1, "--max-length", 4, "--json", capsys=capsys)
    assert out == "" and code == 2 and "no pair fits" in err


@pytest.mark.parametrize(
    "records, needle",
    [
        ([{"prompt": "q", "chosen": "a"}], "no chosen and rejected"),
        ([{"prompt": "q", "chosen": "", "rejected": "b"}], '"chosen" is empty'),
        (
            [{"prompt": [{"role": "oracle", "content": "q"}], "chosen": "a", "rejected": "b"}],
            "role",
        ),
        ([{"prompt": 7, "chosen": "a", "rejected": "b"}], '"prompt" is a JSON number'),
        ([{"prompt": None, "chosen": "a", "rejected": "b"}], '"prompt" is null'),
        ([{"chosen": "a", "rejected": "b"}], 'no "prompt" for the text answers'),
        (
            [{"prompt": "q", "chosen": [{"role": "assistant", "content": " "}], "rejected": "b"}],
            "chosen[0] is an assistant's message with no text",
        ),
        (
            [{"prompt": "q", "chosen": {"role": "assistant", "content": "a"}, "rejected": "b"}],
            '"chosen" is a JSON object; give text, or a list of one assistant message',
        ),
        (
            [
                {
                    "chosen": [{"role": "assistant", "content": "a"}],
                    "rejected": [{"role": "assistant", "content": "b"}],
                }
            ],
            "an answer alone, with no prompt before it",
        ),
    ],
)
def test_bad_pairs_are_one_line(work, tmp_path, capsys, records, needle):
    data = tmp_path / "bad.json"
    data.write_text(json.dumps(records), encoding="utf-8")
    argv = [
        "finetune",
        work / "reference",
        "--task",
        "dpo",
        "--data",
        data,
        "--out",
        tmp_path / "o",
    ]
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "o").exists()


def test_pairs_with_one_answer_as_both_are_counted_in_the_data_line(work, tmp_path, capsys):
    rows = pairs(40)
    rows[3]["rejected"] = rows[3]["chosen"]  # no signal: the loss is log 2 whatever the model
    data = tmp_path / "same.json"
    data.write_text(json.dumps(rows), encoding="utf-8")
    ft = FinetuneConfig(base=str(work / "reference"), data=str(data), task="dpo")
    finetune(ft, quick(ft, tmp_path / "run", max_steps=1))
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("dpo data:"))
    assert "1 with one answer as chosen and rejected (no signal)" in line, line


def test_auto_precision_measures_dpo_on_its_pairs(work, tmp_path, monkeypatch, capsys):
    """`--precision auto` times DPO's own step (policy and reference over chosen and rejected
    rows), on an even number of rows so each measured batch holds whole pairs."""
    import gptkiln.train.precision as precision
    from gptkiln.finetune.dpo import PreferenceTuning
    from gptkiln.train import Trainer

    rows = []

    def measure(model, x, y, tokens, loss):
        def counting(forward, x, y):
            rows.append(x.shape[0])
            return loss(forward, x, y)

        return real_measure(model, x, y, tokens, budget_s=0.0, loss=counting)

    monkeypatch.setattr(precision, "cpu_bf16_features", lambda: ["AMX"])
    monkeypatch.setattr(precision, "measure_step_seconds", measure)
    ft = FinetuneConfig(base=str(work / "reference"), data=str(work / "pairs.json"), task="dpo")
    out = tmp_path / "run"
    trainer = Trainer(
        quick(ft, out, max_steps=1, precision="auto"), task=lambda ctx: PreferenceTuning(ctx, ft)
    )
    trainer.close()
    assert rows and all(n >= 2 and n % 2 == 0 for n in rows)
    assert "a training step of this model measured" in capsys.readouterr().out


def test_dpo_and_chat_tuning_start_from_a_chat_run_of_any_tokenizer(tmp_path):
    """A chat-tuned run of a gptkiln tokenizer (gpt2 here) keeps its ChatML template but no
    tokenizer_config.json: a DPO or another chat run from it ends turns with the tokenizer's
    end-of-text, as the first run did (it was refused: "names no eos_token")."""
    from gptkiln.checkpoint import save_model
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT
    from gptkiln.tokenizers import GPT2Tokenizer

    tokenizer = GPT2Tokenizer()
    torch.manual_seed(0)
    config = GPTConfig.from_name("tiny", vocab_size=tokenizer.vocab_size, context_length=64)
    save_model(GPT(config), tmp_path / "base", tokenizer=tokenizer)
    chats = [
        {
            "messages": [
                {"role": "user", "content": p["prompt"]},
                {"role": "assistant", "content": p["chosen"]},
            ]
        }
        for p in pairs(20)
    ]
    (tmp_path / "chats.json").write_text(json.dumps(chats))
    (tmp_path / "pairs.json").write_text(json.dumps(pairs(20)))
    chat = FinetuneConfig(
        base=str(tmp_path / "base"), data=str(tmp_path / "chats.json"), task="chat"
    )
    finetune(chat, quick(chat, tmp_path / "chat", max_steps=1))
    assert not (tmp_path / "chat" / "tokenizer_config.json").exists()
    for task, data in (("dpo", "pairs.json"), ("chat", "chats.json")):
        ft = FinetuneConfig(base=str(tmp_path / "chat"), data=str(tmp_path / data), task=task)
        finetune(ft, quick(ft, tmp_path / f"{task}-again", max_steps=1))
        stored = (tmp_path / f"{task}-again" / "chat_template.jinja").read_text()
        assert stored == (tmp_path / "chat" / "chat_template.jinja").read_text()


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_a_base_with_dropout_trains_dpo_without_it_from_ln_2(tmp_path, lora, capsys):
    """DPO turns the base's dropout off, as TRL's does: a training step's loss starts at ln 2
    exactly (the policy is the reference), and a LoRA run's reference is the same twice."""
    from gptkiln.checkpoint import save_model
    from gptkiln.config import GPTConfig
    from gptkiln.finetune.dpo import PreferenceTuning
    from gptkiln.model import GPT
    from gptkiln.tokenizers import GPT2Tokenizer
    from gptkiln.train import Trainer

    tokenizer = GPT2Tokenizer()
    torch.manual_seed(0)
    config = GPTConfig.from_name(
        "tiny", vocab_size=tokenizer.vocab_size, context_length=64, dropout=0.3
    )
    save_model(GPT(config), tmp_path / "base", tokenizer=tokenizer)
    (tmp_path / "pairs.json").write_text(json.dumps(pairs(20)))
    ft = FinetuneConfig(
        base=str(tmp_path / "base"), data=str(tmp_path / "pairs.json"), task="dpo", lora_rank=lora
    )
    cfg = quick(ft, tmp_path / "run", max_steps=1)
    trainer = Trainer(cfg, task=lambda c: PreferenceTuning(c, ft))
    trainer.close()
    assert "the base's dropout off" in capsys.readouterr().err
    task, (x, y) = trainer.task, trainer.batches.get(0, 0)
    task.model.train()
    torch.manual_seed(1)
    assert task.training_loss(task.model, x, y).item() == pytest.approx(math.log(2), abs=1e-6)
    assert torch.equal(task.reference_log_probs(x, y), task.reference_log_probs(x, y))


def test_pairs_all_without_a_preference_are_one_line(work, tmp_path, capsys):
    same = [{**p, "rejected": p["chosen"]} for p in pairs(20)]
    (tmp_path / "same.json").write_text(json.dumps(same))
    code, _, err = cli(
        "finetune", work / "reference", "--task", "dpo", "--data", tmp_path / "same.json",
        "--out", tmp_path / "r", capsys=capsys,
    )  # fmt: skip
    assert code == 2 and "DPO has nothing to learn" in err and len(err.strip().splitlines()) == 1


def test_a_full_dpo_run_resumes_only_against_the_reference_it_started_with(work, tmp_path):
    """Full DPO's reference is the base, read again on a resume: a base whose weights changed
    since is refused in one line (the run would go on against another reference), as a LoRA
    run's changed base is."""
    import shutil

    from safetensors.torch import load_file, save_file

    base = tmp_path / "base"
    shutil.copytree(work / "reference", base)
    ft = FinetuneConfig(base=str(base), data=str(work / "pairs.json"), task="dpo")
    settings = dict(eval_interval=2, checkpoint_interval=2)
    finetune(ft, quick(ft, tmp_path / "run", max_steps=2, **settings))
    info = json.loads((tmp_path / "run" / "config.json").read_text())["finetune"]
    assert [f["name"] for f in info["reference_weights"]["files"]] == ["model.safetensors"]
    finetune(ft, quick(ft, tmp_path / "run", max_steps=3, **settings), resume=True)  # the same
    weights = load_file(base / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 0.01
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(GptkilnError, match="has changed since the run was trained on it"):
        finetune(ft, quick(ft, tmp_path / "run", max_steps=4, **settings), resume=True)
