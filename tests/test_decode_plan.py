"""A decode plan applies its speed from outside: the model holds no slot for it, the plan swaps
its layers' classes (the same objects, parameters and state dict) and swaps them back when it
is released or the precision changes, and nothing of it touches a forward with autograd."""

import copy
import pickle

import pytest
import torch

from gptkiln.config import GPTConfig
from gptkiln.cpu import planned, prepare_for_decoding
from gptkiln.errors import GptkilnError
from gptkiln.model import GPT, MLP, Attention, Linear


def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("tiny", vocab_size=61, context_length=32)).eval()


def _state(model: GPT) -> dict:
    """Every module's class and attribute names: what a plan may change and must give back."""
    return {name: (type(m), sorted(vars(m))) for name, m in model.named_modules()}


def test_a_plain_model_holds_no_slot_for_the_backend():
    model = tiny()
    for module in model.modules():
        for slot in ("few_row_kernels", "decode_attention", "gelu_in_place", "decode_blocks"):
            assert not hasattr(module, slot), (type(module).__name__, slot)
    assert not hasattr(model, "decode_plan")


def test_a_plan_swaps_classes_in_place_and_release_gives_the_model_back():
    model = tiny()
    before, keys = _state(model), list(model.state_dict())
    params = {name: p for name, p in model.named_parameters()}
    idx = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        reference = model(idx)
    plan = prepare_for_decoding(model, 1, precision="fp32")
    assert model.decode_plan is plan and isinstance(model, GPT)
    assert all(isinstance(m, planned.PlannedProduct) for m in model.modules() if type(m) is Linear)
    assert isinstance(model.h[0].attn.c_attn, planned.PlannedProduct)  # a subclass of Linear
    assert list(model.state_dict()) == keys  # the same names, the same tensors
    assert all(p is params[name] for name, p in model.named_parameters())
    assert model.lm_head.weight is model.wte.weight  # still tied
    with torch.no_grad():
        torch.testing.assert_close(model(idx), reference, atol=1e-5, rtol=1e-5)
    again = pickle.loads(pickle.dumps(model))  # another process gets the model, not the plan
    assert _state(again) == before
    plan.release()
    assert _state(model) == before and not hasattr(model, "decode_plan")


def test_another_precision_releases_the_plan_before_it():
    model = tiny()
    first = prepare_for_decoding(model, 1, precision="bf16")
    assert prepare_for_decoding(model, 2, precision="bf16") is first  # the same plan, more rows
    assert set(first.kernels) == {1, 2}
    second = prepare_for_decoding(model, 1, precision="fp32")
    assert second is not first and model.decode_plan is second and not first.kernels
    bf16 = {s.kernel for s in planned_specs() if s.precision == "bf16"}
    used = {k for m in model.modules() for k in planned.few_row_kernels(m).values()}
    assert used and not used & bf16


def planned_specs():
    from gptkiln.cpu import specs

    return specs.SPECS


def test_a_plan_never_touches_a_forward_with_autograd_or_a_training_step():
    """Every layer planned, each product given a kernel that would be wrong for the rows of
    a training batch: the forward, the gradients and an optimizer step are the plain model's."""
    plain = tiny().train()
    model = copy.deepcopy(plain)
    prepare_for_decoding(model, 1, precision="fp32")
    called = []

    def wrong(x, *operands):
        called.append(1)
        return torch.zeros(*x.shape[:-1], operands[0].size(0))

    x, y = torch.randint(0, 61, (2, 3)), torch.randint(0, 61, (2, 3))
    for m in model.modules():
        if planned.is_product(m):
            planned.give_kernel(m, 6, wrong)  # 2 x 3 rows: the batch's
    assert any(isinstance(m, planned.PlannedGelu) for m in model.modules() if isinstance(m, MLP))
    assert isinstance(model, planned.PlannedModel)
    assert all(
        isinstance(m, planned.PlannedAttention) for m in model.modules() if isinstance(m, Attention)
    )
    steps = []
    for m in (plain, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        logits, loss = m(x, y)
        loss.backward()
        grads = [p.grad.clone() for p in m.parameters()]
        opt.step()
        steps.append((logits.detach(), grads, [p.detach().clone() for p in m.parameters()]))
    assert not called
    (a, ga, pa), (b, gb, pb) = steps
    assert torch.equal(a, b)
    assert all(torch.equal(g, h) for g, h in zip(ga, gb))
    assert all(torch.equal(p, q) for p, q in zip(pa, pb))
    with torch.no_grad():  # without autograd the plan does run: the kernel above is taken
        model.eval()(x)
    assert called
    called.clear()
    compiled = torch.compile(model.train(), backend="eager")  # traced with autograd: the layers'
    _, loss = compiled(x, y)
    _, expected = plain(x, y)
    torch.testing.assert_close(loss, expected)
    assert not called


def test_int8_weights_beside_a_float_precision_say_which_flag_to_drop():
    """``--quantize int8 --precision bf16``: one line naming what to drop for either wish (not
    the flag already given)."""
    from gptkiln.cpu.plan import loading_quantize

    with pytest.raises(GptkilnError) as e:
        loading_quantize("int8", "bf16")
    said = str(e.value)
    assert "drop --quantize to decode at bf16" in said
    assert "drop --precision bf16 to decode at int8" in said
    assert loading_quantize("int8", None) == loading_quantize(None, "int8") == "int8"


def test_the_decode_quality_bench_puts_each_layer_on_the_kernel_it_names():
    """bench/decode_quality.py scores a model with every product on one kernel: each layer
    planned with it (`give_kernel`), so a decode step runs it; an attribute the layer's own
    forward never reads would score the layer's own product under the kernel's name."""
    import importlib.util
    from pathlib import Path

    from gptkiln.config import GPTConfig
    from gptkiln.cpu.planned import PlannedProduct
    from gptkiln.model import GPT, Linear

    path = Path(__file__).parent.parent / "bench" / "decode_quality.py"
    spec = importlib.util.spec_from_file_location("decode_quality", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = bench.with_float_kernel(GPT(GPTConfig.from_name("tiny", vocab_size=64)), "linear")
    kernel = bench.kernel_of("linear", "float32")
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(isinstance(m, PlannedProduct) for m in layers)
    assert all(m.few_row_kernels[1] is kernel for m in layers)
