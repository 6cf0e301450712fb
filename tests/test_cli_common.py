"""The CLI's rooms: each command's parser runs a function of its own module, and the flags the
commands share (cli/common.py) mean the same to each."""

import argparse

from gptkiln.cli import COMMANDS, build_parser
from gptkiln.cli.common import Parser, sample_config
from gptkiln.config import SampleConfig


def test_each_command_runs_a_function_of_the_module_that_adds_its_parser():
    seen = []
    for add_parser in COMMANDS:
        sub = Parser(prog="gptkiln").add_subparsers(dest="command")
        add_parser(sub)
        for name, parser in sub.choices.items():
            run = parser.get_default("func")
            assert callable(run) and run.__module__ == add_parser.__module__, (name, run)
            assert run.__name__ in ("run", f"run_{name}"), (name, run)  # not a neighbour's
            seen.append(name)
    top = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert seen == list(top.choices)  # COMMANDS is every command, in --help's order


def test_generate_and_chat_read_their_sampling_flags_into_one_sample_config():
    parser = build_parser()
    args = parser.parse_args(
        ["generate", "run", "--prompt", "x", "--stop", "a", "--stop", "\n", "--seed", "3"]
        + ["--presence-penalty", "0.5", "--frequency-penalty", "-1", "--top-p", "0.9"]
    )
    cfg = sample_config(args)
    assert (cfg.stop, cfg.seed, cfg.top_p) == (("a", "\n"), 3, 0.9)
    assert (cfg.presence_penalty, cfg.frequency_penalty) == (0.5, -1.0)
    assert (cfg.max_new_tokens, cfg.temperature, cfg.top_k) == (100, 0.8, None)

    chat = sample_config(parser.parse_args(["chat", "run"]))  # greedy, as the book's chapter 7
    assert chat == SampleConfig(max_new_tokens=200, temperature=0.0)
    chat = sample_config(parser.parse_args(["chat", "run", "--top-k", "5", "--temperature", "1"]))
    assert (chat.top_k, chat.temperature, chat.stop) == (5, 1.0, ())
    for command in (["generate", "run", "--prompt", "x"], ["chat", "run"]):
        args = parser.parse_args(command + ["--min-p", "0.1", "--repetition-penalty", "1.2"])
        cfg = sample_config(args)
        assert (cfg.min_p, cfg.repetition_penalty) == (0.1, 1.2)
        assert sample_config(parser.parse_args(command)).repetition_penalty == 1.0


def test_every_command_that_loads_a_model_names_it_run_dir_and_defaults_to_the_cpu():
    parser = build_parser()
    for argv in (
        ["generate", "r", "--prompt", "x"],
        ["perplexity", "r", "--data", "d"],
        ["inspect", "r", "--prompt", "x"],
        ["serve", "r"],
        ["classify", "r", "--text", "x"],
        ["chat", "r"],
    ):
        args = parser.parse_args(argv)
        assert (args.run_dir, args.device) == ("r", "cpu"), argv
    assert parser.parse_args(["info", "r"]).run_dir == "r"
