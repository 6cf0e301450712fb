"""``gptkiln judge`` (the book's section 7.8): a run's answers scored by a judge behind an
OpenAI-compatible endpoint. A fake endpoint that answers known numbers checks the mean exactly,
the unparsed answers counted and kept, the retries and the one-line failures; ``gptkiln serve``
of another run as the judge (a tiny model: its answers are noise) shows that noise is counted,
kept and never fatal."""

from __future__ import annotations

import json
import re
import string
import time
from pathlib import Path

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from instruction_data import instructions
from serving import ServerThread, free_port
from test_cli import assert_one_line_error, cli

from gptkiln.checkpoint import save_model
from gptkiln.config import FinetuneConfig, GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.finetune import finetune, train_config
from gptkiln.finetune.judge import BOOK_PROMPT, Judge, parse_score
from gptkiln.finetune.judging import judge_run
from gptkiln.model import GPT
from gptkiln.sampling import generate_stream
from gptkiln.tokenizers import build_char_tokenizer

CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"
ANSWERS = ["90", "70", "I would rather not say.", "85/100", " 42 ", "101"]
SCORES = [90, 70, None, 85, 42, None]  # what each answer counts as: 101 is out of range


def fake_answer(output: str) -> str:
    """What the fake judge answers for an entry, from its correct output."""
    return ANSWERS[len(output) % len(ANSWERS)]


def fake_judge(failures: dict[str, int] | None = None, replies: dict | None = None):
    """An OpenAI-compatible app whose answer is `fake_answer` of the question's correct output;
    ``failures``: how many 503s each output gets before its answer; ``replies``: the reply
    (status, JSON or raw bytes) some outputs get instead ("*": every output). Its
    ``/auth/v1`` refuses every key; any other path is FastAPI's 404."""
    app = FastAPI()
    app.state.questions = []
    left = dict(failures or {})
    replies = replies or {}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        question = body["messages"][0]["content"]
        app.state.questions.append((question, request.headers.get("authorization")))
        output = re.search(r"correct output `(.*?)`, score", question, re.S).group(1)
        if left.get(output, 0) > 0:
            left[output] -= 1
            return JSONResponse({"error": "busy"}, status_code=503)
        if output in replies or "*" in replies:
            status, content = replies.get(output) or replies["*"]
            if isinstance(content, bytes):
                return Response(content, status_code=status, media_type="text/html")
            return JSONResponse(content, status_code=status)
        message = {"role": "assistant", "content": fake_answer(output)}
        return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}

    @app.post("/nonsense/chat/completions")
    async def nonsense():
        return {"hello": "world"}

    @app.post("/auth/v1/chat/completions")
    async def auth():
        return JSONResponse({"error": {"message": "Incorrect API key provided"}}, status_code=401)

    return app


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny instruction-tuned run (a few steps: its answers are noise) with a test split."""
    root = tmp_path_factory.mktemp("judge")
    tokenizer = build_char_tokenizer([CHARS], with_eot=True)
    torch.manual_seed(0)
    config = GPTConfig.from_name("tiny", vocab_size=tokenizer.vocab_size, context_length=512)
    save_model(GPT(config), root / "base", tokenizer=tokenizer)
    (root / "instructions.json").write_text(json.dumps(instructions(40)))
    ft = FinetuneConfig(base=str(root / "base"), data=str(root / "instructions.json"))
    settings = dict(batch_size=4, progress=False, precision="fp32", sample_interval=100)
    finetune(ft, train_config(ft, out=str(root / "run"), max_steps=2, **settings))
    return root / "run"


@pytest.fixture(scope="module")
def fake():
    app = fake_judge()
    with ServerThread(app) as url:
        yield url, app


def test_the_mean_is_that_of_the_numbers_and_other_answers_are_counted_and_kept(
    run, fake, capsys, monkeypatch, tmp_path
):
    url, app = fake
    monkeypatch.setenv("JUDGE_KEY", "sesame")
    test_split = [  # outputs of 1 to 6 letters: each of the fake judge's answers once
        {"instruction": f"Say {w}.", "input": "" if i % 2 else "loud", "output": w}
        for i, w in enumerate(["a", "bb", "ccc", "dddd", "eeeee", "ffffff"])
    ]
    data = tmp_path / "test.json"
    data.write_text(json.dumps(test_split))
    code, out, err = cli(
        "judge", run, "--data", data, "--judge-url", f"{url}/v1", "--judge-model", "fake",
        "--judge-key-env", "JUDGE_KEY", "--max-new-tokens", 6, "--json", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    expected = [SCORES[ANSWERS.index(fake_answer(e["output"]))] for e in test_split]
    scores = [s for s in expected if s is not None]
    last = json.loads(out.strip().splitlines()[-1])
    assert last == {
        "mean": sum(scores) / len(scores),
        "scored": len(scores),
        "unparsed": len(expected) - len(scores),
        "failed": 0,
        "entries": 6,
    }
    assert last["scored"] == 4 and last["unparsed"] == 2 and last["mean"] == 71.75
    saved = json.loads((run / "judgements.json").read_text())
    assert [e["output"] for e in saved["per_entry"]] == [e["output"] for e in test_split]
    assert [e["answer"] for e in saved["per_entry"]] == [
        fake_answer(e["output"]) for e in test_split
    ]
    assert saved["mean"] == last["mean"] and "key" not in saved["judge"]
    question, auth = app.state.questions[-1]
    assert auth == "Bearer sesame"
    assert question.startswith("Given the input `Below is an instruction")  # the book's input
    assert "### Response:" not in question  # format_input: no response header


def test_scores_parse_numbers_in_range_only():
    assert [parse_score(a) for a in ANSWERS] == SCORES
    assert parse_score("85.5") == 85.5 and parse_score("Score: 85") is None
    assert parse_score("<think>\n\n</think>\n\n85") == 85  # Qwen3 as the judge
    assert parse_score("<think>It is 90.</think> nope") is None


def test_a_placeholders_name_inside_an_entry_stays_that_text():
    judge = Judge("http://localhost:1/v1", "m", prompt="Q: {input}\nA: {output}\nR: {response}")
    asked = judge.question('Explain "{output}" and {response}.', "the answer", "{input}")
    assert asked == 'Q: Explain "{output}" and {response}.\nA: the answer\nR: {input}'
    from gptkiln.errors import GptkilnError

    with pytest.raises(GptkilnError, match="--max-new-tokens must be >= 1"):
        judge_run("no-such-run", judge, max_new_tokens=0)  # before anything is read


@pytest.mark.parametrize("name", ["../../config", "a/b", "", "x y"])
def test_a_name_that_is_not_a_plain_name_is_refused_before_anything_is_read(name):
    """--name makes judgements-NAME.json: a path in it wrote over the run's config.json."""
    from gptkiln.errors import GptkilnError

    with pytest.raises(GptkilnError, match="give a plain name"):
        judge_run("no-such-run", Judge("http://localhost:1/v1", "m"), name=name)


@pytest.mark.parametrize(
    "settings, needle",
    [(dict(timeout=float("nan")), "--timeout a number > 0"), (dict(max_tokens=0), ">= 1")],
)
def test_a_timeout_not_a_number_or_no_room_for_the_score_is_refused(settings, needle):
    from gptkiln.errors import GptkilnError

    with pytest.raises(GptkilnError, match=needle):
        Judge("http://localhost:1/v1", "m", **settings)


def test_a_busy_judge_is_retried_with_backoff(run, tmp_path):
    outputs = [e["output"] for e in instructions(40)[34:38]]
    app = fake_judge(failures={outputs[0]: 2})
    data = tmp_path / "test.json"
    data.write_text(json.dumps(instructions(40)[34:38]))
    with ServerThread(app) as url:
        judge = Judge(url=f"{url}/v1", model="fake", backoff=0.01, retries=2, concurrency=2)
        verdict = judge_run(run, judge, data=str(data), max_new_tokens=4, progress=False)
    assert len(app.state.questions) == 1 + 4 + 2 and len(verdict.entries) == 4  # the check first
    assert verdict.entries[0].answer == fake_answer(outputs[0])


def test_an_unreachable_judge_or_one_that_refuses_the_key_or_url_is_one_line_and_writes_nothing(
    run, fake, capsys, monkeypatch
):
    """Every request would fail the same way: the judge is asked once before the run answers
    anything (`check_judge`), and that is one line that says what to fix (not always "the
    key")."""
    url, _ = fake
    monkeypatch.setenv("JUDGE_KEY", "wrong")
    (run / "judgements-x.json").unlink(missing_ok=True)
    for judge_url, key, needle in (
        (f"http://127.0.0.1:{free_port()}/v1", None, "did not answer after 1 attempt ("),
        ("localhost:1/v1", None, "http:// or https://"),
        (f"{url}/auth/v1", None, "(HTTP 401: 'Incorrect API key provided'); no key was sent"),
        (f"{url}/auth/v1", "JUDGE_KEY", "refused the key (HTTP 401"),
        (url, None, "HTTP 404: 'Not Found'); check --judge-url: OpenAI-compatible base URLs end "
         "in /v1, e.g. http://localhost:11434/v1"),
        (f"{url}/v1/chat/completions", None, "without /chat/completions"),
        (f"{url}/elsewhere/v1", None, "check --judge-url and --judge-model ('m': served there?)"),
    ):  # fmt: skip
        key = ["--judge-key-env", key] if key else []
        code, _, err = cli(
            "judge", run, "--judge-url", judge_url, "--judge-model", "m", "--retries", 0,
            "--max-new-tokens", 2, "--name", "x", *key, capsys=capsys,
        )  # fmt: skip
        assert code == 2 and "Traceback" not in err, err
        assert needle in err and len(err.strip().splitlines()) == 1, err  # before answering
        assert "check --judge-model and the key" not in err
        assert not (run / "judgements-x.json").exists()


def test_a_request_that_fails_for_its_entry_is_that_entrys_and_the_others_go_on(
    run, tmp_path, capsys
):
    """A 400 (a question past the judge's context), a reply that is not JSON and one with no
    choices: each is its entry's failure, kept with its reason; the others are judged."""
    test_split = [
        {"instruction": f"Say {w}.", "input": "", "output": w}
        for w in ["a", "bb", "ccc", "dddd", "eeeee", "ffffff"]
    ]
    data = tmp_path / "test.json"
    data.write_text(json.dumps(test_split))
    too_long = {"error": {"message": "This model's maximum context length is 8192 tokens"}}
    app = fake_judge(
        replies={"a": (400, too_long), "dddd": (200, b"<html>hello</html>"),
                 "eeeee": (200, {"choices": []})}
    )  # fmt: skip
    with ServerThread(app) as url:
        code, out, err = cli(
            "judge", run, "--data", data, "--judge-url", f"{url}/v1", "--judge-model", "fake",
            "--max-new-tokens", 2, "--name", "partly", "--json", capsys=capsys,
        )  # fmt: skip
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[-2].endswith("(1 unparsed answers kept, 3 requests failed)")
    # ccc (85/100) and ffffff (90) scored; bb ("I would rather not say.") unparsed
    assert json.loads(lines[-1]) == {
        "mean": 87.5, "scored": 2, "unparsed": 1, "failed": 3, "entries": 6
    }  # fmt: skip
    saved = json.loads((run / "judgements-partly.json").read_text())
    per_entry = saved["per_entry"]
    assert [e["error"] is None for e in per_entry] == [False, True, True, False, False, True]
    assert (
        'HTTP 400: "This model\'s maximum context length is 8192 tokens"' in per_entry[0]["error"]
    )
    assert "'<html>hello</html>', not an OpenAI chat completion" in per_entry[3]["error"]
    assert per_entry[4]["error"].startswith("the judge answered '{\"choices\":[]}'")
    assert [e["response"] is not None for e in per_entry] == [True] * 6  # the answers are kept
    assert per_entry[0]["score"] is None and per_entry[0]["answer"] is None
    assert saved["failed"] == 3 and saved["mean"] == 87.5
    assert (
        f"note: 3 of 6 judge requests failed: their score is null, the reason kept in {run}" in err
    )
    assert "the first, entry 1: the judge refused the request (HTTP 400: " in err


def test_every_request_failing_is_one_line_and_the_answers_are_kept(run, tmp_path, capsys):
    """Every request refused, or a URL that answers no chat completion: exit 2 in one line,
    and the run's answers are written with each reason."""
    too_long = {"error": {"message": "context length exceeded"}}
    for name, replies, judge_path, needle in (
        ("refused", {"*": (400, too_long)}, "/v1", "(HTTP 400: 'context length exceeded')"),
        ("nonsense", {}, "/nonsense", "not an OpenAI chat completion"),
    ):
        with ServerThread(fake_judge(replies=replies)) as url:
            code, _, err = cli(
                "judge", run, "--judge-url", f"{url}{judge_path}", "--judge-model", "m",
                "--max-new-tokens", 2, "--name", name, capsys=capsys,
            )  # fmt: skip
        assert code == 2 and "Traceback" not in err, err
        last = err.strip().splitlines()[-1]
        assert last.startswith(
            "gptkiln judge: error: every one of the 4 requests to the judge at "
        ), err
        assert needle in last and f"the run's answers are kept in {run}" in last
        saved = json.loads((run / f"judgements-{name}.json").read_text())
        assert saved["failed"] == 4 and saved["mean"] is None
        assert all(e["response"] is not None and e["error"] for e in saved["per_entry"])


def six_entries(tmp_path) -> Path:
    """Test entries whose outputs are 1 to 6 letters: each of the fake judge's answers once."""
    test_split = [
        {"instruction": f"Say {w}.", "input": "", "output": w}
        for w in ["a", "bb", "ccc", "dddd", "eeeee", "ffffff"]
    ]
    data = tmp_path / "six.json"
    data.write_text(json.dumps(test_split))
    return data


def judge_six(run, data, url, capsys, *more):
    """``gptkiln judge`` of the six entries with the fake judge at ``url``, into
    judgements-six.json: (exit code, stdout, stderr)."""
    return cli(
        "judge", run, "--data", data, "--judge-url", f"{url}/v1", "--judge-model", "fake",
        "--max-new-tokens", 2, "--name", "six", "--concurrency", 1, *more, capsys=capsys,
    )  # fmt: skip


def test_a_second_judging_asks_only_about_the_entries_that_failed(
    run, tmp_path, capsys, monkeypatch
):
    """The verdict of the same judge, test entries, --max-new-tokens and weights is kept: the
    judge is asked about the failed entries alone, with the run's answers kept (the run does
    not answer again)."""
    import gptkiln.finetune.judging

    data = six_entries(tmp_path)
    too_long = {"error": {"message": "context length exceeded"}}
    replies = {"a": (400, too_long), "ccc": (400, too_long)}
    app = fake_judge(replies=replies)
    with ServerThread(app) as url:
        code, _, err = judge_six(run, data, url, capsys, "--overwrite")
        assert code == 0 and len(app.state.questions) == 1 + 6, err
        first = json.loads((run / "judgements-six.json").read_text())
        assert first["failed"] == 2
        replies.clear()  # the judge answers them now
        monkeypatch.setattr(gptkiln.finetune.judging, "answers", None)  # the run is not asked
        code, out, err = judge_six(run, data, url, capsys, "--json")
    assert code == 0, err
    assert len(app.state.questions) == 1 + 6 + 2  # the two that failed, no check first
    asked = [re.search(r"correct output `(.*?)`", q).group(1) for q, _ in app.state.questions]
    assert sorted(asked[-2:]) == ["a", "ccc"]
    assert (
        "note: 4 of 6 entries kept from judgements-six.json; asking the judge about the 2 that "
        "failed (with the run's answers kept there)" in err
    ), err
    assert json.loads(out.strip().splitlines()[-1])["failed"] == 0
    saved = json.loads((run / "judgements-six.json").read_text())
    assert [e["answer"] for e in saved["per_entry"]] == [fake_answer(o) for o in asked[1:7]]
    for then, now in zip(first["per_entry"], saved["per_entry"], strict=True):
        assert now["response"] == then["response"]  # the run's answers, kept
        if then["error"] is None:
            assert now == then


def test_another_judge_keeps_the_runs_answers_and_judges_every_entry_anew(
    run, tmp_path, capsys, monkeypatch
):
    """Another judge model or prompt: the run's answers do not depend on the judge, so they
    are kept (the run is not loaded) and the new judge is asked about every entry."""
    import gptkiln.finetune.judging as judging

    data = six_entries(tmp_path)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(BOOK_PROMPT + " Be fair.")
    app = fake_judge()
    with ServerThread(app) as url:
        for more, changed in ((["--judge-model", "other"], "model"),
                              (["--prompt-file", prompt], "prompt")):  # fmt: skip
            assert judge_six(run, data, url, capsys, "--overwrite")[0] == 0  # the verdict then
            first = json.loads((run / "judgements-six.json").read_text())
            with monkeypatch.context() as m:
                m.setattr(judging, "answers", lambda *a, **k: pytest.fail("the run answered"))
                asked = len(app.state.questions)
                code, _, err = judge_six(run, data, url, capsys, *more)
            assert code == 0, err
            notes = [line for line in err.splitlines() if "judgements-six.json" in line]
            assert notes == [
                f"note: judgements-six.json was judged by another judge {changed}: the run's 6 "
                "answers in it are kept, and the judge asked about every entry anew"
            ], err
            assert len(app.state.questions) - asked == 6  # every entry, no check first
            saved = json.loads((run / "judgements-six.json").read_text())
            assert saved["judge"] != first["judge"]
            for then, now in zip(first["per_entry"], saved["per_entry"], strict=True):
                assert now["response"] == then["response"]
                assert now["error"] is None and now["answer"] is not None


def test_a_verdict_made_otherwise_is_judged_anew_with_a_note(run, tmp_path, capsys):
    """Other --max-new-tokens or test entries, weights saved again: every entry answered and
    judged anew, and a note says why; --overwrite, silently. The judge's way of asking
    (--timeout, --retries, --concurrency) is no reason, nor the same entries in another
    file."""
    import os

    data = six_entries(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    seven = tmp_path / "seven.json"
    seven.write_text(json.dumps(json.loads(data.read_text()) + instructions(1)))
    weights = run / "model.safetensors"
    app = fake_judge()
    with ServerThread(app) as url:
        for more, entries, why in (
            (["--timeout", 30, "--retries", 1, "--concurrency", 2], 0, None),
            (["--data", six_entries(tmp_path / "elsewhere")], 0, None),
            (["--max-new-tokens", 3], 6, "the run's answers in it are of up to 2 tokens, not 3"),
            (["--data", seven], 7, "it was made of other test entries"),
            ([], 6, "the run's weights changed since: a weights file or config.json is not the "
             "same"),
            (["--overwrite"], 6, None),
        ):  # fmt: skip
            assert judge_six(run, data, url, capsys, "--overwrite")[0] == 0  # the verdict then
            if not more:  # the weights saved again: their time changes
                os.utime(weights, ns=(weights.stat().st_atime_ns, time.time_ns()))
            asked = len(app.state.questions)
            code, _, err = judge_six(run, data, url, capsys, *more)
            assert code == 0, err
            notes = [line for line in err.splitlines() if "judgements-six.json" in line]
            if why is not None:
                assert notes == [
                    f"note: judgements-six.json is not reused ({why}): every entry is answered "
                    "and judged anew"
                ], err
            elif entries == 0:
                assert notes == [
                    "note: all 6 entries of judgements-six.json are judged: it is kept "
                    "(--overwrite judges anew)"
                ], err
            else:
                assert notes == [], err
            checked = 1 if entries else 0  # the judge, before the run answers
            assert len(app.state.questions) - asked == checked + entries


def test_a_judging_stopped_keeps_what_was_judged_and_the_next_asks_about_the_rest(
    run, tmp_path, capsys, monkeypatch
):
    """Ctrl-C during the asking: the verdict, written as the judging goes (the file holds each
    answer before the stop, too), keeps the answers that came, the others marked not asked;
    the next judging asks about those alone."""
    import gptkiln.finetune.judge
    import gptkiln.finetune.judging

    data, seen = six_entries(tmp_path), []
    monkeypatch.setattr(gptkiln.finetune.judging, "SAVE_EVERY", 0.0)
    ask = gptkiln.finetune.judge.ask

    def stopped_at_the_fourth(judge, question, client):
        seen.append(question)
        if len(seen) < 5:  # the check, then three entries
            return ask(judge, question, client)
        for _ in range(100):  # written as each answer came: the file holds the three
            saved = json.loads((run / "judgements-six.json").read_text())
            if sum(e["answer"] is not None for e in saved["per_entry"]) == 3:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the verdict was not written as the judging went")
        raise KeyboardInterrupt

    app = fake_judge()
    with ServerThread(app) as url:
        monkeypatch.setattr(gptkiln.finetune.judge, "ask", stopped_at_the_fourth)
        code, _, err = judge_six(run, data, url, capsys, "--overwrite")
        assert code == 130, err
        assert err.strip().splitlines()[-1] == (
            "gptkiln judge: interrupted while judging; the judge's answers about 3 of 6 "
            f"entries are kept in {run / 'judgements-six.json'}: the same command asks it "
            "about the other 3"
        )
        saved = json.loads((run / "judgements-six.json").read_text())
        assert [e["answer"] is not None for e in saved["per_entry"]] == [True] * 3 + [False] * 3
        not_asked = {e["error"] for e in saved["per_entry"][3:]}
        assert not_asked == {"not asked: the judging stopped before it"}
        monkeypatch.setattr(gptkiln.finetune.judge, "ask", ask)
        code, out, err = judge_six(run, data, url, capsys, "--json")
    assert code == 0, err
    assert (
        "note: 3 of 6 entries kept from judgements-six.json; asking the judge about the 3 that "
        "were not asked (with the run's answers kept there)"
    ) in err
    assert len(app.state.questions) == 4 + 3  # the check and three, then the three not asked
    last = json.loads(out.strip().splitlines()[-1])
    assert last["scored"] == 4 and last["unparsed"] == 2 and last["failed"] == 0


GENERATE_STREAM = generate_stream  # gptkiln's own, whatever a test puts in its place


def counted_generation(
    monkeypatch, stop_after: int | None = None, stop=KeyboardInterrupt, on_stop=lambda: None
):
    """gptkiln's generation with the rows of each batch it starts counted (the list returned);
    with ``stop_after``: ``stop`` raised (``on_stop()`` called first) after a first token of
    the first batch that starts once that many rows have been, so that batch's answers are
    lost and the others' came."""
    import gptkiln.sampling

    rows = []

    def generate_stream(model, prompts, *args, **kwargs):
        stopping = stop_after is not None and sum(rows) >= stop_after
        rows.append(len(prompts))
        for n, step in enumerate(GENERATE_STREAM(model, prompts, *args, **kwargs)):
            if stopping and n == 1:
                on_stop()
                raise stop
            yield step

    monkeypatch.setattr(gptkiln.sampling, "generate_stream", generate_stream)
    return rows


def test_a_stop_while_the_run_answers_keeps_its_answers_and_the_next_answers_the_rest(
    run, tmp_path, capsys, monkeypatch
):
    """Ctrl-C in the third batch of two answers: the verdict, written as each batch ends (not
    only at the stop), holds the four answers given, the other two not answered; the next
    judging has the run answer those two alone, and its verdict is that of a judging never
    stopped. The progress bars count the kept answers."""
    import gptkiln.finetune.judging

    data, path = six_entries(tmp_path), run / "judgements-six.json"
    monkeypatch.setattr(gptkiln.finetune.judging, "SAVE_EVERY", 0.0)
    app = fake_judge()
    with ServerThread(app) as url:
        whole = counted_generation(monkeypatch)
        code, _, err = judge_six(run, data, url, capsys, "--batch-size", 2, "--name", "whole")
        assert code == 0 and whole == [2, 2, 2], err
        expected = json.loads((run / "judgements-whole.json").read_text())

        seen = []

        def read():  # the file as the third batch is stopped: written as the answers came
            saved = json.loads(path.read_text()) if path.is_file() else {"per_entry": []}
            seen.append(sum(e["response"] is not None for e in saved["per_entry"]))

        path.unlink(missing_ok=True)
        stopped = counted_generation(monkeypatch, stop_after=4, on_stop=read)
        code, _, err = judge_six(run, data, url, capsys, "--batch-size", 2, "--overwrite")
        assert code == 130 and stopped == [2, 2, 2], err
        assert seen == [4], err
        assert err.strip().splitlines()[-1] == (
            "gptkiln judge: interrupted while answering; the run's answers to 4 of 6 entries are "
            f"kept in {path}: the same command answers the other 2"
        )
        saved = json.loads(path.read_text())
        assert [e["response"] for e in saved["per_entry"][:4]] == [
            e["response"] for e in expected["per_entry"][:4]
        ]
        assert [e["response"] for e in saved["per_entry"][4:]] == [None, None]
        assert {e["error"] for e in saved["per_entry"]} == {
            "not asked: the judging stopped before it",
            "not answered: the run's answering stopped before it",
        }
        assert [e["input"] for e in saved["per_entry"]] == [
            e["input"] for e in expected["per_entry"]
        ]
        asked = len(app.state.questions)

        again = counted_generation(monkeypatch)
        judge = Judge(url=f"{url}/v1", model="fake", concurrency=1)
        verdict = judge_run(
            run, judge, data=str(data), max_new_tokens=2, batch_size=2, name="six", progress=True
        )
    err = capsys.readouterr().err
    assert again == [2], err  # the two not answered, in one batch
    assert len(app.state.questions) - asked == 1 + 6  # the check, then every entry
    assert (
        "note: 4 of 6 answers kept from judgements-six.json; answering the other 2, then asking "
        "the judge about all 6"
    ) in err, err
    assert "answering:  67%" in err and "4/6" in err and "answering: 100%" in err, err
    assert "answering:   0%" not in err, err
    assert json.loads(path.read_text()) == expected
    assert verdict.summary() == {k: expected[k] for k in verdict.summary()}


def test_kept_answers_are_answered_anew_with_other_max_new_tokens_or_weights(
    run, tmp_path, capsys, monkeypatch
):
    """A crash while the run answers keeps its answers too (and is raised as it was); they
    are reused only by a judging of the same --max-new-tokens and weights: another answers
    every entry anew, with a note that says why."""
    import os

    import gptkiln.finetune.judging

    data, path = six_entries(tmp_path), run / "judgements-six.json"
    monkeypatch.setattr(gptkiln.finetune.judging, "SAVE_EVERY", 0.0)
    weights = run / "model.safetensors"
    app = fake_judge()
    with ServerThread(app) as url:
        judge = Judge(url=f"{url}/v1", model="fake", concurrency=1)
        for more, why in (
            (["--max-new-tokens", 3], "the run's answers in it are of up to 2 tokens, not 3"),
            ([], "the run's weights changed since: a weights file or config.json is not the same"),
        ):  # fmt: skip
            crashed = counted_generation(monkeypatch, stop_after=2, stop=RuntimeError("a crash"))
            with pytest.raises(RuntimeError, match="a crash"):
                judge_run(run, judge, data=str(data), max_new_tokens=2, batch_size=2, name="six",
                          progress=False, overwrite=True)  # fmt: skip
            assert crashed == [2, 2]
            saved = json.loads(path.read_text())
            answered = [e["response"] is not None for e in saved["per_entry"]]
            assert answered == [True] * 2 + [False] * 4
            if not more:  # the weights saved again: their time changes
                os.utime(weights, ns=(weights.stat().st_atime_ns, time.time_ns()))
            asked = len(app.state.questions)
            rows = counted_generation(monkeypatch)
            code, _, err = judge_six(run, data, url, capsys, "--batch-size", 2, *more)
            assert code == 0, err
            assert rows == [2, 2, 2], err  # every entry answered anew
            assert (
                f"note: judgements-six.json is not reused ({why}): every entry is answered and "
                "judged anew"
            ) in err, err
            assert len(app.state.questions) - asked == 1 + 6


def test_the_judging_bar_counts_the_entries_judged_before(fake, capsys):
    """A judging that goes on from a kept verdict: its progress bar starts at the entries
    judged then, and ends at all of them."""
    from gptkiln.finetune.judge import Entry, judge_entries

    url, _ = fake
    left = [Entry(input="Say a.", output="a", response="a"), Entry("Say b.", "bb", "b")]
    judge_entries(Judge(url=f"{url}/v1", model="fake"), left, progress=True, kept=3)
    err = capsys.readouterr().err
    assert "judging:  60%" in err and "3/5" in err and "5/5" in err, err
    assert "0/5" not in err and "/2 " not in err, err
    assert [e.answer for e in left] == [fake_answer("a"), fake_answer("bb")]


def test_a_judge_gone_during_the_asking_keeps_what_was_judged(run, tmp_path, capsys):
    """A judge that stops answering (here it refuses the key from the fourth entry on) stops
    the judging in one line that says what is kept; the next judging asks about the rest."""
    data = six_entries(tmp_path)
    gone = {"error": {"message": "Incorrect API key provided"}}
    replies = {o: (401, gone) for o in ("dddd", "eeeee", "ffffff")}
    app = fake_judge(replies=replies)
    with ServerThread(app) as url:
        code, _, err = judge_six(run, data, url, capsys, "--overwrite")
        assert code == 2 and "Traceback" not in err, err
        last = err.strip().splitlines()[-1]
        assert "refused the key (HTTP 401: 'Incorrect API key provided')" in last
        assert last.endswith(
            f"the judge's answers about 3 of 6 entries are kept in {run / 'judgements-six.json'}"
            ": the same command asks it about the other 3"
        ), last
        replies.clear()
        asked = len(app.state.questions)
        code, _, err = judge_six(run, data, url, capsys)
    assert code == 0, err
    assert len(app.state.questions) - asked == 3
    saved = json.loads((run / "judgements-six.json").read_text())
    assert saved["failed"] == 0 and saved["scored"] + saved["unparsed"] == 6


def test_a_prompt_file_without_the_placeholders_is_one_line(run, fake, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Score {response} please.")
    code, _, err = cli(
        "judge", run, "--judge-url", f"{fake[0]}/v1", "--judge-model", "m",
        "--prompt-file", prompt, capsys=capsys,
    )  # fmt: skip
    assert code == 2 and "{input}, {output}" in err
    assert BOOK_PROMPT.count("{") == 3


def test_gptkiln_serve_of_another_run_judges_and_its_noise_is_counted(run, tmp_path, capsys):
    """Another run served by `gptkiln serve` as the judge: a tiny model answers noise, which
    is counted as unparsed and kept, and the command still succeeds."""
    prompt = tmp_path / "short.txt"
    prompt.write_text("In {input}, {output} vs {response}: score 0-100?")
    with ServerThread(served_judge(run)) as url:
        code, out, err = cli(
            "judge", run, "--judge-url", f"{url}/v1", "--judge-model", "judge",
            "--prompt-file", prompt, "--judge-max-tokens", 4, "--max-new-tokens", 4,
            "--name", "served", "--json", capsys=capsys,
        )  # fmt: skip
    assert code == 0, err
    last = json.loads(out.strip().splitlines()[-1])
    assert last["entries"] == 4 and last["scored"] + last["unparsed"] == 4
    saved = json.loads((run / "judgements-served.json").read_text())
    assert all(isinstance(e["answer"], str) for e in saved["per_entry"])  # kept as it came
    assert sum(e["score"] is None for e in saved["per_entry"]) == last["unparsed"]


def served_judge(run):
    """`gptkiln serve` of ``run`` as an app, for `ServerThread`."""
    import uvicorn

    from gptkiln.serve import serve

    got = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(uvicorn, "run", lambda app, **kw: got.setdefault("app", app))
        mp.setattr("gptkiln.serve.check_can_listen", lambda host, port: None)
        serve(run, model_name="judge", max_batch=4, max_queue=16, log_level="warning")
    return got["app"]


def test_finetune_judges_its_chat_run_at_the_end_through_a_served_judge(run, tmp_path, capsys):
    """`gptkiln finetune --task chat ... --judge-url --judge-model`: trained, then its answers to
    the test split (each conversation up to its last answer) scored by a served run."""
    conversations = []
    for i in range(30):
        messages = [
            {"role": "user", "content": f"Say {i}."},
            {"role": "assistant", "content": "ok"},
        ]
        messages += [
            {"role": "user", "content": "Again?"},
            {"role": "assistant", "content": f"{i}"},
        ]
        conversations.append({"messages": messages})
    data = tmp_path / "chats.json"
    data.write_text(json.dumps(conversations))
    base = run.parent / "base"
    with ServerThread(served_judge(run)) as url:
        code, out, err = cli(
            "finetune", base, "--task", "chat", "--data", data, "--out", tmp_path / "chat",
            "--max-steps", 1, "--batch-size", 2, "--precision", "fp32", "--no-progress",
            "--sample-interval", 100, "--test-fraction", 0.2, "--judge-url", f"{url}/v1",
            "--judge-model", "judge", "--judge-answer-tokens", 8, "--json", capsys=capsys,
        )  # fmt: skip
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[-3].startswith("done: 1 steps") and lines[-2].startswith("judged 6 entries")
    last = json.loads(lines[-1])
    assert last["entries"] == 6 and last["scored"] + last["unparsed"] == 6
    saved = json.loads((tmp_path / "chat" / "judgements.json").read_text())
    split = json.loads((tmp_path / "chat" / "config.json").read_text())["finetune"]["split"]
    test = conversations[split["train"] : split["train"] + split["test"]]
    assert [e["output"] for e in saved["per_entry"]] == [c["messages"][-1]["content"] for c in test]
    assert saved["per_entry"][0]["input"].endswith("user: Again?")


def test_finetune_judge_flags_are_checked_before_training(run, tmp_path, capsys):
    argv = ["finetune", run.parent / "base", "--data", run.parent / "instructions.json"]
    argv += ["--out", tmp_path / "never"]
    code, _, err = cli(*argv, "--judge-url", "http://127.0.0.1:9/v1", capsys=capsys)
    assert code == 2 and "go together" in err and not (tmp_path / "never").exists()
    code, _, err = cli(*argv, "--judge-url", "u", "--judge-model", "m", "--test-fraction", 0,
                       capsys=capsys)  # fmt: skip
    assert code == 2 and "test split" in err and not (tmp_path / "never").exists()


def ollama_model() -> str | None:
    """A model of an Ollama running here (``GPTKILN_TEST_OLLAMA_MODEL``, else its first), or
    None when none runs."""
    import os

    import httpx

    try:
        tags = httpx.get("http://127.0.0.1:11434/api/tags", timeout=1).json()
    except (httpx.HTTPError, ValueError):
        return None
    models = [m.get("name") for m in tags.get("models") or []]
    return os.environ.get("GPTKILN_TEST_OLLAMA_MODEL") or (models[0] if models else None)


def test_the_books_ollama_judges_where_one_runs(run, capsys):
    model = ollama_model()
    if model is None:
        pytest.skip(
            "no Ollama at 127.0.0.1:11434 with a model (the book's judge: ollama pull llama3)"
        )
    code, out, err = cli(
        "judge", run, "--judge-url", "http://127.0.0.1:11434/v1", "--judge-model", model,
        "--max-new-tokens", 8, "--name", "ollama", "--json", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    last = json.loads(out.strip().splitlines()[-1])
    assert last["entries"] == 4 and last["scored"] + last["unparsed"] == 4


def test_the_test_split_is_of_the_data_as_the_run_was_trained_on_it(tmp_path, monkeypatch):
    """Without --data the judge reads the run's own test split: found from any folder (the
    data was named relative to where finetune ran), and refused once the file changed."""
    from gptkiln.finetune.judging import test_entries

    tokenizer = build_char_tokenizer([CHARS], with_eot=True)
    config = GPTConfig.from_name("tiny", vocab_size=tokenizer.vocab_size, context_length=512)
    save_model(GPT(config), tmp_path / "base", tokenizer=tokenizer)
    (tmp_path / "made").mkdir()
    data = tmp_path / "made" / "instructions.json"
    entries = instructions(40)
    data.write_text(json.dumps(entries))
    monkeypatch.chdir(tmp_path / "made")
    ft = FinetuneConfig(base=str(tmp_path / "base"), data="instructions.json")  # relative
    settings = dict(batch_size=4, progress=False, precision="fp32", sample_interval=100)
    finetune(ft, train_config(ft, out=str(tmp_path / "run"), max_steps=1, **settings))
    split = json.loads((tmp_path / "run" / "config.json").read_text())["finetune"]["split"]
    test = entries[split["train"] : split["train"] + split["test"]]
    monkeypatch.chdir(tmp_path)  # elsewhere: "instructions.json" is not here
    assert [out for _, out in test_entries(tmp_path / "run", None)] == [e["output"] for e in test]
    (tmp_path / "instructions.json").write_text(json.dumps(entries[:30]))  # another of the name
    assert [out for _, out in test_entries(tmp_path / "run", None)] == [e["output"] for e in test]
    data.write_text(json.dumps(entries[::-1]))
    with pytest.raises(GptkilnError, match="has changed since .* was fine-tuned on it"):
        test_entries(tmp_path / "run", None)


def test_an_instruction_with_a_blank_line_is_prompted_as_it_was_trained(run, fake, tmp_path):
    """The run answers an entry in its template as training wrote it: an instruction holding a
    blank line, with no input, gets no ### Input: section (it was split at the blank line)."""
    from gptkiln.finetune.judging import answers, test_entries
    from gptkiln.finetune.templates import ALPACA, format_prompt

    entry = {"instruction": "Say hi.\n\nThen stop.", "input": "", "output": "hi"}
    data = tmp_path / "blank.json"
    data.write_text(json.dumps([entry]))
    [judged] = answers(run, test_entries(run, str(data)), max_new_tokens=2)
    prompt = format_prompt(ALPACA, entry["instruction"], "")
    assert "### Input:" not in prompt and judged.input == prompt.rsplit("\n\n### Response:", 1)[0]


def test_prompts_longer_than_the_runs_context_are_noted_once(run, fake, tmp_path, capsys):
    """The run answers a prompt past its context from its end, as `gptkiln generate` does (which
    says so); judge says so once, with how many, while the judge is shown each whole."""
    long = "Repeat the word. " * 40  # 680 characters: past the context of 512 tokens
    entries = [
        {"instruction": long, "input": "", "output": "word"},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
        {"instruction": long, "input": "red", "output": "red"},
    ]
    data = tmp_path / "long.json"
    data.write_text(json.dumps(entries))
    code, _, err = cli(
        "judge", run, "--data", data, "--judge-url", f"{fake[0]}/v1", "--judge-model", "m",
        "--max-new-tokens", 2, "--name", "long", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    notes = [line for line in err.splitlines() if "context" in line]
    assert notes == [
        "note: 2 of 3 test prompts are longer than the run's context of 512 tokens (the first, "
        "entry 1): the run answers each from its last 512 tokens, while the judge is shown it "
        "whole"
    ], err
    saved = json.loads((run / "judgements-long.json").read_text())
    assert long.strip() in saved["per_entry"][0]["input"]  # the judge's input is whole


def test_dpo_pairs_as_data_are_judged_by_their_chosen_answer(run, fake, tmp_path, capsys):
    """--data of DPO pairs, in each form a dpo run reads: (prompt, chosen) judged, as for a dpo
    run's own test split."""
    pairs = [
        {"prompt": "Say yes.", "chosen": "yes", "rejected": "no"},
        {
            "prompt": [{"role": "user", "content": "Say ok."}],
            "chosen": [{"role": "assistant", "content": "ok"}],
            "rejected": "not ok",
        },
        {
            "chosen": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "hey"}],
            "rejected": [
                {"role": "user", "content": "Hi."},
                {"role": "assistant", "content": "go"},
            ],
        },
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    code, out, err = cli(
        "judge", run, "--data", data, "--judge-url", f"{fake[0]}/v1", "--judge-model", "m",
        "--max-new-tokens", 2, "--name", "pairs", "--json", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["entries"] == 3
    saved = json.loads((run / "judgements-pairs.json").read_text())
    assert [e["output"] for e in saved["per_entry"]] == ["yes", "ok", "hey"]
    assert "Say yes." in saved["per_entry"][0]["input"]
    assert "Hi." in saved["per_entry"][2]["input"]
    (tmp_path / "bad.jsonl").write_text(
        json.dumps({"prompt": "Say.", "chosen": "", "rejected": "x"})
    )
    code, _, err = cli(
        "judge", run, "--data", tmp_path / "bad.jsonl", "--judge-url", f"{fake[0]}/v1",
        "--judge-model", "m", capsys=capsys,
    )  # fmt: skip
    assert_one_line_error(code, err, "bad.jsonl line 1", '"chosen" is empty or not text')


def test_dpo_records_without_rejected_are_judged_by_their_chosen_answer(
    run, fake, tmp_path, capsys
):
    """The judge reads a pair's prompt and chosen answer alone, so records of {prompt, chosen}
    (a reference answer, no rejected one) are test entries too, not conversations; a record
    whose chosen answer is bad is the pairs' one line."""
    records = [
        {"prompt": "Say yes.", "chosen": "yes"},
        {"prompt": [{"role": "user", "content": "Say ok."}],
         "chosen": [{"role": "assistant", "content": "ok"}]},
        {"prompt": "Say no.", "chosen": "no", "rejected": "yes"},
    ]  # fmt: skip
    data = tmp_path / "chosen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, out, err = cli(
        "judge", run, "--data", data, "--judge-url", f"{fake[0]}/v1", "--judge-model", "m",
        "--max-new-tokens", 2, "--name", "chosen", "--json", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    saved = json.loads((run / "judgements-chosen.json").read_text())
    assert [e["output"] for e in saved["per_entry"]] == ["yes", "ok", "no"]
    assert "Say ok." in saved["per_entry"][1]["input"]
    (tmp_path / "bad.jsonl").write_text(
        json.dumps(records[0]) + "\n" + json.dumps({"prompt": "Say.", "chosen": " "}) + "\n"
    )
    code, _, err = cli(
        "judge", run, "--data", tmp_path / "bad.jsonl", "--judge-url", f"{fake[0]}/v1",
        "--judge-model", "m", capsys=capsys,
    )  # fmt: skip
    assert_one_line_error(code, err, "bad.jsonl line 2", '"chosen" is empty or not text')


def test_a_judge_none_of_whose_answers_is_a_score_is_noted(run, tmp_path, capsys):
    """Every answer unparsed: still a success (the answers are kept), but a note says there is
    no mean, how many, and what the judge answered."""
    for content, fix in (
        ("I would rate this response a 70 out of 100.", "or a prompt that asks for the number"),
        ("<think>Let me weigh the", "the judge's reasoning was cut: give it room with --judge-"),
    ):
        reply = {"choices": [{"message": {"role": "assistant", "content": content}}]}
        with ServerThread(fake_judge(replies={"*": (200, reply)})) as url:
            code, out, err = cli(
                "judge",
                run,
                "--judge-url",
                f"{url}/v1",
                "--judge-model",
                "m",
                "--max-new-tokens",
                2,
                "--name",
                "wordy",
                "--overwrite",
                capsys=capsys,
            )  # fmt: skip  (--overwrite: no note of the verdict of the loop's first judge)
        assert code == 0, err
        assert "mean score - over 0 scored (4 unparsed answers kept)" in out
        [note] = [line for line in err.splitlines() if line.startswith("note:")]
        assert note.startswith("note: none of the judge's 4 answers is a score"), note
        assert f"entry 1's was {content!r}: " in note and fix in note


def test_a_thinking_models_reasoning_block_is_not_judged(run, tmp_path, monkeypatch):
    """Qwen3's template opens every answer with ``<think>...</think>``: the judge scores the
    answer after it, as a reader gets it."""
    import gptkiln.api
    from gptkiln.finetune.judging import answers, test_entries

    class Done:
        text = "<think>\n\n</think>\n\nYou are welcome."

    monkeypatch.setattr(
        gptkiln.api, "complete", lambda model, prompts, *a, **k: [Done] * len(prompts)
    )
    entry = {"instruction": "Thank you.", "input": "", "output": "You are welcome."}
    data = tmp_path / "thanks.json"
    data.write_text(json.dumps([entry]))
    [judged] = answers(run, test_entries(run, str(data)), max_new_tokens=2)
    assert judged.response == "You are welcome."


def test_an_openai_key_goes_to_openai_only_unless_a_variable_is_named():
    from gptkiln.cli.judge import key_env

    assert key_env("https://api.openai.com/v1", None) == "OPENAI_API_KEY"
    assert key_env("http://localhost:11434/v1", None) == ""  # Ollama, vLLM, a third party
    assert key_env("https://openai.com.evil.example/v1", None) == ""
    assert key_env("http://localhost:8000/v1", "JUDGE_KEY") == "JUDGE_KEY"


def test_a_batch_size_below_1_is_refused_before_anything_is_answered(run, capsys):
    code, _, err = cli(
        "judge", run, "--judge-url", "http://localhost:1/v1", "--judge-model", "m",
        "--batch-size", 0, capsys=capsys,
    )  # fmt: skip
    assert_one_line_error(code, err, "--batch-size must be a whole number >= 1")


def test_a_stop_waits_for_no_request_in_flight_not_even_at_the_exit(monkeypatch):
    """Ctrl-C while a request is in flight: the judging stops at once with the answers that
    came, and the request left hangs on a daemon thread, so the process exits without waiting
    out the judge's timeout (a ThreadPoolExecutor's threads are joined at exit)."""
    import threading

    import gptkiln.finetune.judge
    from gptkiln.finetune.judge import Entry, judge_entries

    release = threading.Event()

    def ask(judge, question, client):
        if "`bb`" in question:  # in flight until the test ends
            release.wait(30)
        return "80"

    def stopped():
        raise KeyboardInterrupt

    monkeypatch.setattr(gptkiln.finetune.judge, "ask", ask)
    entries = [Entry(input=f"Say {w}.", output=w, response=w) for w in ("a", "bb")]
    judge = Judge(url="http://127.0.0.1:9/v1", model="fake", concurrency=2)
    before, started = set(threading.enumerate()), time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            judge_entries(judge, entries, progress=False, client=object(), on_judged=stopped)
        assert time.monotonic() - started < 10
        assert (entries[0].score, entries[1].answer) == (80, None)
        held = [t for t in set(threading.enumerate()) - before if not t.daemon]
        assert held == [], held  # none that the exit would join
    finally:
        release.set()
