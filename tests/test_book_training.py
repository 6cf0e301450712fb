"""The book's chapter 5 on its own text: gptkiln's model and loader in the book's own training
loop (`llms_from_scratch.ch05`'s loss and evaluation) print the book's first losses, 9.781 and
9.933, to the digit: the weights drawn under seed 123, the dropout masks, the gradients and
AdamW's step are the book's. (``gptkiln train --config book-verdict`` trains the same model
with the same settings through gptkiln's trainer, whose data order and evaluation batches are
its own: see the recipe's notes.) Needs ``../shared/data/the-verdict.txt`` and the book's
package; one step of the 124M model, so marked slow."""

from __future__ import annotations

import pytest
import torch

from gptkiln import GPT, GPTConfig, load_tokenizer
from gptkiln.data.windows import create_dataloader


@pytest.mark.slow
def test_the_books_first_training_step_prints_its_losses(verdict_text):
    ch05 = pytest.importorskip("llms_from_scratch.ch05", reason="the book's package")
    gpt2 = load_tokenizer("gpt2")
    split = int(0.90 * len(verdict_text))  # the book's train_ratio
    loader = dict(batch_size=2, max_length=256, stride=256, seed=None, tokenizer=gpt2)
    torch.manual_seed(123)  # the book's, before its loaders
    train_loader = create_dataloader(verdict_text[:split], shuffle=True, drop_last=True, **loader)
    val_loader = create_dataloader(verdict_text[split:], shuffle=False, drop_last=False, **loader)
    assert (len(train_loader), len(val_loader)) == (9, 1)
    torch.manual_seed(123)  # the book's, before its model
    model = GPT(GPTConfig.from_name("book-124m", context_length=256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0004, weight_decay=0.1)
    model.train()
    for x, y in train_loader:  # train_model_simple's first step, then its first evaluation
        optimizer.zero_grad()
        ch05.calc_loss_batch(x, y, model, "cpu").backward()
        optimizer.step()
        train_loss, val_loss = ch05.evaluate_model(model, train_loader, val_loader, "cpu", 5)
        break
    assert (round(train_loss, 3), round(val_loss, 3)) == (9.781, 9.933)  # "Step 000000"
