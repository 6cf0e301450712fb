"""Training on several processes, for real: torchrun launches, gloo on CPU, DDP and FSDP2.

Every run trains the tiny model on the opening of a bundled play (conftest's ``play_path``). The
reference is one process with batch 2b; two processes with batch b each must give the same loss
curve and the same final weights (float tolerance: the sums are the same, their order is not),
whichever way they are launched, and checkpoints must move between 1 and 2 processes. Faults are
real: a rank killed by SIGKILL, a rank frozen by SIGSTOP. Every process started here runs under a
timeout and is killed by pid if it outlives it.

Run as a script under torchrun, this file is also the worker of the gradient-sync checks
(``python -m torch.distributed.run --nproc-per-node 2 tests/test_distributed.py OUT_DIR``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gptkiln.checkpoint import read_checkpoint
from gptkiln.config import TrainConfig
from gptkiln.loading import load_model
from gptkiln.train import read_metrics, train

THIS_FILE = Path(__file__).resolve()
B = 4  # the batch of one of two processes; the one-process reference uses 2 * B
STEPS = 16  # short enough that fp32 rounding stays far below the tolerance
LAUNCH_TIMEOUT_S = 120

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="reads worker pids from /proc"),
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed"),
]


# -- launching -------------------------------------------------------------------------------
def settings(data: Path, out: Path, **overrides) -> dict:
    """The run every test trains, as TrainConfig fields."""
    base = dict(
        data=str(data),
        out=str(out),
        model="tiny",
        tokenizer="char",
        context_length=32,
        dropout=0.0,
        batch_size=B,
        max_steps=STEPS,
        eval_interval=4,
        eval_batches=2,
        checkpoint_interval=4,
        sample_interval=1000,
        sample_tokens=4,
        sample_prompt="I ",
        warmup_steps=2,
        lr=3e-3,
        decay_lr=False,
        optimizer="adamw",  # the mechanics on AdamW and random windows (Muon: its own test)
        sampling="random",
        seed=7,
        progress=False,
        precision="fp32",  # runs compared bit for bit: auto's measurement could differ
    )
    return {**base, **overrides}


def flags(values: dict) -> list[str]:
    """TrainConfig fields as `gptkiln train` flags (``decay_lr=False`` -> ``--no-decay-lr``)."""
    out = []
    for key, value in values.items():
        name = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(name if value else "--no-" + key.replace("_", "-"))
        else:
            out += [name, str(value)]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(**extra: str) -> dict:
    """One thread per process, loopback only, unbuffered output."""
    launched = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in launched and not k.startswith(("TORCHELASTIC_", "GPTKILN_"))
    }
    return {
        **env,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        **extra,
    }


def torchrun(nproc: int, *args: str, launcher: tuple[str, ...] = ()) -> list[str]:
    rdzv = launcher or ("--standalone",)
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        *rdzv,
        *args,
    ]


def gptkiln_train(nproc: int, values: dict, launcher: tuple[str, ...] = ()) -> list[str]:
    return torchrun(nproc, "-m", "gptkiln", "train", *flags(values), launcher=launcher)


def descendants(pid: int) -> list[int]:
    """Pids of every live process below ``pid`` (torchrun's workers run in sessions of their
    own, so a process group would miss them)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the worker with this RANK among the launcher's descendants."""
    for pid in descendants(launcher_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_WORLD_SIZE" in b" ".join(env):
            return pid
    return None


class Launches:
    """Processes started by a test; whatever is still alive at the end is killed by pid."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], env: dict | None = None):
        proc = subprocess.Popen(
            cmd,
            env=env or worker_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.procs.append(proc)
        return proc

    def finish(self, proc: subprocess.Popen, timeout: float = LAUNCH_TIMEOUT_S) -> str:
        """Wait for ``proc``; its whole output. Fails the test after ``timeout`` seconds."""
        try:
            return proc.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            self.kill(proc)
            pytest.fail(
                f"{' '.join(proc.args[:8])} ... ran past {timeout}s:\n"
                f"{proc.communicate()[0][-4000:]}"
            )

    def run(self, cmd: list[str], env: dict | None = None, timeout: float = LAUNCH_TIMEOUT_S):
        proc = self.start(cmd, env)
        output = self.finish(proc, timeout)
        assert proc.returncode == 0, output[-4000:]
        return output

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        for pid in [*descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                self.kill(proc)
                proc.communicate()


@pytest.fixture
def launches():
    started = Launches()
    yield started
    started.close()


# -- the reference: one process, batch 2b ----------------------------------------------------
@pytest.fixture(scope="module")
def prepared(play_path, tmp_path_factory) -> Path:
    """The play (conftest's ``play_path``) tokenized once (char tokenizer), so most runs skip
    preparing it."""
    from gptkiln.data.prepare import prepare

    out = tmp_path_factory.mktemp("prepared")
    prepare(str(play_path), out, tokenizer="char", progress=False)
    return out


@pytest.fixture(scope="module")
def reference(prepared, tmp_path_factory) -> Path:
    """STEPS steps of one process with batch 2b: the run every distributed run must equal."""
    out = tmp_path_factory.mktemp("reference") / "run"
    train(TrainConfig(**settings(prepared, out, batch_size=2 * B)))
    return out


def assert_same_training(run: Path, ref: Path) -> None:
    """Same metrics.csv rows (steps, tokens, train and val loss) and the same final weights."""
    rows, ref_rows = read_metrics(run / "metrics.csv"), read_metrics(ref / "metrics.csv")
    assert [(r["step"], r["tokens"]) for r in rows] == [(r["step"], r["tokens"]) for r in ref_rows]
    for row, ref_row in zip(rows, ref_rows, strict=True):
        for key in ("train_loss", "val_loss"):
            assert row[key] == pytest.approx(ref_row[key], rel=1e-5), (row["step"], key)
    weights, ref_weights = (
        load_file(run / "model.safetensors"),
        load_file(ref / "model.safetensors"),
    )
    assert weights.keys() == ref_weights.keys()
    for name in weights:
        torch.testing.assert_close(
            trained_by_the_loss(name, weights[name]),
            trained_by_the_loss(name, ref_weights[name]),
            rtol=1e-4,
            atol=1e-5,
            msg=lambda m, name=name: f"{name}: {m}",
        )


def trained_by_the_loss(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The part of a weight that the loss moves: all of it but the key third of an attention's
    ``c_attn.bias``. A key bias adds q . b_k to every score of a query's row, which the softmax
    cancels, so its exact gradient is zero: what it gets is rounding noise (~1e-12 against the
    value bias's ~1e-3), which AdamW scales into steps of up to lr, a different noise for every
    summation order. In two runs of the DDP test the key biases ended 5.2e-5 and 2.8e-5 apart
    after 16 steps, while every other weight agreed within 1.2e-6."""
    if name.endswith("attn.c_attn.bias"):
        n_embd = tensor.shape[0] // 3  # (3C,): query, key, value
        return torch.cat([tensor[:n_embd], tensor[2 * n_embd :]])
    return tensor


# -- gradient sync and full state: this file as a torchrun worker ----------------------------
@pytest.fixture(scope="module")
def worker_reports(tmp_path_factory) -> list[dict]:
    """Run `_worker_main` on two ranks; each rank's report."""
    out = tmp_path_factory.mktemp("worker")
    started = Launches()
    try:
        started.run(torchrun(2, str(THIS_FILE), str(out)))
    finally:
        started.close()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_gradient_accumulation_skips_the_all_reduce_until_the_last_micro_step(worker_reports):
    for rank, report in enumerate(worker_reports):
        ddp, fsdp = report["ddp"], report["fsdp"]
        # DDP: no all-reduce at all in the first micro-step, then one per bucket.
        assert ddp["allreduce_calls"] == [0, ddp["allreduce_calls"][1]], rank
        assert ddp["allreduce_calls"][1] >= 1, rank
        assert ddp["grads_differ_across_ranks"] == [True, False], rank
        assert ddp["grad_error_vs_one_big_batch"] < 1e-6, rank
        # FSDP2: no reduce-scatter in the first micro-step (the sharded grads do not exist yet).
        assert fsdp["sharded_grads_exist"] == [False, True], rank
        assert fsdp["grad_error_vs_one_big_batch"] < 1e-6, rank


def test_full_state_round_trips_ddp_and_fsdp_with_the_tied_embedding(worker_reports):
    for rank, report in enumerate(worker_reports):
        for strategy in ("ddp", "fsdp"):
            result = report[strategy]
            assert result["tied"], (rank, strategy)  # lm_head.weight is wte.weight, once
            assert result["tied_after_load"], (rank, strategy)
            assert result["loss_error_after_load"] < 1e-6, (rank, strategy)
    for strategy in ("ddp", "fsdp"):
        main = worker_reports[0][strategy]
        assert main["state_keys_ok"], strategy  # gptkiln names, no "module." prefix, tie once
        assert main["optimizer_state_round_trips"], strategy  # exp_avg, exp_avg_sq, step
        assert main["model_state_round_trips"], strategy
        assert main["source_dicts_untouched"], strategy


def _worker_main(out: Path) -> None:
    from gptkiln import distributed as du

    world = du.setup("cpu")
    torch.set_num_threads(1)
    report = {"ddp": _check_ddp_sync(world), "fsdp": _check_fsdp_sync(world)}
    for strategy in ("ddp", "fsdp"):
        report[strategy].update(_check_full_state(world, strategy))
    (out / f"rank{world.rank}.json").write_text(json.dumps(report))
    du.teardown()


def _tiny_gpt():
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT

    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("tiny", vocab_size=40, context_length=16))


def _micro_batches(world):
    """(x, y) for each (micro-step, rank): 2 micro-steps of 2 rows, different on every rank."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 40, (2, world.world_size, 2, 17), generator=gen)
    return tokens[..., :-1], tokens[..., 1:]  # (micro, rank, 2, 16) each


def _big_batch_grads(model, world) -> dict[str, torch.Tensor]:
    """Gradients of one process over every rank's micro-batches: what the ranks must agree on."""
    x, y = _micro_batches(world)
    _, loss = model(x.flatten(0, 2), y.flatten(0, 2))
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _accumulate(model, world, after_micro0) -> None:
    from gptkiln.distributed import gradient_sync

    x, y = _micro_batches(world)
    for micro in range(2):
        with gradient_sync(model, enabled=micro == 1):
            _, loss = model(x[micro, world.rank], y[micro, world.rank])
            (loss / 2).backward()
        if micro == 0:
            after_micro0()


def _check_ddp_sync(world) -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from gptkiln.distributed import parallelize

    reference = _big_batch_grads(_tiny_gpt(), world)
    model = parallelize(_tiny_gpt(), world, "ddp")
    calls = {"n": 0}

    def counting_hook(state, bucket):
        calls["n"] += 1
        return allreduce_hook(None, bucket)

    model.register_comm_hook(None, counting_hook)
    seen, differ = [], []

    def grads_differ() -> bool:
        grad = model.module.h[0].mlp.c_fc.weight.grad.clone()
        everyone = [torch.empty_like(grad) for _ in range(world.world_size)]
        dist.all_gather(everyone, grad)
        return not all(torch.equal(g, everyone[0]) for g in everyone)

    def after_micro0():
        seen.append(calls["n"])
        differ.append(grads_differ())

    _accumulate(model, world, after_micro0)
    seen.append(calls["n"])
    differ.append(grads_differ())
    error = max(
        (p.grad - reference[n]).abs().max().item() for n, p in model.module.named_parameters()
    )
    return {
        "allreduce_calls": seen,
        "grads_differ_across_ranks": differ,
        "grad_error_vs_one_big_batch": error,
    }


def _check_fsdp_sync(world) -> dict:
    from gptkiln.distributed import parallelize

    reference = _big_batch_grads(_tiny_gpt(), world)
    model = parallelize(_tiny_gpt(), world, "fsdp")
    exist = []
    _accumulate(
        model, world, lambda: exist.append(any(p.grad is not None for p in model.parameters()))
    )
    exist.append(all(p.grad is not None for p in model.parameters()))
    error = max(
        (p.grad.full_tensor() - reference[n]).abs().max().item()
        for n, p in model.named_parameters()
    )
    return {"sharded_grads_exist": exist, "grad_error_vs_one_big_batch": error}


def _check_full_state(world, strategy: str) -> dict:
    """One AdamW step, gather the full state, load it into a differently seeded model: the
    reloaded model and optimizer must match the original, on every rank."""
    from gptkiln import distributed as du
    from gptkiln.optim import make_optimizer

    def build(seed: int):
        model = _tiny_gpt()
        torch.manual_seed(seed)
        model.reset_parameters()
        model = du.parallelize(model, world, strategy)
        return model, make_optimizer(model, 1e-2, 0.1, (0.9, 0.95))

    x, y = _micro_batches(world)
    model, opt = build(0)
    model(x[0, world.rank], y[0, world.rank])[1].backward()
    opt.step()
    model_sd, optim_sd = du.full_state(model, opt)
    box = [(model_sd, optim_sd)]
    torch.distributed.broadcast_object_list(box, src=0)  # rank 0 alone holds the full state
    full_model, full_optim = box[0]
    keys_before = (list(full_model), list(full_optim["state"]))
    other, other_opt = build(1)
    du.load_full_state(other, other_opt, full_model, full_optim)
    inner, other_inner = du.unwrap(model), du.unwrap(other)
    with torch.no_grad():
        losses = [m(x[1, world.rank], y[1, world.rank])[1].item() for m in (model, other)]
    again_model, again_optim = du.full_state(other, other_opt)
    report = {
        "tied": inner.lm_head.weight is inner.wte.weight,
        "tied_after_load": other_inner.lm_head.weight is other_inner.wte.weight,
        "loss_error_after_load": abs(losses[0] - losses[1]),
        "source_dicts_untouched": keys_before == (list(full_model), list(full_optim["state"])),
    }
    if world.is_main:
        report["state_keys_ok"] = (
            "wte.weight" in model_sd
            and "h.0.attn.c_attn.weight" in model_sd
            and not any("module." in k for k in model_sd)
            and "wte.weight" in optim_sd["state"]
        )
        report["model_state_round_trips"] = all(
            torch.equal(model_sd[k], again_model[k]) for k in model_sd
        )
        report["optimizer_state_round_trips"] = all(
            torch.equal(optim_sd["state"][k][s], again_optim["state"][k][s])
            for k in optim_sd["state"]
            for s in ("exp_avg", "exp_avg_sq", "step")
        )
    return report


# -- equivalence: 2 x b == 1 x 2b ------------------------------------------------------------
def test_ddp_two_processes_match_one_process_with_twice_the_batch(
    play_path, reference, tmp_path, launches
):
    # `gptkiln train --nproc 2` re-launches itself under torchrun; the raw text is prepared by
    # rank 0 alone while rank 1 waits.
    out = tmp_path / "ddp"
    cmd = [
        sys.executable,
        "-m",
        "gptkiln",
        "train",
        "--nproc",
        "2",
        *flags(settings(play_path, out)),
    ]
    output = launches.run(cmd)
    assert_same_training(out, reference)
    # rank 0 alone logs, plots and writes; the checkpoint loads in one process
    assert output.count("step      4 |") == 1 and output.count("done:") == 1, output
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    _, state = read_checkpoint(out)
    assert state["world_size"] == 2 and state["step"] == STEPS
    model = load_model(out)
    torch.testing.assert_close(
        model.wte.weight, load_model(reference).wte.weight, rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_muon_on_two_processes_matches_one_process(parallel, prepared, tmp_path, launches):
    """Muon orthogonalises each whole matrix: under DDP every rank holds it, with gradients
    all-reduced before the step; under FSDP2 each update is gathered whole and each rank keeps
    its rows. Either way two processes train as one does with twice the batch (within the bf16
    of Newton-Schulz: a summation order apart, not a rank's own gradient apart). The FSDP2 run
    starts from a one-process checkpoint at step 4, so Muon's momentum is sharded from it."""
    muon = dict(optimizer="muon", schedule="wsd", relu2=True, max_steps=8, model="qwen3-baby")
    ref = tmp_path / "one"
    train(TrainConfig(**settings(prepared, ref, **{**muon, "batch_size": 2 * B})))
    out = tmp_path / parallel
    values = settings(prepared, out, **muon, parallel=parallel)
    if parallel == "fsdp":
        first = {**values, "batch_size": 2 * B, "max_steps": 4, "parallel": "ddp"}
        train(TrainConfig(**first))
        values["resume"] = True
    launches.run(gptkiln_train(2, values))
    rows, ref_rows = read_metrics(out / "metrics.csv"), read_metrics(ref / "metrics.csv")
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [4, 8]
    for row, ref_row in zip(rows, ref_rows, strict=True):
        assert row["val_loss"] == pytest.approx(ref_row["val_loss"], rel=2e-3)
    weights = load_file(out / "model.safetensors")
    ref_weights = load_file(ref / "model.safetensors")
    for name in weights:
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=0, atol=2e-3)
    _, state = read_checkpoint(out)
    assert state["optimizer_kind"] == "muon" and state["world_size"] == 2


def test_nproc_says_a_workers_bad_input_once_and_exits_2(prepared, tmp_path, launches):
    # The sample prompt is checked by the workers (against the prepared tokenizer), after
    # torchrun started them: one line for the two ranks, none of torchrun's report.
    values = settings(prepared, tmp_path / "bad", sample_prompt="Ω", sample_interval=4)
    job = launches.start([sys.executable, "-m", "gptkiln", "train", "--nproc", "2", *flags(values)])
    output = launches.finish(job)
    assert job.returncode == 2, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert lines[0].startswith("gptkiln train: error: --sample-prompt 'Ω'"), output


def test_nproc_says_bad_data_found_while_preparing_once_and_exits_2(tmp_path, launches):
    """Rank 0 prepares the text and finds a bad line halfway (past what the launcher checks):
    every rank stops with its line, printed once, no traceback, no run directory left."""
    rows = [{"text": "to be or not to be " * 20}] * 30
    rows[15] = {"body": "x"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    values = settings(bad, tmp_path / "run")
    job = launches.start([sys.executable, "-m", "gptkiln", "train", "--nproc", "2", *flags(values)])
    output = launches.finish(job)
    assert job.returncode == 2, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and 'bad.jsonl line 16: no string "text" field' in lines[0], output
    assert not (tmp_path / "run").exists()


def test_tokens_per_second_counts_every_rank_once(prepared, tmp_path, launches):
    # Under a clock that moves 1 s per reading every step takes 1 s, so tokens/s is the tokens
    # of one step of the whole world, 2 x B x 32 (it had been counted world_size times over).
    out = tmp_path / "speed"
    values = settings(prepared, out, max_steps=8)
    launches.run(torchrun(2, str(THIS_FILE), "--clock", *flags(values)))
    assert [row["tokens_per_s"] for row in read_metrics(out / "metrics.csv")] == [2 * B * 32] * 2


def test_a_time_budget_ends_every_rank_at_the_same_step(prepared, tmp_path, launches):
    # Rank r's clock moves r + 1 seconds a reading (two readings a step): after step k rank 0
    # has trained 2k - 1 s and rank 1 4k - 2 s. Every rank takes the slowest clock, so a 10 s
    # budget ends both at step 3 (rank 0 alone would go on to step 6, its peer gone).
    out = tmp_path / "budget"
    values = settings(prepared, out, max_steps=100, max_time=10 / 60, eval_interval=100)
    launches.run(torchrun(2, str(THIS_FILE), "--uneven-clock", *flags(values)))
    _, state = read_checkpoint(out)
    assert state["step"] == 3 and state["train_seconds"] == 10.0
    assert [row["step"] for row in read_metrics(out / "metrics.csv")] == [3]


def test_the_progress_bar_shows_the_whole_batchs_loss(prepared, tmp_path, launches):
    # Each rank's loss is over its share of the batch; the bar (rank 0's) shows their mean, the
    # train_loss metrics.csv logs at that step without --eval-train.
    out = tmp_path / "bar"
    values = {**settings(prepared, out, max_steps=3, eval_interval=3), "eval_train": False}
    values["progress"] = True
    output = launches.run(gptkiln_train(2, values))
    shown = float(re.findall(r"loss=([0-9.]+)", output)[-1])
    assert shown == pytest.approx(read_metrics(out / "metrics.csv")[-1]["train_loss"], abs=6e-4)


def test_fsdp_matches_one_process_and_checkpoints_move_between_world_sizes(
    prepared, reference, tmp_path, launches
):
    # 1 process (steps 1-4) -> FSDP2 on 2 processes, resumed (5-8) -> 1 process, resumed (9-16):
    # the same run as the reference, so the full state (weights, AdamW moments, the tied
    # embedding) survives gathering from shards and sharding from a full checkpoint.
    out = tmp_path / "fsdp"
    train(TrainConfig(**settings(prepared, out, batch_size=2 * B, max_steps=4)))
    output = launches.run(
        gptkiln_train(2, {**settings(prepared, out, max_steps=8, parallel="fsdp"), "resume": True})
    )
    assert "step      8 |" in output
    _, state = read_checkpoint(out)
    assert state["world_size"] == 2 and state["step"] == 8
    train(TrainConfig(**settings(prepared, out, batch_size=2 * B)), resume=True)
    assert_same_training(out, reference)


def test_two_nodes_on_loopback_train_like_one_process(prepared, reference, tmp_path, launches):
    # Two torchrun launches, as on two machines: --nnodes 2, node ranks 0 and 1, one process
    # each, meeting at 127.0.0.1:PORT (static rendezvous; node 0 hosts the store).
    out, port = tmp_path / "nodes", free_port()
    nodes = [
        launches.start(
            gptkiln_train(
                1,
                settings(prepared, out),
                launcher=(
                    "--nnodes=2",
                    f"--node-rank={rank}",
                    "--master-addr=127.0.0.1",
                    f"--master-port={port}",
                ),
            )
        )
        for rank in range(2)
    ]
    outputs = [launches.finish(node) for node in nodes]
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-4000:]
    assert_same_training(out, reference)
    log_line = re.compile(r"(?m)^step +\d+ \|")
    assert log_line.search(outputs[0]) and not log_line.search(outputs[1])  # rank 0 alone logs


# -- faults ----------------------------------------------------------------------------------
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_sigterm_during_a_checkpoint_write_waits_for_the_write_to_finish(signum):
    from gptkiln.distributed import TerminationGuard, WorkerStopped

    finished = []
    before = signal.getsignal(signum)
    raised = (WorkerStopped, "SIGTERM") if signum == signal.SIGTERM else (KeyboardInterrupt, None)
    with TerminationGuard() as guard, pytest.raises(raised[0], match=raised[1]):
        with guard.hold():
            os.kill(os.getpid(), signum)
            time.sleep(0.05)  # the handler has run by now, and only noted the signal
            finished.append(True)
    assert finished == [True]  # Ctrl-C too waits for the write, then stops as Ctrl-C does
    assert signal.getsignal(signum) == before  # restored


def test_torchrun_restarts_a_killed_worker_and_the_run_resumes_by_itself(
    prepared, reference, tmp_path, launches
):
    # Rank 1 SIGKILLs itself at step 10 of the first attempt (GPTKILN_FAULT_AT_STEP); torchrun
    # (--max-restarts 1) stops rank 0 and starts both again, which resume from step 8.
    out = tmp_path / "restart"
    cmd = gptkiln_train(2, settings(prepared, out), launcher=("--standalone", "--max-restarts=1"))
    output = launches.run(cmd, env=worker_env(GPTKILN_FAULT_AT_STEP="10"))
    assert "torchrun restarted the workers: resuming from step 8" in output, output
    assert_same_training(out, reference)  # rows 4, 8 from the first attempt, 12, 16 after


def long_run(data: Path, out: Path) -> dict:
    """A run far longer than the tests let it live: it is stopped soon after its first save."""
    return settings(data, out, max_steps=5000, eval_interval=1000, checkpoint_interval=10)


def wait_for_checkpoint(launcher: subprocess.Popen, out: Path, timeout: float = 60) -> int:
    """Block until the run in ``out`` has saved a checkpoint; the pid of rank 1."""
    deadline = time.monotonic() + timeout
    while not (out / "trainer_state.pt").exists():
        assert launcher.poll() is None, launcher.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "no checkpoint within the time allowed"
        time.sleep(0.05)
    pid = worker_pid(launcher.pid, rank=1)
    assert pid is not None, "rank 1 not found among torchrun's children"
    return pid


def last_checkpoint_step(output: str) -> int:
    found = re.search(
        r"rank 0 of 2 stopped at step \d+: .*the last checkpoint, step (\d+), is in", output
    )
    assert found, output[-4000:]
    return int(found.group(1))


def test_a_killed_rank_ends_the_job_at_once_and_the_last_checkpoint_loads(
    prepared, tmp_path, launches
):
    out = tmp_path / "killed"
    job = launches.start(gptkiln_train(2, long_run(prepared, out)))
    os.kill(wait_for_checkpoint(job, out), signal.SIGKILL)
    killed_at = time.monotonic()
    output = launches.finish(job, timeout=60)
    assert time.monotonic() - killed_at < 30, "the job outlived its dead rank"
    assert job.returncode != 0
    assert "Signal 9 (SIGKILL)" in output, output[-4000:]  # torchrun names the dead rank
    step = last_checkpoint_step(output)  # ... and rank 0 says where to resume from
    assert step % 10 == 0 and step < 5000
    _, state = read_checkpoint(out)  # both files of one save, not a half-written pair
    assert state["step"] == step
    assert load_model(out).config.n_layer == 2


# Timing across processes on a shared 2-core machine: one unexplained failure in ~25 runs was
# seen while writing it, so a failure gets one more try before it counts.
@pytest.mark.flaky(reruns=1)
def test_a_frozen_rank_times_out_instead_of_hanging(prepared, tmp_path, launches):
    # SIGSTOP: alive for torchrun, silent for rank 0, whose next collective must give up after
    # GPTKILN_DIST_TIMEOUT seconds.
    out, timeout_s = tmp_path / "frozen", 5
    job = launches.start(
        gptkiln_train(2, long_run(prepared, out)),
        env=worker_env(GPTKILN_DIST_TIMEOUT=str(timeout_s)),
    )
    frozen = wait_for_checkpoint(job, out)
    rank0 = worker_pid(job.pid, rank=0)
    assert rank0 is not None, "rank 0 not found among torchrun's children"
    os.kill(frozen, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        while _alive(rank0):
            assert time.monotonic() - stopped_at < timeout_s + 25, "rank 0 hangs"
            time.sleep(0.05)
        waited = time.monotonic() - stopped_at
    finally:
        os.kill(frozen, signal.SIGKILL)  # torchrun would, 30 s after its SIGTERM
    output = launches.finish(job, timeout=60)
    assert waited >= timeout_s - 1, (waited, output[-4000:])
    assert job.returncode != 0
    assert "lost contact with the other ranks" in output, output[-4000:]
    assert read_checkpoint(out)[1]["step"] == last_checkpoint_step(output)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _train_on_a_clock(argv: list[str], seconds_per_read: float = 1.0) -> int:
    """`gptkiln train ARGV` with a clock that moves ``seconds_per_read`` each time it is read."""
    import itertools

    import gptkiln.train.loop
    from gptkiln.cli import main

    ticks = itertools.count()
    gptkiln.train.loop.now = lambda: float(next(ticks)) * seconds_per_read
    return main(["train", *argv])


if __name__ == "__main__":
    if sys.argv[1] == "--clock":
        sys.exit(_train_on_a_clock(sys.argv[2:]))
    if sys.argv[1] == "--uneven-clock":  # rank r's clock: r + 1 seconds a reading
        sys.exit(_train_on_a_clock(sys.argv[2:], int(os.environ["RANK"]) + 1))
    _worker_main(Path(sys.argv[1]))


@pytest.mark.parametrize("stop", ["peer", "sigterm", "bug"])
def test_a_run_leaving_on_a_stop_is_not_killed_before_it_says_where_to_resume(stop):
    """torchrun SIGTERMs the surviving ranks as soon as one dies; rank 0, already leaving on the
    lost peer, must live to print the last checkpoint (it was once killed on the way out)."""
    from gptkiln.distributed import TerminationGuard, WorkerStopped

    before = signal.getsignal(signal.SIGTERM)
    error = {
        "peer": RuntimeError("Connection closed by peer"),
        "sigterm": WorkerStopped("stopped by SIGTERM"),
        "bug": ValueError("a bug is not a stop"),
    }[stop]
    try:
        with pytest.raises(type(error)), TerminationGuard():
            raise error
        if stop == "bug":
            assert signal.getsignal(signal.SIGTERM) == before  # restored as it was
        else:
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGTERM)  # torchrun's: this process lives on
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGTERM, before)
