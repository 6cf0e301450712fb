"""`gptkiln train --nproc N`'s launcher: one report for N workers, without launching any here
(tests/test_distributed.py launches for real)."""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from gptkiln import launch
from gptkiln.cli import main

BAD = "gptkiln train: error: --sample-prompt 'Ω': not in the vocabulary"


def failed(**codes: int) -> ChildFailedError:
    """The agent's error for ranks that ended with these exit codes (rank_1=2, ...)."""
    failures = {}
    for key, code in codes.items():
        rank = int(key.removeprefix("rank_"))
        failures[rank] = ProcessFailure(
            local_rank=rank, pid=100 + rank, exitcode=code, error_file="<N/A>"
        )
    return ChildFailedError("gptkiln", failures)


@pytest.fixture
def agent(monkeypatch):
    """torchrun's `run` replaced by a fake one that records what it was given, as the workers
    would see it, and then does what the test says: leave error lines, raise."""
    seen = {}

    def fake_run(args):
        seen["args"] = args
        seen["threads"] = os.environ.get("OMP_NUM_THREADS")
        folder = os.environ[launch.ERRORS_ENV]
        for rank, line in seen.get("lines", {}).items():
            with open(os.path.join(folder, f"rank{rank}.txt"), "w") as f:
                f.write(line + "\n")
        if "raise" in seen:
            raise seen["raise"]

    monkeypatch.setattr(torchrun, "run", fake_run)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return seen


def test_workers_get_the_cores_shared_out_and_run_gptkiln_standalone(agent, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert launch.launch(2, ["train", "--max-steps", "3"]) == 0
    assert agent["threads"] == "8"  # torchrun's own default would be 1
    args = agent["args"]
    assert args.standalone and args.nproc_per_node == "2" and args.module
    assert args.training_script == "gptkiln"
    assert args.training_script_args == ["train", "--max-steps", "3"]
    assert launch.ERRORS_ENV not in os.environ  # the workers' folder is gone with the job


def test_a_thread_count_the_user_set_is_kept(agent, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    launch.launch(2, ["train"])
    assert agent["threads"] == "3"


def test_the_same_bad_input_on_every_rank_is_printed_once_by_rank_0(agent, capsys):
    # rank 0 printed its line itself (live); rank 1's is the same line: nothing more to say
    agent["lines"] = {0: BAD, 1: BAD}
    agent["raise"] = failed(rank_0=2, rank_1=2)
    assert launch.launch(2, ["train"]) == 2
    assert capsys.readouterr().err == ""


def test_a_line_only_another_rank_saw_is_printed_once(agent, capsys):
    other = "gptkiln train: error: rank 1's own trouble"
    agent["lines"] = {1: other, 2: other, 3: other}
    agent["raise"] = failed(rank_1=2, rank_2=2, rank_3=2, rank_0=-signal.SIGTERM)
    assert launch.launch(4, ["train"]) == 2  # rank 0 was only stopped by the agent
    assert capsys.readouterr().err == other + "\n"


def test_a_killed_rank_is_named_and_the_ranks_the_agent_stopped_are_not(agent, capsys):
    agent["raise"] = failed(rank_0=-signal.SIGTERM, rank_1=-signal.SIGKILL)
    assert launch.launch(2, ["train"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "gptkiln train: error: rank 1 (pid 101) was killed by SIGKILL "
        "(out of memory, or killed by hand)"
    ]


def test_a_rank_that_lost_its_peers_says_so_once_and_the_job_fails_with_1(agent, capsys):
    lost = "gptkiln train: error: rank 1 of 2 stopped at step 9: lost contact with the other ranks"
    agent["lines"] = {1: lost}
    agent["raise"] = failed(rank_0=-signal.SIGKILL, rank_1=1)
    assert launch.launch(2, ["train"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "gptkiln train: error: rank 0 (pid 100) was killed by SIGKILL " + (
        "(out of memory, or killed by hand)"
    )
    assert err[1:] == [lost]  # rank 1 left its line for the launcher and printed nothing


def test_a_run_stopped_from_outside_is_one_line_and_exit_code_1(monkeypatch, capsys, tmp_path):
    import gptkiln.cli.train
    from gptkiln.errors import RunStopped

    def stopped(args):
        raise RunStopped("rank 0 of 2 stopped at step 9: lost contact with the other ranks")

    monkeypatch.setattr(gptkiln.cli.train, "run", stopped)
    assert main(["train", "--out", str(tmp_path / "run")]) == 1
    assert capsys.readouterr().err == (
        "gptkiln train: error: rank 0 of 2 stopped at step 9: lost contact with the other ranks\n"
    )


def test_train_nproc_relaunches_the_command_line_main_was_given(agent, monkeypatch, tmp_path):
    monkeypatch.setattr("sys.argv", ["pytest", "-k", "launch"])  # this process's, not the command
    out = str(tmp_path / "run")
    with pytest.raises(SystemExit) as exit:
        main(["train", "--nproc=2", "--max-steps", "3", "--out", out])
    assert exit.value.code == 0
    assert agent["args"].training_script_args == ["train", "--max-steps", "3", "--out", out]


def test_a_crash_points_at_its_traceback(agent, capsys):
    agent["raise"] = failed(rank_0=1)
    assert launch.launch(2, ["train"]) == 1
    assert "rank 0 (pid 100) exited with code 1; its output is above" in capsys.readouterr().err


def test_sigterm_on_every_rank_is_reported(agent, capsys):
    agent["raise"] = failed(rank_0=-signal.SIGTERM, rank_1=-signal.SIGTERM)
    assert launch.launch(2, ["train"]) == 1
    assert capsys.readouterr().err.count("was killed by SIGTERM") == 2


def test_ctrl_c_is_one_line_and_exit_130(agent, capsys, monkeypatch, tmp_path):
    agent["raise"] = SignalException("", signal.SIGINT)
    argv = ["train", "--nproc", "2", "--out", str(tmp_path / "run")]
    monkeypatch.setattr("sys.argv", ["gptkiln", *argv])
    assert main(argv) == 130
    assert capsys.readouterr().err == "gptkiln train: interrupted\n"
    # rank 0 left where its last checkpoint is: said as a one-process run says it
    agent["lines"] = {0: "at step 95; the last checkpoint, step 90, is in run"}
    assert main(argv) == 130
    assert capsys.readouterr().err == (
        "gptkiln train: interrupted at step 95; the last checkpoint, step 90, is in run\n"
    )


def test_a_worker_under_the_launcher_leaves_its_interrupt_for_the_launcher(
    tmp_path, monkeypatch, capsys
):
    import gptkiln.train

    def interrupted(cfg, **kwargs):
        raise KeyboardInterrupt("at step 3; no checkpoint was written")

    monkeypatch.setenv(launch.ERRORS_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(gptkiln.train, "train", interrupted)
    assert main(["train", "--max-steps", "1", "--out", str(tmp_path / "run")]) == 130
    assert capsys.readouterr().err == ""
    assert (tmp_path / "rank0.txt").read_text() == "at step 3; no checkpoint was written\n"


def test_workers_report_their_error_line_and_only_rank_0_prints_it(tmp_path, monkeypatch):
    assert launch.report_error(BAD) is False  # not under the launcher: print as usual
    monkeypatch.setenv(launch.ERRORS_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    assert launch.report_error(BAD) is False
    monkeypatch.setenv("RANK", "1")
    assert launch.report_error(BAD) is True
    assert (tmp_path / "rank0.txt").read_text() == (tmp_path / "rank1.txt").read_text()
    assert (tmp_path / "rank1.txt").read_text() == BAD + "\n"


def test_a_worker_under_the_launcher_stays_quiet_on_bad_input_above_rank_0(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(launch.ERRORS_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    assert main(["train", "--max-steps", "0"]) == 2
    assert capsys.readouterr().err == ""
    assert "max_steps" in (tmp_path / "rank1.txt").read_text()
