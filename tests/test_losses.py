"""The blockwise cross-entropy (`gptkiln.losses`): torch's loss and gradient, in one pass."""

import pytest
import torch
import torch.nn.functional as F

from gptkiln import losses
from gptkiln.losses import cross_entropy


@pytest.mark.parametrize("scale", [1.0, 2.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_and_gradient_are_torchs_across_blocks_and_ignored_targets(
    monkeypatch, dtype, scale
):
    monkeypatch.setattr(losses, "_BLOCK_ELEMENTS", 3 * 50)  # blocks of 3 rows, the last of 1
    g = torch.Generator().manual_seed(0)
    base = torch.randn(10, 50, generator=g) * 3
    targets = torch.randint(0, 50, (10,), generator=g)
    targets[[2, 7]] = -100
    ours = base.to(dtype).requires_grad_()
    theirs = base.to(dtype).requires_grad_()
    loss = cross_entropy(ours, targets)
    expected = F.cross_entropy(theirs.float(), targets, ignore_index=-100)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    (scale * loss).backward()  # the gradient scales with the loss's
    (scale * expected).backward()
    assert ours.grad.dtype == dtype
    atol = 1e-8 if dtype == torch.float32 else 2e-4
    torch.testing.assert_close(ours.grad.float(), theirs.grad.float(), rtol=1e-2, atol=atol)
    assert ours.grad[[2, 7]].abs().sum() == 0  # ignored rows: no gradient


def test_no_gradient_is_made_where_none_is_wanted_and_no_target_gives_nan():
    logits = torch.randn(4, 8)
    with torch.no_grad():
        assert cross_entropy(logits, torch.tensor([1, 2, 3, -100])).item() == pytest.approx(
            F.cross_entropy(logits, torch.tensor([1, 2, 3, -100])).item(), rel=1e-6
        )
    assert torch.isnan(cross_entropy(logits, torch.full((4,), -100)))


def test_the_model_trains_on_it():
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT

    calls = []
    real = losses._BlockwiseCrossEntropy.forward

    def counted(ctx, *args):
        calls.append(ctx.needs_input_grad[0])
        return real(ctx, *args)

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("qwen3-baby", vocab_size=40, context_length=16))
    x = torch.randint(0, 40, (2, 16))
    try:
        losses._BlockwiseCrossEntropy.forward = staticmethod(counted)
        logits, loss = model(x, x.roll(-1, 1))
    finally:
        losses._BlockwiseCrossEntropy.forward = staticmethod(real)
    assert calls == [True]
    expected = F.cross_entropy(logits.flatten(0, 1).float(), x.roll(-1, 1).flatten())
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
