"""`gptkiln judge`: a run's answers to its test entries, scored by a judge
(`gptkiln.finetune.judge`, the client), and the verdict written into the run.

The test entries are those of ``--data`` (instructions, DPO pairs, conversations) or the test
split of the data the run was fine-tuned on; the run answers them greedily, batched through
`gptkiln.api.complete`, and the judge is shown each prompt as the run's template writes it.

The verdict is written as the run answers (`answer_and_keep`) and as the judging goes
(`judge_and_keep`), so a judging stopped (Ctrl-C, a crash, a judge gone) keeps the run's
answers given and what was judged; the next judging of the run by the same judge keeps them
(`kept_entries`), has the run answer only the entries it had not, and asks only about the
entries that failed or were not asked, as lm-eval's ``--use_cache`` keeps a model's answers to
the requests it has seen; another judge keeps the run's answers and is asked about them all.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gptkiln.errors import GptkilnError
from gptkiln.finetune.judge import (
    REASONING,
    Entry,
    Judge,
    Verdict,
    check_judge,
    judge_entries,
)

JUDGEMENTS_FILE = "judgements.json"
NOT_ANSWERED = "not answered: the run's answering stopped before it"  # error until answered
NOT_ASKED = "not asked: the judging stopped before it"  # an entry's error until it is asked
SAVE_EVERY = 2.0  # seconds between writes of the verdict while the run answers, the judge too


# -- the run's answers ---------------------------------------------------------------------------
def test_entries(run_dir: Path, data: str | None) -> list[tuple[list[dict], str]]:
    """(the messages to answer, the correct output) of each test entry: ``data`` (instruction
    entries; preference pairs, whose chosen answer is the correct output; or conversations
    whose last message is the assistant's answer), else the test split of the data the run was
    fine-tuned on (`_test_split`)."""
    from gptkiln.finetune.data import conversation_of, read_instructions, read_records
    from gptkiln.finetune.runs import finetune_info
    from gptkiln.loading import read_config

    if data is None:
        return _test_split(run_dir, finetune_info(read_config(run_dir)) or {})
    first = _first_record(data)
    if str(data).endswith((".json", ".jsonl")) and "instruction" in first:
        return [(_instruction_messages(e), e["output"]) for e in read_instructions(data)]
    if "chosen" in first:  # DPO pairs, read as a dpo run reads them; "rejected" not needed
        return _prompt_and_chosen(data)
    out = []
    for where, record in read_records(data, "test entries"):
        messages, _ = conversation_of(where, record)
        if messages[-1]["role"] != "assistant" or len(messages) < 2:
            raise GptkilnError(f"{where}: the last message must be the assistant's (the answer)")
        out.append((messages[:-1], messages[-1]["content"]))
    return out


def _chosen(pairs) -> list[tuple[list[dict], str]]:
    """(the prompt, the chosen answer) of each preference pair: the judge's correct output."""
    return [(p.prompt, p.chosen) for p in pairs]


def _prompt_and_chosen(data: str) -> list[tuple[list[dict], str]]:
    """(the prompt, the chosen answer) of each record of a file of DPO pairs, read as a dpo run
    reads a pair (`preference_of`): the judge reads no rejected answer, so a record without
    one (``{prompt, chosen}``: a reference answer alone) is read with its chosen in its place."""
    from gptkiln.finetune.data import preference_of, read_records

    out = []
    for where, record in read_records(data, "test entries"):
        if isinstance(record, dict) and "chosen" in record and "rejected" not in record:
            record = {**record, "rejected": record["chosen"]}
        pair = preference_of(where, record)
        out.append((pair.prompt, pair.chosen))
    return out


def _test_split(run_dir: Path, info: dict) -> list[tuple[list[dict], str]]:
    """The test split of the data an instruct, chat or dpo run was fine-tuned on: instruct,
    each entry and its output; chat, each conversation up to its last assistant turn, which is
    the correct output; dpo, each prompt and its chosen answer. The split is of the examples
    the run kept (``info["dropped"]``: those too long for it)."""
    from gptkiln.finetune.data import read_conversations, read_instructions, read_preferences

    split, source = info.get("split") or {}, (info.get("config") or {}).get("data")
    task = info.get("task")
    if task not in ("instruct", "chat", "dpo") or not split.get("test") or source is None:
        raise GptkilnError(
            f"{run_dir} records no test split of instructions, conversations or pairs to "
            "judge; give the test entries with --data FILE"
        )
    source = _trained_data(run_dir, info, source)
    test = slice(split["train"], split["train"] + split["test"])
    dropped = set(info.get("dropped") or ())
    if task == "instruct":
        entries = [e for i, e in enumerate(read_instructions(source)) if i not in dropped]
        return [(_instruction_messages(e), e["output"]) for e in entries[test]]
    if task == "dpo":
        pairs = [p for i, p in enumerate(read_preferences(source)) if i not in dropped]
        return _chosen(pairs[test])
    conversations = read_conversations(source)[0]
    kept = [c for i, c in enumerate(conversations) if i not in dropped]
    out = []
    for messages in kept[test]:
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        out.append((messages[:last], messages[last]["content"]))
    return out


def _trained_data(run_dir: Path, info: dict, source: str) -> str:
    """The data file a run was fine-tuned on, as it was then: found as it was given (from the
    folder the run was made in: its ``data_path``, where recorded) and unchanged since (its
    SHA-256 is the run's ``data_sha256``), so its test split is the run's own."""
    from gptkiln.data import hub
    from gptkiln.finetune.data import data_digest

    if hub.is_hf_spec(source):
        return source
    recorded = info.get("data_path")  # absolute; the name as given is of the folder it ran in
    found = [p for p in dict.fromkeys((recorded, source)) if p is not None and Path(p).is_file()]
    if not found:
        raise GptkilnError(
            f"{run_dir} was fine-tuned on {recorded or source}, which is gone; restore it to "
            "judge the run's test split, or give test entries with --data FILE"
        )
    digest = info.get("data_sha256")
    same = next((p for p in found if digest is None or data_digest(p) == digest), None)
    if same is None:
        raise GptkilnError(
            f"{found[0]} has changed since {run_dir} was fine-tuned on it (its SHA-256 differs), "
            "so its test split is no longer the run's; restore it, or give test entries with "
            "--data FILE"
        )
    return same


def _first_record(path: str) -> dict:
    """The first record of a test-entries file, when it is an object (else {}), to tell its
    kind by its keys."""
    from gptkiln.finetune.data import read_records

    records = read_records(path, "test entries")
    return records[0][1] if records and isinstance(records[0][1], dict) else {}


ENTRY_KEY = "instruction_entry"
"""Where an instruction entry's message keeps its (instruction, input), for a prompt template."""


def _instruction_messages(entry: dict) -> list[dict]:
    """An instruction entry as one user message (for a chat template); the entry itself kept
    beside it (`ENTRY_KEY`), so a prompt template writes it as it was trained, even where its
    instruction holds a blank line."""
    content = f"{entry['instruction']}\n\n{entry['input']}" if entry.get("input") else None
    pair = (entry["instruction"], entry.get("input") or "")
    return [{"role": "user", "content": content or entry["instruction"], ENTRY_KEY: pair}]


def _instruction_entry(messages: list[dict]) -> tuple[str, str]:
    """(instruction, input) of `_instruction_messages`."""
    return messages[-1][ENTRY_KEY]


def answers(
    run_dir: Path,
    items: Sequence[tuple[list[dict], str]],
    *,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    device: str = "cpu",
    on_notice: Callable[[str], None] | None = None,
    kept: Sequence[Entry] | None = None,
    on_answered: Callable[[list[Entry]], None] | None = None,
    progress: bool = False,
) -> list[Entry]:
    """The run's greedy answer to each item, batched; the entries to judge (``input`` is each
    prompt as the run's template writes it, without the trailing response header; ``response``
    the answer after any ``<think>...</think>`` block, as a judge of a thinking model reads it;
    ``error`` `NOT_ASKED`, until the judge is). ``on_notice`` is told once how many prompts
    were longer than the run's context (the run answers from their end, as `gptkiln generate`
    does, while the judge is shown them whole).

    ``kept``: the entries of an answering that stopped (one an item, in order): those with a
    ``response`` are kept as they are and only the others answered (a greedy answer is the
    same alone as in any batch). ``on_answered(entries)`` is told the whole list after each
    batch, in the calling thread, an entry not answered yet with ``response`` None and error
    `NOT_ANSWERED`, so the answers can be kept as they come. ``progress``: a bar of the entries
    answered, the kept ones counted."""
    from tqdm.auto import tqdm

    from gptkiln.api import complete
    from gptkiln.chat_template import is_chat_template
    from gptkiln.config import SampleConfig
    from gptkiln.finetune.runs import require_template
    from gptkiln.loading import load_run

    if max_new_tokens < 1:
        raise GptkilnError(
            f"--max-new-tokens must be >= 1 (an answer to judge), got {max_new_tokens}"
        )
    if batch_size < 1:  # before the model loads
        raise GptkilnError(f"--batch-size must be a whole number >= 1, got {batch_size}")
    model, tokenizer, cfg = load_run(run_dir, device=device)
    template = require_template(cfg, run_dir)
    chat = is_chat_template(template)
    prompts = [_prompt(template, messages, chat) for messages, _ in items]
    entries = list(kept) if kept is not None else _unanswered(template, prompts, items, chat)
    todo = [i for i, e in enumerate(entries) if e.response is None]
    if not todo:
        return entries
    sample = SampleConfig(  # an answer is text, as gptkiln chat shows it: no special tokens
        max_new_tokens=max_new_tokens,
        temperature=0,
        stop=template.stop_strings(),
        skip_special_tokens=True,
    )
    bar = tqdm(
        total=len(entries),
        initial=len(entries) - len(todo),
        desc="answering",
        unit="entry",
        disable=not progress,
    )

    def answered(done) -> None:  # a batch's completions, each of the prompt todo[prompt_index]
        for c in done:
            _set_response(entries[todo[c.prompt_index]], c.text)
        bar.update(len(done))
        if on_answered is not None:
            on_answered(entries)

    notices: list[str] = []
    try:
        done = complete(
            model,
            [prompts[i] for i in todo],
            sample,
            tokenizer=tokenizer,
            batch_size=batch_size,
            templated=chat,
            on_notice=notices.append,
            on_batch=answered,
        )
    finally:
        bar.close()
    for i, c in zip(todo, done, strict=True):
        _set_response(entries[i], c.text)
    if on_notice is not None and (note := _cut_note(notices, todo, model)):
        on_notice(note)
    return entries


def _prompt(template, messages: list[dict], chat: bool) -> str:
    """The prompt the run answers: the messages in its chat template; an instruction entry in
    its prompt template, as it was trained."""
    from gptkiln.finetune.templates import format_messages, format_prompt

    if chat or len(messages) > 1 or ENTRY_KEY not in messages[-1]:
        plain = [{k: v for k, v in m.items() if k != ENTRY_KEY} for m in messages]
        return format_messages(template, plain)
    return format_prompt(template, *_instruction_entry(messages))


def _unanswered(template, prompts: list[str], items, chat: bool) -> list[Entry]:
    """An entry for each item, not answered yet: its input as the judge is shown it."""
    return [
        Entry(_shown_input(template, p, messages, chat), output, None, error=NOT_ANSWERED)
        for p, (messages, output) in zip(prompts, items, strict=True)
    ]


def _set_response(entry: Entry, text: str) -> None:
    """The run's answer as a reader gets it (a thinking model's reasoning block left out): the
    entry is answered, the judge not asked yet."""
    entry.response = REASONING.sub("", text, count=1).strip()
    entry.error = NOT_ASKED


_CUT = re.compile(r"prompt (\d+) has \d+ tokens, more than the model's context")  # api's


def _cut_note(notices: list[str], asked: list[int], model) -> str | None:
    """One line for `complete`'s notices of prompts cut to the context (one notice each;
    prompt k is entry ``asked[k - 1]``, counted from 0)."""
    cut = [int(m.group(1)) for m in map(_CUT.match, notices) if m]
    if not cut:
        return None
    ctx = model.config.context_length
    return (
        f"{len(cut)} of {len(asked)} test prompts are longer than the run's context of {ctx} "
        f"tokens (the first, entry {asked[cut[0] - 1] + 1}): the run answers each from its last "
        f"{ctx} tokens, while the judge is shown it whole"
    )


def _shown_input(template, prompt: str, messages: list[dict], chat: bool) -> str:
    """The prompt as the judge sees it: the book's ``format_input`` (the prompt template's
    text without its response header); with a chat template, the messages as plain lines."""
    if chat:
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages)
    return prompt.removesuffix(template.response).rstrip()


def judge_run(
    run_dir: str | os.PathLike,
    judge: Judge,
    *,
    data: str | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    device: str = "cpu",
    progress: bool = True,
    name: str | None = None,
    overwrite: bool = False,
    on_line: Callable[[str], None] | None = None,
) -> Verdict:
    """`gptkiln judge`: the run's answers to the test entries, scored by ``judge``; the
    verdict written into the run (``judgements.json``, or ``judgements-NAME.json``) as the
    judging goes (`judge_and_keep`), then its notes (`Verdict.notes`) told to ``on_line``.

    The verdict is written as the run answers, too (`answer_and_keep`). A verdict already
    there that was made the same way (`made_with`: the judge's URL, model, prompt and max
    tokens, the test entries, ``max_new_tokens``, the run's weights) is kept (`kept_entries`):
    the run answers only the entries it holds no answer to (it is not loaded when there are
    none), and only the entries that the judge gave no answer about are asked again.
    ``overwrite``: answer and judge every entry anew.

    Returns:
        The `Verdict` (entries with their answers, scores and errors; mean, scored, unparsed,
        failed).

    Raises:
        GptkilnError: bad settings or test entries; a judge that can answer no request
            (unreachable, a key refused, no such URL or model: found before the run answers,
            and nothing is written; or once the asking began: what was judged is kept); every
            request failed (the verdict is written first, the run's answers in it).
        KeyboardInterrupt: a stop, its words saying what is kept where.
    """
    _check_settings(max_new_tokens, batch_size, name)
    run_dir = Path(run_dir)
    items = test_entries(run_dir, data)
    if not items:
        raise GptkilnError(f"--data {data}: no test entries to judge")
    say = on_line or (lambda text: print(text, file=sys.stderr, flush=True))
    path = run_dir / (f"judgements-{name}.json" if name else JUDGEMENTS_FILE)
    made = made_with(run_dir, judge, items, data=data, max_new_tokens=max_new_tokens)
    entries = None if overwrite else kept_entries(path, made, len(items), say)
    if entries is None or any(e.response is None for e in entries):
        check_judge(judge)  # before the answering: a judge down, a key refused, no such model
        if entries is None:
            say(f"answering {len(items):,} test entries with {run_dir} ...")
        entries = answer_and_keep(
            run_dir,
            items,
            path,
            made,
            kept=entries,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            device=device,
            progress=progress,
            on_notice=lambda text: say(f"note: {text}"),
        )
    verdict = judge_and_keep(judge, entries, path, made, progress=progress)
    if verdict.failed == len(verdict.entries):
        raise GptkilnError(
            f"every one of the {verdict.failed} requests to the judge at {judge.url} failed; the "
            f"first: {verdict.entries[0].error}; the run's answers are kept in {path}"
        )
    for line in verdict.notes(path):
        say(f"note: {line}")
    return verdict


def _check_settings(max_new_tokens: int, batch_size: int, name: str | None) -> None:
    """`judge_run`'s settings, before anything is read."""
    if max_new_tokens < 1:
        raise GptkilnError(
            f"--max-new-tokens must be >= 1 (the answers judged), got {max_new_tokens}"
        )
    if batch_size < 1:  # before the answering is announced
        raise GptkilnError(f"--batch-size must be a whole number >= 1, got {batch_size}")
    if name is not None and not re.fullmatch(r"[\w.-]+", name):
        raise GptkilnError(
            f"--name {name!r}: the verdict goes to RUN/judgements-NAME.json, so give a plain "
            "name (letters, digits, '.', '_', '-'), e.g. --name gpt4o"
        )


# -- a verdict kept: reused by the next judging, written as the judging goes -------------------
ANSWER_SETTINGS = ("url", "model", "prompt", "max_tokens")
"""The judge's settings its answers depend on. The others (its key, timeout, retries, backoff,
concurrency) say how it is asked, so a judging that failed for them can be run again with
others and still keep what was judged."""


def made_with(
    run_dir: Path,
    judge: Judge,
    items: Sequence[tuple[list[dict], str]],
    *,
    data: str | None,
    max_new_tokens: int,
) -> dict[str, Any]:
    """What a verdict is made of, written at its top: the judge's settings (its key left out),
    the test entries (``data``: None for the run's test split; and the SHA-256 of the entries,
    wherever they came from), ``max_new_tokens`` and the run's weights (`weights_record`)."""
    digest = hashlib.sha256(json.dumps(items, sort_keys=True, default=str).encode()).hexdigest()
    return {
        "judge": {k: v for k, v in asdict(judge).items() if k != "key"},
        "data": data,
        "test_entries_sha256": digest,
        "max_new_tokens": max_new_tokens,
        "weights": weights_record(run_dir),
    }


def weights_record(run_dir: Path) -> dict[str, list[int]]:
    """The size and modification time (ns) of the run's config.json and of each weights file in
    it (``*.safetensors``, ``*.bin``), by name: a checkpoint saved again (trained further,
    replaced, converted) changes them, as the quick check of make and rsync tells a changed
    file. A copy of the run that did not keep the times counts as changed (judged anew)."""
    from gptkiln.loading.files import CONFIG_FILE

    names = [CONFIG_FILE] + sorted(
        p.name for p in run_dir.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file()
    )
    stats = {n: (run_dir / n).stat() for n in names if (run_dir / n).is_file()}
    return {n: [st.st_size, st.st_mtime_ns] for n, st in stats.items()}


def kept_entries(
    path: Path, made: dict[str, Any], n: int, say: Callable[[str], None]
) -> list[Entry] | None:
    """The entries of the verdict at ``path`` when it was made as this one is (``made``), each
    as it was, to answer those the run gave no answer to and judge those the judge gave no
    answer about; the run's answers alone, every entry to judge again, when only the judge
    differs (its URL, model, prompt or max tokens: the answers do not depend on it); else None
    (no such file, or answers made otherwise, which are replaced: a note says why)."""
    if not path.is_file():
        return None
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        entries = [Entry(**e) for e in old["per_entry"]]
        why = _why_not_kept(old, made, len(entries), n)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        entries, why = [], "it is not a verdict gptkiln reads"
    if why is not None:
        say(f"note: {path.name} is not reused ({why}): every entry is answered and judged anew")
        return None
    if changed := _judge_changed(old, made):
        for e in entries:  # judged anew; an entry the run gave no answer to stays unanswered
            e.answer, e.score = None, None
            e.error = NOT_ANSWERED if e.response is None else NOT_ASKED
        answered = sum(e.response is not None for e in entries)
        say(
            f"note: {path.name} was judged by another judge {changed}: the run's {answered} "
            f"answers in it are kept, and the judge asked about every entry anew"
        )
        return entries
    not_answered = sum(e.response is None for e in entries)
    not_asked = sum(e.error == NOT_ASKED or (e.answer is None and e.error is None) for e in entries)
    failed = sum(e.error not in (None, NOT_ASKED, NOT_ANSWERED) for e in entries)
    if not_answered:
        asked = not_answered + not_asked + failed
        say(
            f"note: {n - not_answered} of {n} answers kept from {path.name}; answering the other "
            f"{not_answered}, then asking the judge about "
            + (f"all {n}" if asked == n else f"the {asked} not judged")
        )
        return entries
    if not failed + not_asked:
        say(
            f"note: all {n} entries of {path.name} are judged: it is kept (--overwrite judges anew)"
        )
        return entries
    which = " or ".join(w for w, k in (("failed", failed), ("were not asked", not_asked)) if k)
    say(
        f"note: {n - failed - not_asked} of {n} entries kept from {path.name}; asking the judge "
        f"about the {failed + not_asked} that {which} (with the run's answers kept there)"
    )
    return entries


_SETTING_NAMES = {"url": "URL", "model": "model", "prompt": "prompt", "max_tokens": "max tokens"}


def _why_not_kept(old: dict, made: dict[str, Any], kept: int, n: int) -> str | None:
    """Why the run's answers in the verdict ``old`` (``kept`` entries) cannot be kept by a
    judging ``made`` so (of ``n`` entries), or None."""
    if any(k not in old for k in ("test_entries_sha256", "max_new_tokens", "weights")):
        return "it records no settings to compare: an older gptkiln wrote it"
    if old["test_entries_sha256"] != made["test_entries_sha256"] or kept != n:
        return "it was made of other test entries"
    if old["max_new_tokens"] != made["max_new_tokens"]:
        return (
            f"the run's answers in it are of up to {old['max_new_tokens']} tokens, not "
            f"{made['max_new_tokens']}"
        )
    if old["weights"] != made["weights"]:
        return "the run's weights changed since: a weights file or config.json is not the same"
    return None


def _judge_changed(old: dict, made: dict[str, Any]) -> str:
    """The judge's settings (`ANSWER_SETTINGS`) the verdict ``old`` was judged with otherwise
    than ``made``, in words ("model and prompt"); "" when none."""
    then, now = old.get("judge") or {}, made["judge"]
    return " and ".join(_SETTING_NAMES[k] for k in ANSWER_SETTINGS if then.get(k) != now[k])


def answer_and_keep(
    run_dir: Path,
    items: Sequence[tuple[list[dict], str]],
    path: Path,
    made: dict[str, Any],
    *,
    kept: list[Entry] | None = None,
    **settings,
) -> list[Entry]:
    """`answers` (``settings``: its own), the verdict written to ``path`` (with ``made`` at its
    top) as they come: after a batch, at most every `SAVE_EVERY` seconds, and at a stop (Ctrl-C,
    an error: a stop's words say what is kept), so that the next judging has the run answer
    the rest only (``kept``: the entries of a verdict that holds some answers)."""
    keeper = _Keeper(path, made, kept)
    try:
        return answers(run_dir, items, kept=kept, on_answered=keeper.changed, **settings)
    except BaseException as error:
        if keeper.dirty:
            keeper.write()
        n, done = len(items), sum(e.response is not None for e in keeper.entries or ())
        if not done or not isinstance(error, (KeyboardInterrupt, GptkilnError)):
            raise
        said = (
            f"the run's answers to {done} of {n} entries are kept in {path}: the same command "
            f"answers the other {n - done}"
        )
        if isinstance(error, KeyboardInterrupt):  # the CLI says "interrupted" + this
            raise KeyboardInterrupt(f"while answering; {said}") from None
        raise GptkilnError(f"{error}; {said}") from None


def judge_and_keep(
    judge: Judge, entries: list[Entry], path: Path, made: dict[str, Any], progress: bool = True
) -> Verdict:
    """The judge asked about each entry it gave no answer about yet (one not asked, or whose
    request failed), the verdict written to ``path`` (with ``made`` at its top) before the
    asking, every `SAVE_EVERY` seconds during it and at its end or stop (Ctrl-C, a judge gone:
    the error says what is kept), so that the next judging asks about the rest only."""
    verdict = Verdict(entries)
    todo = [e for e in entries if e.answer is None or e.error is not None]
    if not todo:
        return verdict
    for entry in todo:
        entry.error = entry.error or NOT_ASKED
    keeper = _Keeper(path, made, entries)
    keeper.write()
    try:
        judge_entries(
            judge,
            todo,
            progress=progress,
            on_judged=keeper.changed,
            kept=len(entries) - len(todo),
        )
    except BaseException as e:
        keeper.write()
        if isinstance(e, (KeyboardInterrupt, GptkilnError)):
            raise _stopped(e, verdict, path) from None
        raise
    keeper.write()
    return verdict


class _Keeper:
    """The verdict at ``path`` (``made`` at its top, then ``entries``) written (atomically) as
    its entries change: `changed` writes it when `SAVE_EVERY` seconds have passed since the
    last write (or since the keeper began), `write` at once."""

    def __init__(self, path: Path, made: dict[str, Any], entries: list[Entry] | None) -> None:
        self.path, self.made, self.entries = path, made, entries
        self.written, self.dirty = time.monotonic(), False

    def changed(self, entries: list[Entry] | None = None) -> None:
        self.entries = self.entries if entries is None else entries
        self.dirty = True
        if time.monotonic() - self.written >= SAVE_EVERY:
            self.write()

    def write(self) -> None:
        from gptkiln.checkpoint import write_json

        per_entry = [asdict(e) for e in self.entries]
        summary = Verdict(self.entries).summary()
        write_json(self.path, {**self.made, **summary, "per_entry": per_entry})
        self.written, self.dirty = time.monotonic(), False


def _stopped(error: BaseException, verdict: Verdict, path: Path) -> BaseException:
    """``error`` (Ctrl-C, a judge that stopped answering), saying what is kept where."""
    n, left = len(verdict.entries), verdict.failed
    kept = (
        f"the judge's answers about {n - left} of {n} entries are kept in {path}: the same "
        f"command asks it about the other {left}"
    )
    if isinstance(error, KeyboardInterrupt):  # the CLI says "interrupted" + this
        return KeyboardInterrupt(f"while judging; {kept}")
    return GptkilnError(f"{error}; {kept}")
