"""CUDA paths: bf16 autocast training, torch.compile, cached generation on the GPU.

Skipped without a GPU (CI has none); run them on a machine with one: ``pytest -m gpu``.
"""

import pytest
import torch

from gptkiln.config import GPTConfig, TrainConfig
from gptkiln.model import GPT
from gptkiln.sampling import generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_bf16_autocast_training_step_on_cuda():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("baby", vocab_size=512)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    idx = torch.randint(0, 512, (8, 64), device="cuda")
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(idx, idx.roll(-1, dims=1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


def test_compiled_model_matches_eager_on_cuda():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=256)).cuda().eval()
    compiled = torch.compile(model)
    idx = torch.randint(0, 256, (2, 32), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(compiled(idx), model(idx), atol=1e-4, rtol=1e-4)


def test_kv_cache_generation_on_cuda_equals_no_cache():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=256, context_length=32)).cuda().eval()
    prompt = torch.randint(0, 256, (5,)).tolist()
    cached = generate(model, prompt, max_new_tokens=30, temperature=0)
    assert cached == generate(model, prompt, max_new_tokens=30, temperature=0, use_cache=False)


def test_trainer_picks_cuda_and_trains(tmp_path):
    from gptkiln.devices import resolve_device
    from gptkiln.train import train

    assert resolve_device("auto") == "cuda"
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question. " * 200)
    result = train(
        TrainConfig(
            data=str(text),
            out=str(tmp_path / "run"),
            model="tiny",
            tokenizer="char",
            context_length=32,
            batch_size=8,
            max_steps=30,
            eval_interval=30,
            sample_interval=30,
            progress=False,
        )
    )
    assert result.val_loss < 3.0


def test_int8_model_on_cuda_in_bf16_generates_as_on_the_cpu(tmp_path):
    from gptkiln.checkpoint import save_model
    from gptkiln.loading import load_model
    from gptkiln.quantize import quantize_model

    torch.manual_seed(0)
    model = quantize_model(GPT(GPTConfig.from_name("tiny", vocab_size=256)).eval())
    save_model(model, tmp_path / "q")
    gpu = load_model(tmp_path / "q", device="cuda", dtype=torch.bfloat16)
    assert gpu.h[0].attn.c_attn.weight.dtype == torch.int8  # int8 stays int8 under dtype=bf16
    assert gpu.h[0].attn.c_attn.weight.device.type == "cuda"
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        cpu_logits = model(idx)
        gpu_logits = gpu(idx.cuda()).float().cpu()
    torch.testing.assert_close(gpu_logits, cpu_logits, atol=0.05, rtol=0.05)  # bf16 activations
    prompt = idx[0, :5].tolist()
    cached = generate(gpu, prompt, max_new_tokens=20, temperature=0)
    assert cached == generate(gpu, prompt, max_new_tokens=20, temperature=0, use_cache=False)
