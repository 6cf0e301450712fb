"""`--help` a person can use: every flag of every subcommand says what it does and its default,
`train`'s flags come from `TrainConfig`'s fields in groups, and every command shows an example.

The walk over `build_parser()` covers subcommands added later, so their flags meet the same rule.
"""

import argparse
import dataclasses
import shlex

import pytest

from gptkiln.cli import EXAMPLES, build_parser
from gptkiln.config import PRESETS, TRAIN_GROUPS, TrainConfig


def parsers(parser: argparse.ArgumentParser, path: str = "gptkiln"):
    """(command path, parser) of the top-level parser and every subparser, nested ones too."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def takes_a_value(action: argparse.Action) -> bool:
    return action.nargs != 0 and not isinstance(action, argparse.BooleanOptionalAction)


def flag_help(path: str, flag: str) -> str:
    parser = dict(parsers(build_parser()))[path]
    action = next(a for a in parser._actions if flag in a.option_strings)
    return action.help % {"default": action.default}


def test_every_flag_of_every_command_explains_itself_and_names_its_default():
    seen = 0
    for path, parser in parsers(build_parser()):
        text = parser.format_help()
        assert "default: None" not in text and "(default: )" not in text, path
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:  # each subcommand's line in the list
                    assert choice.help and choice.help.strip(), f"{path} {choice.dest}"
                continue
            assert action.help and action.help.strip(), f"{path} {action.dest}: no help"
            assert "\n" not in action.help, f"{path} {action.dest}: help of one line"
            if (
                action.option_strings
                and not action.required
                and (takes_a_value(action) or isinstance(action, argparse.BooleanOptionalAction))
            ):  # a flag with a value of its own: what it is when not given
                assert "default" in action.help, f"{path} {action.option_strings[0]}"
            seen += 1
    assert seen > 60  # the walk reached the subcommands' flags


def test_every_command_shows_an_example_that_parses():
    parser = build_parser()
    for path, sub in parsers(parser):
        assert sub.epilog and "example" in sub.epilog, f"{path}: no example"
        commands = [line.strip() for line in sub.epilog.splitlines() if line.startswith("  ")]
        assert commands, path
        for command in commands:
            argv = shlex.split(command.split("   ")[0])  # the top level's: command, a note
            assert argv[: len(path.split())] == path.split(), (path, command)
            args = parser.parse_args(argv[1:])  # raises SystemExit if the example is wrong
            assert args.command == argv[1]


def test_the_top_level_help_ends_with_three_examples():
    text = build_parser().format_help()
    assert text.rstrip().endswith(EXAMPLES.rstrip())
    tail = text.split("examples:\n", 1)[1].splitlines()
    assert len(tail) == 3 and all(line.startswith("  gptkiln ") for line in tail)


def test_every_trainconfig_field_carries_its_help_and_group():
    """A new field without `config.setting(...)` fails here (and makes build_parser fail)."""
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata.get("help"), f"TrainConfig.{f.name}: no help (use config.setting)"
        assert f.metadata.get("group") in TRAIN_GROUPS, f.name
        if f.default is None:
            assert f.metadata.get("unset"), f"TrainConfig.{f.name}: say what None means"


def test_each_trainconfig_field_is_a_flag_in_exactly_one_group_with_its_help():
    train = dict(parsers(build_parser()))["gptkiln train"]
    groups = {g.title: g for g in train._action_groups}
    assert [t for t in groups if t in TRAIN_GROUPS] == list(TRAIN_GROUPS)
    for f in dataclasses.fields(TrainConfig):
        holding = [
            title for title, g in groups.items() if any(a.dest == f.name for a in g._group_actions)
        ]
        assert holding == [f.metadata["group"]], (f.name, holding)
        action = next(a for a in train._actions if a.dest == f.name)
        assert action.help.startswith(f.metadata["help"]), f.name
        if f.default is None:
            assert action.help.endswith(f"(default: {f.metadata['unset']})")
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    flags = {a.dest for g in groups.values() for a in g._group_actions}
    assert flags - names == {"help", "config", "resume", "overwrite", "nproc"}


def test_the_flags_people_ask_about_say_their_choices():
    from gptkiln.tokenizers import DEFAULT_BPE_VOCAB_SIZE

    model = flag_help("gptkiln train", "--model")
    assert all(name in model for name in PRESETS) and f"(default: {TrainConfig.model})" in model
    for path in ("gptkiln train", "gptkiln prepare"):
        tokenizer = flag_help(path, "--tokenizer")
        assert "gpt2 (OpenAI's BPE) | char | bpe:N" in tokenizer
        assert f"bpe alone: {DEFAULT_BPE_VOCAB_SIZE}" in tokenizer
    sampling = flag_help("gptkiln train", "--sampling")
    assert "random = at seeded random offsets" in sampling and "windows = the book's" in sampling
    assert "(default: the preset's)" in flag_help("gptkiln train", "--context-length")
    assert "(default: off)" in flag_help("gptkiln train", "--tensorboard")
    assert "OUT/tensorboard/" in flag_help("gptkiln train", "--tensorboard")


@pytest.mark.parametrize("command", ["", "train", "generate", "info", "prepare", "perplexity"])
def test_help_prints_and_exits_0(command, capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args([*command.split(), "--help"])
    assert exit.value.code == 0
    assert "example" in capsys.readouterr().out
