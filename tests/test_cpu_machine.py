"""What the machine gives a decode. Its thread count (`gptkiln.cpu.threads.DecodeThreads`): full
while the machine runs every thread, fewer while it does not and fewer are faster, back when
more are faster again, and never a change a person could read in the numbers. Its pages
(`gptkiln.cpu.memory`): a long decode's weights on 2 MB pages, the same values."""

import pytest
import torch
from test_native import _small_model, build, needs_blocks_library  # noqa: F401 (a fixture)

from gptkiln.cpu import blocks, planned, products
from gptkiln.cpu import threads as T
from gptkiln.cpu.threads import FIRST_RETRY, WINDOW, DecodeThreads


class Machine:
    """A fake machine: a step at ``n`` threads takes ``step_s[n]`` seconds of wall time and, of
    the CPU, ``share[n]`` of n × wall (1.0: every thread ran; 0.5: half of them waited)."""

    def __init__(self, step_s, share):
        self.step_s, self.share = dict(step_s), dict(share)
        self.wall = self.cpu = 0.0
        self.count = 2
        self.applied: list[int] = []

    def apply(self, n):
        self.count = n
        self.applied.append(n)

    def governor(self, full=2, **kw):
        return DecodeThreads(
            full, clock=lambda: self.wall, cpu_clock=lambda: self.cpu, apply=self.apply,
            get=lambda: self.count, adapt=True, **kw,
        )  # fmt: skip

    def steps(self, gov, n, rows=1):
        counts = []
        for _ in range(n):
            gov.begin_step(rows)
            counts.append(self.count)
            wall = self.step_s[self.count]
            self.wall += wall
            self.cpu += self.share[self.count] * self.count * wall
            gov.end_step()
        return counts


def test_a_machine_that_runs_every_thread_keeps_them_all():
    m = Machine({2: 0.010, 1: 0.016}, {2: 0.97, 1: 1.0})
    gov = m.governor()
    assert m.steps(gov, 300) == [2] * 300
    assert gov.changes == [] and m.applied == []  # nothing tried: no step ran at 1 thread


def test_threads_the_machine_does_not_run_give_way_to_fewer():
    # the other core busy: a 2-thread step waits at every barrier (10x slower), 1 thread does not
    m = Machine({2: 0.110, 1: 0.016}, {2: 0.45, 1: 1.0})
    gov = m.governor()
    counts = m.steps(gov, 40)
    first_one = counts.index(1)
    assert first_one == 1 + WINDOW  # one warm-up step, one window to see it
    assert counts[first_one : first_one + FIRST_RETRY] == [1] * FIRST_RETRY
    assert gov.changes == [(1 + 2 * WINDOW, 1)]  # kept after the trial's window


def test_more_threads_are_tried_again_and_a_losing_trial_ends_at_its_first_step():
    m = Machine({2: 0.110, 1: 0.016}, {2: 0.45, 1: 1.0})
    gov = m.governor()
    counts = m.steps(gov, 400)
    twos = [i for i, c in enumerate(counts) if c == 2]
    tries = [i for i in twos if i > 1 + 2 * WINDOW]  # after the first window's and the trial's
    assert len(tries) >= 3
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert all(b > a for a, b in zip(gaps, gaps[1:]))  # each wait longer than the last
    assert gaps[0] >= FIRST_RETRY
    assert all(counts[i + 1] == 1 for i in tries[:-1])  # each try was one step


def test_the_full_count_comes_back_when_the_machine_is_free_again():
    m = Machine({2: 0.110, 1: 0.016}, {2: 0.45, 1: 1.0})
    gov = m.governor()
    m.steps(gov, 20)
    assert gov.count == 1
    m.step_s[2], m.share[2] = 0.010, 0.97  # the neighbour is gone
    counts = m.steps(gov, 2 * FIRST_RETRY + 10)
    assert counts[-5:] == [2] * 5
    assert gov.changes[-1][1] == 2


def test_fewer_threads_that_are_not_faster_are_not_kept():
    # a busy share that looks like waiting (a machine whose CPU time reads low) but one thread
    # is slower: the trial loses and the count stays; the next trial waits
    m = Machine({2: 0.010, 1: 0.030}, {2: 0.5, 1: 1.0})
    gov = m.governor()
    counts = m.steps(gov, 60)
    assert gov.changes == []
    ones = [i for i, c in enumerate(counts) if c == 1]
    assert ones[0] == 1 + WINDOW  # tried after the first window
    assert all(counts[i + 1] == 2 for i in ones)  # 3x slower at once: each trial one step
    assert len(ones) <= 2  # not a trial every window: the next waits (32 steps, then 64)


def test_a_new_batch_size_starts_a_new_window():
    m = Machine({2: 0.110, 1: 0.016}, {2: 0.45, 1: 1.0})
    gov = m.governor()
    counts = []
    for i in range(12):  # the batch size moves every other step: no window fills
        counts += m.steps(gov, 1, rows=1 + (i // 2) % 2)
    assert counts == [2] * 12


@pytest.mark.parametrize("adapt", ["0", None])
def test_adapting_can_be_turned_off(monkeypatch, adapt):
    if adapt is None:
        monkeypatch.delenv(T.ENV, raising=False)
    else:
        monkeypatch.setenv(T.ENV, adapt)
    gov = DecodeThreads(2)
    assert gov.adapt is (adapt is None)


def test_a_prefill_and_the_plan_s_release_run_the_full_count():
    m = Machine({2: 0.110, 1: 0.016}, {2: 0.45, 1: 1.0})
    gov = m.governor()
    m.steps(gov, 20)
    assert m.count == 1
    gov.other_forward()
    assert m.count == 2
    m.steps(gov, 1)
    assert m.count == 1  # the next decode step is back at its own count
    gov.release()
    assert m.count == 2


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


# ---- the model's decode steps: the same numbers at any count --------------------------------

LOOPS = {
    "fp32": products.few_rows_linear,
    "bf16": products.bf16_rows_linear,
    "int8": products.int8_rows_linear,
    "q8": products.q8_rows_linear,
}


def _decode_logits(model, prompts, steps, threads):
    """Prefill ``prompts`` (left-padded) on 2 threads, then ``steps`` greedy decode steps on
    ``threads``: the logits of every step (steps, B, V)."""
    from gptkiln.sampling import left_pad

    idx, pad = left_pad(prompts, 0, "cpu")
    model.setup_cache(idx.size(0), 40, pad)
    out = []
    with torch.no_grad():
        torch.set_num_threads(2)
        logits = model(idx, start_pos=0, last_only=True)[:, -1]
        torch.set_num_threads(threads)
        pos = idx.size(1)
        for _ in range(steps):
            logits = model(logits.argmax(-1)[:, None], start_pos=pos, last_only=True)[:, -1]
            out.append(logits)
            pos += 1
    return torch.stack(out)


@needs_blocks_library
@pytest.mark.parametrize(
    "name, kind", [("baby", "fp32"), ("baby", "q8")] + [("qwen3-baby", k) for k in sorted(LOOPS)]
)
@pytest.mark.usefixtures("two_threads", "build")
def test_a_decode_step_is_the_same_bit_for_bit_at_any_thread_count(name, kind):
    # what lets DecodeThreads move the count: each output of a decode step is summed by one
    # thread in one order, so the count changes the speed and nothing a person could read
    got = []
    for threads in (1, 2):
        model = _small_model(kind in ("int8", "q8"), name=name, n_embd=128)
        for layer in [m for m in model.modules() if planned.is_product(m)]:
            planned.give_kernel(layer, 3, LOOPS[kind])
        planned.use_compiled_loops(model)
        blocks.use_native_blocks(model, 3)
        got.append(_decode_logits(model, [[5, 6, 7], [1, 2], [9]], 6, threads))
    assert torch.equal(got[0], got[1])


@pytest.mark.usefixtures("two_threads")
def test_generation_moves_to_fewer_threads_and_its_tokens_stay():
    # a decode through the plan, on a machine (fake clocks) where 2 threads wait at every
    # barrier: the steps move to 1 thread, the prefill of the next prompt runs on 2, and the
    # tokens are those of a decode held at 2 threads
    from gptkiln.cpu import prepare_for_decoding
    from gptkiln.sampling import SampleConfig, generate_stream

    seen = []  # (new tokens of a forward, its thread count)

    def generate(governor):
        model = _small_model(name="qwen3-baby")
        tokens = []  # the forward's new tokens (the embedding), then its count (the head)
        model.wte.register_forward_pre_hook(lambda m, args: tokens.append(args[0].size(1)))
        model.lm_head.register_forward_pre_hook(
            lambda m, args: seen.append((tokens[-1], torch.get_num_threads()))
        )

        def prepare(model, rows, steps):
            plan = prepare_for_decoding(model, rows, steps, precision="fp32")
            plan.threads = governor
            return plan

        cfg = SampleConfig(max_new_tokens=30, temperature=0.0)
        runs = [torch.cat(list(generate_stream(model, [p], cfg, prepare=prepare))) for p in
                ([5, 6, 7], [8, 9, 10, 11])]  # fmt: skip
        return runs, model

    held, _ = generate(DecodeThreads(2, adapt=False))
    seen.clear()
    wall = [0.0]

    def clock():  # a 2-thread step 110 ms, a 1-thread one 16 ms (half of each per reading)
        wall[0] += {2: 0.055, 1: 0.008}[torch.get_num_threads()]
        return wall[0]

    governor = DecodeThreads(2, clock=clock, cpu_clock=lambda: 0.45 * wall[0], adapt=True)
    moved, model = generate(governor)
    assert [t.tolist() for t in moved] == [t.tolist() for t in held]
    assert governor.changes and governor.changes[0][1] == 1
    prefills = [threads for tokens, threads in seen if tokens > 1]
    assert prefills == [2, 2]  # the second prompt's prefill back on every thread
    assert (1, 1) in seen and (1, 2) in seen  # decode steps on both counts
    model.decode_plan.release()
    assert torch.get_num_threads() == 2


# ---- weights on 2 MB pages for a long decode --------------------------------------------------

from gptkiln.cpu import memory  # noqa: E402
from gptkiln.cpu.plan import HUGE_PAGES_FROM  # noqa: E402

needs_huge_pages = pytest.mark.skipif(
    not memory.available(), reason="no transparent huge pages here (not Linux, or 'never')"
)


@pytest.fixture(autouse=True)
def moves_at_any_speed(monkeypatch):
    """Moves that a busy host's compaction slows are still made (and none stops the next
    test's): each test here sets its own clock where speed is the point."""
    monkeypatch.setattr(memory, "SLOW", float("inf"))
    monkeypatch.setattr(memory, "_compacting", False)


def _kernel_grants_a_huge_page() -> bool:
    """Whether the kernel backs a 2 MB-aligned, madvised block with a huge page now (a host
    whose memory is fragmented by other work may not: then no move can be checked)."""
    block = torch.empty(2 * memory.PAGE, dtype=torch.uint8)
    start = -block.data_ptr() % memory.PAGE
    if memory._madvise()(block.data_ptr() + start, memory.PAGE, memory._MADV_HUGEPAGE) != 0:
        return False
    block[start : start + memory.PAGE].fill_(1)
    return _huge_kb(block.data_ptr() + start) >= 2048


def _huge_kb(address: int) -> int:
    """The AnonHugePages (kB) of this process's mapping that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


@needs_huge_pages
def test_a_tensor_on_huge_pages_is_the_same_values_on_2mb_pages():
    t = torch.randn(3 * memory.PAGE // 4 + 5)  # 3 pages and a bit
    moved = memory.on_huge_pages(t)
    assert torch.equal(moved, t) and moved.data_ptr() != t.data_ptr()
    assert moved.data_ptr() % memory.PAGE == 0
    if _huge_kb(moved.data_ptr()) < 2048 and not _kernel_grants_a_huge_page():
        pytest.skip("the kernel gave no 2 MB page to a fresh madvised block either just now")
    assert _huge_kb(moved.data_ptr()) >= 2048  # the kernel backed it with at least one
    assert memory.on_huge_pages(moved) is moved  # moved once
    small = torch.randn(1000)
    assert memory.on_huge_pages(small) is small


@needs_huge_pages
def test_moves_stop_once_one_is_slower_than_memory(monkeypatch):
    # the kernel compacting memory to find 2 MB blocks: a move at 10 ms a MB ends the moves
    monkeypatch.setattr(memory, "SLOW", 1e-3)
    ticks = iter([0.0, 10e-3 * 8])  # an 8 MB move that took 80 ms
    first = torch.randn(2 * memory.PAGE)
    assert memory.on_huge_pages(first, clock=lambda: next(ticks)) is not first
    second = torch.randn(2 * memory.PAGE)
    assert memory.on_huge_pages(second) is second  # left where it is
    monkeypatch.setenv(memory.ENV, "1")  # asked for at any cost
    assert memory.on_huge_pages(second) is not second


@needs_huge_pages
@pytest.mark.parametrize("steps, moves", [(10, False), (HUGE_PAGES_FROM, True), (None, True)])
def test_a_long_decode_reads_its_weights_from_huge_pages(steps, moves):
    from gptkiln.config import GPTConfig
    from gptkiln.cpu import prepare_for_decoding
    from gptkiln.model import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("qwen3-baby", vocab_size=8704)).eval()  # a 4.3 MB embedding
    tied = model.wte.weight
    before = tied.detach().clone()
    prepare_for_decoding(model, 1, steps, precision="fp32")
    assert (tied.data_ptr() % memory.PAGE == 0) is moves
    assert model.wte.weight is tied and model.lm_head.weight is tied  # the same Parameter
    assert torch.equal(tied.detach(), before)
    model.decode_plan.release()


@needs_huge_pages
def test_weights_moved_while_decoding_in_inference_mode_keep_the_precisions_kernels(monkeypatch):
    """generate_stream decodes in ``torch.inference_mode``: a weight moved there stays a plain
    tensor, and the bf16 copies made of it (keyed by its version) still run: before, the moved
    weights were inference tensors and their products fell back to fp32."""
    from gptkiln.config import GPTConfig
    from gptkiln.cpu import prepare_for_decoding, specs
    from gptkiln.cpu.planned import few_row_kernels
    from gptkiln.model import GPT

    if not specs.available(specs.BY_NAME["bf16_rows"]):
        pytest.skip("the library is not built here")
    monkeypatch.delenv("GPTKILN_EXACT_KERNELS", raising=False)  # the suite's; bf16 here
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("qwen3-baby", vocab_size=8704)).eval()  # a 4.3 MB embedding
    with torch.inference_mode():
        prepare_for_decoding(model, 1, HUGE_PAGES_FROM, precision="bf16")
    assert model.wte.weight.data_ptr() % memory.PAGE == 0  # moved, in inference mode
    assert not model.wte.weight.is_inference()
    assert few_row_kernels(model.lm_head)[1] is specs.BY_NAME["bf16_rows"].kernel
    model.decode_plan.release()
    with torch.inference_mode():  # a weight made in inference mode has copies too
        w = torch.randn(64, 32)
    x = torch.randn(1, 32)
    y = specs.BY_NAME["bf16_rows"].kernel(x, w, None)
    assert torch.allclose(y, x @ w.bfloat16().float().T, rtol=1e-4, atol=1e-5)
