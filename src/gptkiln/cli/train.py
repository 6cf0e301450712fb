"""``gptkiln train``: one flag per `TrainConfig` field, a YAML recipe under them, and
``--nproc N`` to relaunch the same command under torchrun (`gptkiln.train.train` does the work).

Settings are chosen in layers: `TrainConfig`'s defaults, then the recipe (``--config``), then the
flags given; `train_config_from_args` is that choice, for tests and scripts too.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from pathlib import Path
from typing import Any

from gptkiln.cli.common import (
    add_overwrite_flag,
    example,
    keep_freed_memory_on_cpu,
    recorded_settings,
)
from gptkiln.config import TRAIN_GROUPS, TrainConfig
from gptkiln.config.recipes import RECIPES_DIR, load_recipe
from gptkiln.errors import GptkilnError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (no flags: a small model on Shakespeare)",
        description="Train a GPT. Settings come from the defaults, then --config, then flags; "
        "every flag is also a key of a YAML recipe (max_steps: 600).",
        epilog=example(
            "gptkiln train --data data/plays-char --model baby --max-steps 600 --out runs/char"
        ),
    )
    p.add_argument(
        "--config",
        metavar="RECIPE",
        help="a YAML recipe file, or a bundled recipe: "
        f"{' | '.join(sorted(r.stem for r in RECIPES_DIR.glob('*.yaml')))} "
        "(default: none, the defaults below)",
    )
    groups = add_train_flags(p)
    groups["checkpoints"].add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its checkpoint, with its recorded settings for "
        "every flag not given (none unsets one that can be unset: --max-time none)",
    )
    add_overwrite_flag(groups["checkpoints"], help="start afresh over a run already in --out")
    groups["hardware"].add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="train with N processes on this machine, launched through torchrun (>= 1; "
        "default: this process alone)",
    )
    p.set_defaults(func=run)


# What a flag's value is called in train's help: by its field, else by its type.
_FIELD_METAVARS = {
    "data": "PATH",
    "out": "DIR",
    "model": "PRESET",
    "tokenizer": "SPEC",
    "device": "DEVICE",
    "gelu": "KIND",
    "max_time": "MINUTES",
    "text_field": "NAME",
    "eval_tasks": "NAME[,NAME...]",
    "eval_tasks_limit": "N",
    "eval_tasks_include_path": "DIR",
}
_TYPE_METAVARS = {int: "N", float: "X", str: "TEXT"}


def add_train_flags(p: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """One flag per `TrainConfig` field (``max_steps`` -> ``--max-steps``), in the argument group
    the field names, with the help the field carries and its default. Returns the groups by
    name, for the flags of the command itself."""
    groups = {name: p.add_argument_group(name) for name in TRAIN_GROUPS}
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        help = f"{f.metadata.get('help', '')} (default: {_shown_default(f)})".lstrip()
        kind, choices, metavar = flag_shape(f.name, hints)
        group = groups.get(f.metadata.get("group"), p)  # tests hold every field to a group
        if kind is bool:
            action = argparse.BooleanOptionalAction
            group.add_argument(flag, action=action, default=argparse.SUPPRESS, help=help)
        else:
            optional = type(None) in typing.get_args(hints[f.name])
            group.add_argument(
                flag,
                type=_or_none(kind) if optional else kind,
                choices=choices,
                default=argparse.SUPPRESS,
                metavar=metavar,
                help=help,
            )
    return groups


def _or_none(kind: type):
    """The flag type of a setting that may be unset: ``none`` is None (so that a resume can drop
    a recorded ``--max-time``), anything else ``kind`` (whose name argparse's errors show)."""

    def convert(text: str):
        return None if text.lower() == "none" else kind(text)

    convert.__name__ = kind.__name__
    return convert


def flag_shape(name: str, hints: dict[str, Any] | None = None) -> tuple[type, list | None, Any]:
    """(type, choices or None, metavar) of the flag of `TrainConfig` field ``name``: what
    ``train`` and ``finetune`` (its loop's flags) both show."""
    hints = hints or typing.get_type_hints(TrainConfig)
    kind, choices = _flag_type(hints[name])
    if kind is bool or choices:
        return kind, choices, None
    return kind, choices, _FIELD_METAVARS.get(name, _TYPE_METAVARS[kind])


def _flag_type(hint: Any) -> tuple[type, list | None]:
    """(the type argparse converts to, the choices or None) of a field's type hint."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return type(args[0]), list(args)
    if args:  # X | None
        return _flag_type(args[0])
    return hint, None


def _shown_default(f: dataclasses.Field) -> str:
    """A field's default as help shows it: what "not set" means for None, on/off for a bool."""
    if f.default is None:
        return f.metadata.get("unset") or "not set"
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return str(f.default)


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the recipe (--config), then the flags given on the command line."""
    return _chosen_config(args)[0]


def _chosen_config(args: argparse.Namespace) -> tuple[TrainConfig, dict[str, str]]:
    """The `TrainConfig` of `train_config_from_args`, and where each setting a person chose came
    from: ``"run"`` (on ``--resume``, what the run recorded), ``"recipe"`` or ``"flag"``, each
    over the one before it."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    recipe = load_recipe(args.config) if getattr(args, "config", None) else {}
    flags = {k: v for k, v in vars(args).items() if k in names}
    recorded = {}
    if getattr(args, "resume", False):  # the run's own settings, where none is given
        out = flags.get("out", recipe.get("out", TrainConfig.out))
        recorded = recorded_settings(out, names)
        named = recipe.get("data")
        if "data" in recorded and named and not _here(named):  # a recipe's text, not here:
            recipe = {k: v for k, v in recipe.items() if k != "data"}  # the run's own goes on
        if flags.get("eval_tasks", "") is None:  # --eval-tasks none: their settings go too
            for name in ("eval_tasks_interval", "eval_tasks_limit", "eval_tasks_include_path"):
                recorded.pop(name, None)
    values = {**recorded, **recipe, **flags}
    include = {**recipe, **flags}.get("eval_tasks_include_path")
    if include:  # recorded as found from here, for a resume from anywhere
        values["eval_tasks_include_path"] = str(Path(include).expanduser().resolve())
    given = {
        **dict.fromkeys(recorded, "run"),
        **dict.fromkeys(recipe, "recipe"),
        **dict.fromkeys(flags, "flag"),
    }
    try:
        return TrainConfig.from_dict(values), given
    except GptkilnError as e:
        used = {k: v for k, v in recorded.items() if k not in recipe and k not in flags}
        try:  # the record's values used, alone: the file is blamed for its own faults only
            TrainConfig.from_dict(used)
        except GptkilnError as bad:
            raise GptkilnError(
                f"{Path(out) / 'config.json'}: its record of the run's settings does not hold "
                f"({str(bad).removeprefix('training config: ')}); give that flag, or mend the "
                "file"
            ) from None
        raise e from None


def _here(data: str) -> bool:
    """Whether a recipe's ``data`` is found from here: a path that exists, or a source that is
    not a path (``hf:NAME``, the bundled ``shakespeare``)."""
    return str(data).startswith("hf:") or data == "shakespeare" or Path(data).exists()


def check_prepared_data_agrees(cfg: TrainConfig, given: dict[str, str], recipe: str | None):
    """Prepared data has its tokenizer, its split and the field its text came from already, and
    training keeps them (`gptkiln.train.agreement`). A ``--tokenizer``, ``--val-fraction`` or
    ``--text-field`` flag that contradicts them would be ignored, so it is refused; a recipe's
    (made for preparing raw text) gets a note on stderr, and the data's value."""
    import shlex

    from gptkiln.data.prepare import is_prepared, read_meta
    from gptkiln.train.agreement import prepared_clashes

    meta = read_meta(cfg.data) if is_prepared(cfg.data) else None
    if meta is None:  # text to prepare, or damaged data: loading it names what is wrong
        return
    clashes = [c for c in prepared_clashes(cfg, meta) if c[0] in given]
    flags = [c for c in clashes if given[c[0]] == "flag"]
    if flags:
        names = " and ".join("--" + name.replace("_", "-") for name, _, _ in flags)
        asked = " ".join(f"--{name.replace('_', '-')} {getattr(cfg, name)}" for name, _, _ in flags)
        source = shlex.quote(str(meta["source"])) if meta.get("source") else "TEXT"
        raise GptkilnError(
            f"{asked}: --data {cfg.data} was {' and '.join(has for _, has, _ in flags)}, which "
            f"training keeps; drop {names} to train on it as it is, or prepare the text again: "
            f"gptkiln prepare {source} {asked} --out NEW_DIR"
        )
    for name, has, value in clashes:
        if given[name] == "recipe" and os.environ.get("RANK", "0") == "0":
            print(
                f"note: --config {recipe} sets {name}: {getattr(cfg, name)}, but --data "
                f"{cfg.data} was {has}, which training keeps",
                file=sys.stderr,
            )
        setattr(cfg, name, value)


def check_recipe_data(cfg: TrainConfig, given: dict[str, str], recipe: str | None) -> None:
    """A recipe that names its text (``book-verdict``: the book's the-verdict.txt, which gptkiln
    does not ship) where that text is not: said in the recipe's words, with where its notes are,
    rather than as a ``--data`` nobody typed."""
    from gptkiln.config.recipes import recipe_path
    from gptkiln.data.mixture import check_source
    from gptkiln.data.prepare import is_prepared

    if given.get("data") != "recipe" or is_prepared(cfg.data) or str(cfg.data).startswith("hf:"):
        return
    try:
        check_source(cfg.data, text_field=cfg.text_field)
    except GptkilnError as e:
        where = f"which is not in {Path.cwd()}" if not Path(cfg.data).exists() else f"({e})"
        raise GptkilnError(
            f"--config {recipe} trains on {cfg.data}, {where}: put it there or give --data "
            f"PATH (the recipe's notes, {recipe_path(recipe)}, say where its text comes from)"
        ) from None


def check_flags_act(cfg: TrainConfig, given: dict[str, str]) -> None:
    """A flag that would do nothing under the run's other choices (``--adamw-lr`` with
    ``--optimizer adamw``, ``--cooldown`` with ``--schedule cosine``) is refused rather than
    ignored. A recipe's setting for the other choice stays quiet, and goes back to its default
    (it does nothing; `gptkiln.train.agreement` refuses one set from Python)."""
    from gptkiln.train.agreement import FLAG_ONLY_WITH, ONLY_WITH, default_of

    if given.get("epochs") == "flag" and given.get("max_steps") != "flag":
        cfg.max_steps = 0  # --epochs N alone: the epochs decide (max_steps 0)
    for name, choice, value in ONLY_WITH + FLAG_ONLY_WITH:
        if getattr(cfg, choice) == value or name not in given:
            continue
        if given[name] != "flag" and (name, choice, value) in FLAG_ONLY_WITH:
            continue  # a recipe's idle min_lr or epochs: harmless where it is (its default may
            # not be: min_lr 1e-4 is past a constant lr of 5e-5)
        if given[name] == "flag":
            flag = "--" + name.replace("_", "-")
            wanted, now = _flag_of(choice, value), _flag_of(choice, getattr(cfg, choice))
            raise GptkilnError(
                f"{flag} acts only with {wanted}, and this run has {now}; drop {flag}, or train "
                f"with {wanted}"
            )
        setattr(cfg, name, default_of(name))


def _flag_of(name: str, value) -> str:
    """A setting's value as its flag reads: ``--sampling windows``, ``--decay-lr`` or
    ``--no-decay-lr`` for a switch."""
    flag = name.replace("_", "-")
    if isinstance(value, bool):
        return f"--{flag}" if value else f"--no-{flag}"
    return f"--{flag} {value}"


def run(args: argparse.Namespace) -> None:
    cfg, given = _chosen_config(args)
    check_flags_act(cfg, given)
    check_recipe_data(cfg, given, args.config)
    check_prepared_data_agrees(cfg, given, args.config)
    if args.nproc is not None:
        _check_before_launch(cfg, args)
        return launch_torchrun(args.nproc, args.argv)
    from gptkiln.train import train

    keep_freed_memory_on_cpu(cfg.device)
    result = train(cfg, resume=args.resume, overwrite=args.overwrite)
    if result.val_loss is not None and int(os.environ.get("RANK", 0)) == 0:
        print(
            f"done: {result.steps} steps, {result.tokens_seen:,} tokens; "
            f"train loss {result.train_loss:.3f}, val loss {result.val_loss:.3f} "
            f"({result.val_bpc:.3f} bits/char); "
            f"run saved in {result.run_dir}"
        )


def _check_before_launch(cfg: TrainConfig, args: argparse.Namespace) -> None:
    """What every worker would refuse, refused once here: one line instead of N tracebacks in
    torchrun's report."""
    from gptkiln.data.mixture import check_source
    from gptkiln.data.prepare import is_prepared
    from gptkiln.run_guard import check_run_dir_for_training

    if not is_prepared(cfg.data):
        check_source(cfg.data, text_field=cfg.text_field)
    check_run_dir_for_training(Path(cfg.out), resume=args.resume, overwrite=args.overwrite)


def launch_torchrun(nproc: int, argv: list[str]) -> None:
    """Re-run a train command line (``argv``, without the program: ``["train", ...]``) under
    torchrun with ``nproc`` processes on this machine, its ``--nproc`` left out."""
    if nproc < 1:
        raise GptkilnError(f"--nproc must be >= 1, got {nproc}")
    rest, skip = [], False
    for a in argv:  # drop --nproc N / --nproc=N, keep everything else as given
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    from gptkiln.launch import launch

    raise SystemExit(launch(nproc, rest))
