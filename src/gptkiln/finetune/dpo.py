"""Preference tuning: Direct Preference Optimization (Rafailov et al. 2023,
https://arxiv.org/abs/2305.18290; the book's chapter 7 bonus, "DPO from scratch").

Each pair is a prompt (a conversation so far) and two answers, ``chosen`` better than
``rejected``. Both are rendered by the model's chat template as chat fine-tuning renders them
(`chat.ConversationEncoder`), and only the answer's tokens count: a batch of B pairs is one
(2B, T) batch, the chosen rows first. With ``pi`` the model's summed log-probability of an
answer and ``ref`` the reference's (the starting model, frozen; with LoRA, the same model with
its adapters off, so no second copy is held), the loss is::

    logits = (pi(chosen) - pi(rejected)) - (ref(chosen) - ref(rejected))
    sigmoid:  -log sigmoid(beta * logits)          (the paper's; ln 2 while pi = ref)
    ipo:      (logits - 1 / (2 beta))^2            (Azar et al. 2023, on mean log-probabilities,
                                                    as TRL computes it)

and the rewards are ``beta * (pi - ref)`` of each answer (summed log-probabilities, for either
loss); accuracy is the share of pairs whose chosen reward is the larger. These are TRL's
``DPOTrainer`` definitions (its ``sigmoid`` and ``ipo`` loss types, no label smoothing), and an
answer is TRL's: every token the template renders after the prompt (with its generation
prompt), which the tests check against TRL's own dataset and loss.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from gptkiln.config import FinetuneConfig, SampleConfig
from gptkiln.errors import GptkilnError
from gptkiln.finetune.chat import (
    ConversationEncoder,
    Example,
    collate_examples,
    conversation_template,
    example_limit,
    save_chat_template,
)
from gptkiln.finetune.task import IGNORE_INDEX, FineTuning
from gptkiln.train.task import RunContext

METRICS = ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")


def sequence_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its targets, (B,), from logits (B, T, V) and targets
    (B, T) whose -100 positions do not count (ipo's mean divides by the lengths, in
    `dpo_loss`)."""
    mask = targets != IGNORE_INDEX
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T)
    return (picked * mask).sum(-1)


@dataclass
class DPOStats:
    """One batch's loss (mean over pairs) and each pair's rewards, (B,) each."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    kind: str = "sigmoid",
    lengths: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> DPOStats:
    """The DPO loss of pairs from their summed log-probabilities (B,) under the policy and the
    reference (see the module's docstring); ``lengths``, each answer's learnt tokens (B,) for
    the chosen and the rejected, are what ``ipo`` averages over."""
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if kind == "sigmoid":
        losses = -F.logsigmoid(beta * logits)
    elif kind == "ipo":  # on each answer's mean log-probability
        if lengths is None:
            raise GptkilnError("the ipo loss averages over each answer's tokens: give lengths")
        n_chosen, n_rejected = lengths
        logits = (policy_chosen - ref_chosen) / n_chosen - (policy_rejected - ref_rejected) / (
            n_rejected
        )
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        raise GptkilnError(f"dpo loss must be sigmoid or ipo, got {kind!r}")
    chosen = beta * (policy_chosen - ref_chosen).detach()  # summed, whatever the loss
    rejected = beta * (policy_rejected - ref_rejected).detach()
    return DPOStats(losses.mean(), chosen, rejected)


def answer_only(example: Example) -> Example:
    """``example`` learning its last assistant turn only, to the end of what the template
    renders (Qwen3's and ChatML's ``<|im_end|>\n``: its newline too). This is TRL's answer: the
    whole conversation's tokens after the prompt's, the prompt rendered with the generation
    prompt."""
    trained = list(example.trained)
    start = max(i for i, t in enumerate(trained) if t) + 1
    while start > 0 and trained[start - 1]:
        start -= 1
    return Example(example.ids, [start <= i for i in range(len(example.ids))])


def encode_pair(encoder: ConversationEncoder, pair) -> tuple[Example, Example]:
    """(chosen, rejected) of a preference pair: its prompt and each answer rendered as one
    conversation, only the answer learnt (`answer_only`)."""
    return tuple(
        answer_only(encoder.encode([*pair.prompt, {"role": "assistant", "content": answer}]))
        for answer in (pair.chosen, pair.rejected)
    )


def disable_dropout(model: torch.nn.Module) -> bool:
    """Turn ``model``'s dropout off (its ``nn.Dropout`` layers and attention's rate), as TRL's
    DPO does: with it on, the policy's log-probabilities are noisy against the reference's, so
    the loss no longer starts at ln 2, and a LoRA run's reference (the same model, adapters
    off) would draw new noise at each use. Whether any was on."""
    was_on = False
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            was_on |= module.p > 0
            module.p = 0.0
        elif isinstance(getattr(module, "dropout", None), float):  # attention's rate
            was_on |= module.dropout > 0
            module.dropout = 0.0
    return was_on


def _check_reference(run_dir: Path, base: Path, ref: dict, files: list[Path]) -> None:
    """Full DPO's resume: the base's weights ``files`` (where it finds them now) are those of
    ``ref``'s records, one for one: the same size and time, or else the same SHA-256."""
    from gptkiln.loading.base import matches_record

    records = ref.get("files") or []
    same = len(records) == len(files) and all(map(matches_record, files, records))
    if not same:
        raise GptkilnError(
            f"{run_dir}'s reference, the base {base}, has changed since the run was trained on "
            "it (its weights files or their checksums differ); restore that base, or start the "
            "DPO run again on this one"
        )


class PreferenceTuning(FineTuning):
    """`Task` of DPO; the split is instruct's (train, test, validation)."""

    columns = tuple(f"{split}_{m}" for split in ("train", "val") for m in METRICS)
    plots = ("loss",)

    def __init__(self, ctx: RunContext, ft: FinetuneConfig):
        from gptkiln.finetune.data import (
            check_splits,
            encoded_records,
            read_preferences,
            split_sizes,
        )
        from gptkiln.loading import read_config

        super().__init__(ctx, ft)
        base = Path(ft.base)
        pairs = read_preferences(ft.data)
        template = conversation_template(ft, base, read_config(base), self.tokenizer)
        self.encoder = ConversationEncoder(template, self.tokenizer)
        self.tokenizer = self.encoder.with_turn_end(self.tokenizer, ctx.run_dir)
        self.pad_id = self.tokenizer.eot_id if self.tokenizer.eot_id is not None else 0
        encode = functools.partial(encode_pair, self.encoder)
        rows = encoded_records(ft.data, "preference pairs", pairs, encode)
        self.build_model(row.ids for pair in rows for row in pair)
        dropout = disable_dropout(self.model)  # before the reference copies the model
        limit = example_limit(ft, self.model_config.context_length)
        encoded, self.dropped = [], []  # the split is of the pairs kept
        for number, (pair, (chosen, rejected)) in enumerate(zip(pairs, rows, strict=True)):
            if max(len(chosen.ids), len(rejected.ids)) <= limit:
                encoded.append((pair, chosen, rejected))
            else:
                self.dropped.append(number)
        if not encoded:
            raise GptkilnError(
                f"--data {ft.data}: no pair fits in {limit - 1} tokens; raise --max-length (at "
                "most the context) or give shorter pairs"
            )
        self.pairs = [p for p, _, _ in encoded]
        self.chosen = [c for _, c, _ in encoded]
        self.rejected = [r for _, _, r in encoded]
        if all(p.chosen == p.rejected for p in self.pairs):
            raise GptkilnError(
                f"--data {ft.data}: every pair has one answer as both chosen and rejected, so "
                "DPO has nothing to learn; give each prompt a preferred and a worse answer"
            )
        sizes = split_sizes(len(encoded), ft.val_fraction, ft.test_fraction)
        check_splits(ft.data, len(encoded), sizes, ft.val_fraction)
        n_train, n_val, n_test = sizes
        self.split = {"train": n_train, "val": n_val, "test": n_test}
        self.reference_weights: dict | None = None  # full DPO's reference, its files' records
        self.reference = None if self.tuner is not None else self._frozen_copy()
        self.set_example_batches(n_train, n_test, len(self.pairs))
        if ctx.world.is_main:
            same = sum(p.chosen == p.rejected for p in self.pairs)  # the loss cannot move them
            alike = f", {same:,} with one answer as chosen and rejected (no signal)" if same else ""
            reference = "the base, adapters off" if self.tuner is not None else "a frozen copy"
            off = "; the base's dropout off, as TRL's DPO turns it off" if dropout else ""
            print(
                f"dpo data: {len(pairs):,} pairs, {len(pairs) - len(encoded):,} dropped (longer "
                f"than {limit - 1} tokens){alike}; beta {ft.beta:g}, {ft.dpo_loss} loss, "
                f"reference: {reference}{off}",
                file=sys.stderr,
                flush=True,
            )
        self.say_what_trains()

    def _frozen_copy(self):
        """The reference of full DPO: the starting model, frozen; on a resume, the base again,
        checked to be the one the run started from: its weights files where the base finds
        them now (a LoRA base's base may have moved) against the records kept as
        ``reference_weights`` (the same size and time, or else the same SHA-256)."""
        from gptkiln.checkpoint import ADAPTER_FILE
        from gptkiln.loading import describe_weights, load_model, read_config
        from gptkiln.loading.base import base_reference

        base = Path(self.ft.base)
        adapters = base / ADAPTER_FILE  # a LoRA base's adapters, merged into its weights
        files = describe_weights(base)[2] + ([adapters] if adapters.is_file() else [])
        then = None
        if self.ctx.resume:
            then = (read_config(self.run_dir).get("finetune") or {}).get("reference_weights")
            if then is not None:  # (a run from before it was kept: unchecked)
                _check_reference(self.run_dir, base, then, files)
            model = load_model(base)
        else:
            model = copy.deepcopy(self.model)
        self.reference_weights = then or base_reference(base, files, self.run_dir)
        return model.to(self.ctx.device).eval().requires_grad_(False)

    def width(self, ids: Sequence[int]) -> int:
        """Two rows a pair (chosen, rejected), as wide as the longest answer."""
        return 2 * max(len(e.ids) - 1 for i in ids for e in (self.chosen[i], self.rejected[i]))

    def collate(self, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), (2B, T): the chosen answers' rows, then the rejected ones'."""
        examples = [self.chosen[i] for i in ids] + [self.rejected[i] for i in ids]
        return collate_examples(examples, self.pad_id)

    # -- the loss ------------------------------------------------------------------------------
    def reference_log_probs(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.reference is not None:
                return sequence_log_probs(self.reference(x), y)
            self.tuner.disable_adapter_layers()
            try:
                return sequence_log_probs(self.model(x), y)
            finally:
                self.tuner.enable_adapter_layers()

    def stats(self, forward, x: torch.Tensor, y: torch.Tensor) -> DPOStats:
        """The DPO loss and rewards of one (2B, T) batch, the policy run by ``forward``."""
        half = x.size(0) // 2
        policy = sequence_log_probs(forward(x), y)
        ref = self.reference_log_probs(x, y)
        n = (y != IGNORE_INDEX).sum(-1).clamp(min=1)  # each answer's learnt tokens
        return dpo_loss(
            policy[:half], policy[half:], ref[:half], ref[half:], self.ft.beta, self.ft.dpo_loss,
            (n[:half], n[half:]),
        )  # fmt: skip

    def training_loss(self, forward, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.stats(forward, x, y).loss

    def learnt(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss is a mean over pairs: a (2B, T) batch holds B."""
        return torch.tensor(x.size(0) // 2, device=x.device)

    # -- what the loop asks --------------------------------------------------------------------
    def evaluate(self, model: torch.nn.Module, autocast) -> dict[str, float | None]:
        """The loss, mean rewards, margin and accuracy of the fixed validation batches, and of
        the training batches unless --no-eval-train (None then)."""
        values: dict[str, float | None] = dict.fromkeys(self.columns)
        was_training = model.training
        model.eval()
        for split, batches in (("train", self.train_eval_batches), ("val", self.val_batches)):
            if batches:
                values.update(self._measure(model, batches, autocast, split))
        model.train(was_training)
        return values

    def _measure(self, model, batches, autocast, split: str) -> dict[str, float]:
        losses, chosen, rejected = [], [], []
        for x, y in batches:
            x, y = x.to(self.ctx.device), y.to(self.ctx.device)
            with torch.no_grad(), autocast:
                stats = self.stats(model, x, y)
            losses.append(stats.loss.float().item() * len(stats.chosen_rewards))
            chosen.append(stats.chosen_rewards.float().cpu())
            rejected.append(stats.rejected_rewards.float().cpu())
        c, r = torch.cat(chosen), torch.cat(rejected)
        return {
            f"{split}_loss": sum(losses) / len(c),
            f"{split}_rewards_chosen": c.mean().item(),
            f"{split}_rewards_rejected": r.mean().item(),
            f"{split}_reward_margin": (c - r).mean().item(),
            f"{split}_reward_accuracy": (c > r).float().mean().item(),
        }

    def summary(self, row: dict) -> str:
        train = row.get("train_reward_accuracy")
        train_text = "" if train is None else f" (train {100 * train:.1f}%)"
        return (
            f"train {row['train_loss']:.4f} | val {row['val_loss']:.4f} | rewards chosen "
            f"{row['val_rewards_chosen']:+.3f} rejected {row['val_rewards_rejected']:+.3f} "
            f"margin {row['val_reward_margin']:+.3f} | accuracy "
            f"{100 * row['val_reward_accuracy']:.1f}%{train_text}"
        )

    def sample(self, model, use_cache: bool) -> str:
        """The greedy answer to the first validation prompt (held out)."""
        from gptkiln.api import stream_from_model

        prompt = self.pairs[self.val_ids[0]].prompt
        text = self.encoder.prompt(prompt)
        cfg = SampleConfig(max_new_tokens=self.cfg.sample_tokens, temperature=0)
        templated = self.encoder.chat
        answer = "".join(stream_from_model(model, self.tokenizer, text, cfg, templated=templated))
        return f"{prompt[-1]['content']}\n-> {answer}"

    def task_info(self) -> dict:
        from gptkiln.finetune.templates import PromptTemplate

        t = self.encoder.template
        template = t.to_dict() if isinstance(t, PromptTemplate) else None
        return {
            "template": template,
            "pad_id": self.pad_id,
            "dropped": self.dropped,
            "reference_weights": self.reference_weights,
        }

    def save(self, model_sd: dict, state: dict, train_config: dict) -> None:
        save_chat_template(self.run_dir, self.encoder.template)
        super().save(model_sd, state, train_config)
