"""Constrained decoding's pieces: the bitmask applied to logits as llguidance lays it out, a
grammar compiled once and copied after, what the engine cannot enforce refused by name, and a
grammar's row beside a free row in one batch (the free row's tokens as when alone)."""

import asyncio
import copy
import json
import sys
import threading

import httpx
import pytest
import torch
from serving import ServerThread

from gptkiln.config import GPTConfig, SampleConfig
from gptkiln.logits_processors import apply_token_bitmask
from gptkiln.model import GPT
from gptkiln.serve.app import create_app
from gptkiln.serve.batcher import Batcher
from gptkiln.serve.constrain import GrammarError, Grammars, fill_masks
from gptkiln.serve.events import Done, Sequence, Token
from gptkiln.tokenizers import load_tokenizer

pytest.importorskip("llguidance")


def test_the_bitmask_forbids_exactly_the_tokens_whose_bit_is_0():
    torch.manual_seed(0)
    vocab = 70  # three 32-bit words cover 96 ids; the model's vocabulary may be padded beyond
    allowed = [torch.rand(vocab) < 0.3 for _ in range(2)]
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    for r, row in enumerate(allowed):
        for i in row.nonzero().flatten().tolist():
            word, bit = divmod(i, 32)
            value = int(bitmask[r, word]) & 0xFFFFFFFF | (1 << bit)
            bitmask[r, word] = value - (1 << 32) if value >= 1 << 31 else value
    logits = torch.randn(2, vocab + 8)  # 8 ids past what the mask covers: forbidden too
    out = apply_token_bitmask(logits.clone(), bitmask)
    for r, row in enumerate(allowed):
        want = torch.where(row, logits[r, :vocab], torch.tensor(float("-inf")))
        assert torch.equal(out[r, :vocab], want)
        assert torch.isinf(out[r, vocab:]).all()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("gpt2")


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer)


def test_a_grammar_is_compiled_once_and_unenforceable_schemas_are_refused(grammars):
    grammar = grammars.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    one, two = grammars.constraint(grammar), grammars.constraint(grammar)
    assert one.matcher is not two.matcher and len(grammars._cache) == 1
    with pytest.raises(GrammarError, match="not"):
        grammars.constraint(grammars.json_schema({"not": {"type": "string"}}))
    with pytest.raises(GrammarError, match="objekt"):
        grammars.constraint(grammars.json_schema({"type": "objekt"}))


def test_masks_are_filled_without_importing_llguidance_torch(grammars, tokenizer, monkeypatch):
    """``llguidance.torch`` compiles a kernel gptkiln does not use with torch.compile as it is
    imported (~2.6 s, which the first constrained request of a process paid): one row's mask
    and many rows' masks are filled through llguidance's NumPy functions over the tensor."""
    monkeypatch.setitem(sys.modules, "llguidance.torch", None)  # importing it fails
    grammar = grammars.json_schema({"enum": [12]})
    one, two = grammars.constraint(grammar), grammars.constraint(grammar)
    bitmask = torch.zeros(3, (tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
    one.fill(bitmask[0])
    fill_masks([one, two], bitmask[1:])

    def allowed(row: int, token: int) -> bool:
        return bool(int(bitmask[row, token // 32]) >> (token % 32) & 1)

    twelve, two_ = tokenizer.encode("12")[0], tokenizer.encode("2")[0]
    for row in range(3):
        assert allowed(row, twelve) and not allowed(row, two_)


def test_a_refused_token_is_one_line_naming_it_not_the_engines_state(grammars, tokenizer):
    from gptkiln.errors import GptkilnError

    constraint = grammars.constraint(grammars.json_schema({"type": "integer"}))
    letter = tokenizer.encode("x")[0]
    with pytest.raises(GptkilnError) as caught:
        constraint.consume(letter)
    said = str(caught.value)
    assert said.startswith(f"the grammar refused token {letter}: ") and "\n" not in said
    assert len(said) < 300


def untied_model(tokenizer) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig.from_name(
        "tiny", vocab_size=tokenizer.vocab_size, context_length=128, tie_embeddings=False
    )
    return GPT(config).eval()


def served(model, tokenizer, seqs, max_batch: int) -> list[tuple[list[int], str, str]]:
    """``seqs`` submitted at once to a batcher of a copy of ``model``: each one's ids, text and
    finish reason."""
    batcher = Batcher(copy.deepcopy(model), tokenizer, max_batch=max_batch)

    async def main():
        await batcher.start()
        try:
            batcher.submit(seqs)
            out = []
            for seq in seqs:
                ids, text = [], ""
                while not isinstance(event := await seq.events.get(), Done):
                    assert isinstance(event, Token), event
                    ids.append(event.id)
                    text += event.text
                out.append((ids, text + event.text, event.reason))
            return out
        finally:
            await batcher.stop()

    return asyncio.run(main())


@pytest.mark.parametrize("drawn_together", [False, True], ids=["one by one", "as on a GPU"])
def test_a_constrained_row_beside_a_free_row(tokenizer, grammars, monkeypatch, drawn_together):
    """Two constrained rows beside a free one: their masks filled together, the free row's
    tokens as when alone. As on a GPU, the three greedy rows are drawn in one call, each
    constrained row's logits masked by its own grammar first."""
    from gptkiln.serve import choosing as batching

    sizes = []
    if drawn_together:
        monkeypatch.setattr(batching, "draws_together", lambda device, temperature: True)
        real = batching.sample_rows

        def counted(logits, *args):
            sizes.append(logits.shape[0])
            return real(logits, *args)

        monkeypatch.setattr(batching, "sample_rows", counted)
    model = untied_model(tokenizer)
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
            "ok": {"type": "boolean"},
        },
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    grammar = grammars.json_schema(schema)
    cfg = SampleConfig(max_new_tokens=40, temperature=0)

    def run(with_constrained: bool):
        seqs = [Sequence([11, 12, 13], cfg, asyncio.Queue())]  # the free row
        if with_constrained:
            seqs += [
                Sequence(
                    [11, 12, 13], cfg, asyncio.Queue(), constraint=grammars.constraint(grammar)
                )
                for _ in range(2)  # two: their masks are filled together
            ]
        return served(model, tokenizer, seqs, max_batch=4)

    together = run(True)
    assert (3 in sizes) == drawn_together  # the free row and both constrained ones at once
    (alone,) = run(False)
    assert together[0] == alone  # the free row is untouched by its constrained neighbours
    for _, text, reason in together[1:]:
        assert reason == "stop" and set(json.loads(text)) == {"n", "ok"}, text
    with pytest.raises(ValueError):
        json.loads(alone[1])  # the same model unconstrained: noise


def test_constrained_first_tokens_drawn_together_are_what_each_gets_alone(
    tokenizer, grammars, monkeypatch
):
    """Two seeded constrained rows admitted together: their fresh grammars' masks filled in
    one `fill_masks`, their first tokens drawn in one call, each row's tokens those it gets
    alone in the batcher."""
    from gptkiln.serve import choosing

    model = untied_model(tokenizer)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    grammar = grammars.json_schema(schema)
    cfgs = [SampleConfig(max_new_tokens=30, temperature=1.0, seed=s) for s in (1, 2)]

    def run(seqs):
        return served(model, tokenizer, seqs, max_batch=2)

    def seqs():
        return [
            Sequence([11, 12, 13], c, asyncio.Queue(), constraint=grammars.constraint(grammar))
            for c in cfgs
        ]

    alone = [run([seq])[0] for seq in seqs()]
    filled, sizes = [], []
    real_fill, real_sample = choosing.fill_masks, choosing.sample_rows

    def fill(constraints, bitmask):
        filled.append(len(constraints))
        return real_fill(constraints, bitmask)

    def sample(logits, *args):
        sizes.append(logits.shape[0])
        return real_sample(logits, *args)

    monkeypatch.setattr(choosing, "fill_masks", fill)
    monkeypatch.setattr(choosing, "sample_rows", sample)
    assert run(seqs()) == alone
    assert filled[0] == 2 and sizes[0] == 2  # the first tokens' masks and draw, together


CHAIN = {
    "$ref": "#/$defs/d0",
    "$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(400)},
}
CHAIN["$defs"]["d400"] = {"type": "string"}


@pytest.mark.parametrize(
    "schema, endless",
    [
        ({"$ref": "#"}, True),
        ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, True),
        ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, True),
        ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, True),  # [[[...]]]
        ({"oneOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]}, True),
        # a way out: an optional property, an array that may be empty, another branch, no type
        ({"type": "object", "properties": {"a": {"$ref": "#"}}}, False),
        ({"type": "array", "items": {"$ref": "#"}}, False),
        (
            {
                "anyOf": [
                    {"type": "null"},
                    {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]},
                ]
            },
            False,
        ),  # fmt: skip
        (
            {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
            False,
        ),
        ({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}, False),  # a string meets it
        (
            {
                "$ref": "#/$defs/n",
                "$defs": {
                    "n": {
                        "type": "object",
                        "required": ["k"],
                        "properties": {"k": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                    }
                },
            },
            False,
        ),  # fmt: skip
        ({"$ref": "https://example.com/s.json"}, False),  # left to the engine
        (
            {
                "type": "object",
                "patternProperties": {"^x": {"type": "string"}},
                "additionalProperties": False,
                "required": ["xa"],
            },
            False,
        ),  # {"xa": "s"}  # fmt: skip
        ({"$ref": "#", "const": 1}, False),  # 1
        (CHAIN, False),  # deeper than Python's stack: left to the engine, not a 500
    ],
)
def test_a_schema_no_finite_value_meets_is_refused_before_it_decodes(schema, endless):
    from gptkiln.serve.constrain import check_finite

    if endless:
        with pytest.raises(GrammarError, match="no finite JSON value meets it"):
            check_finite(schema)
    else:
        check_finite(schema)


def test_a_tools_parameters_keep_their_refs_inside_a_forced_call():
    """The parameters sit at /properties/arguments of a call's schema: their pointers follow
    them there, property names that spell keywords included; an anchor is no pointer."""
    from gptkiln.serve.tools import _rebased

    parameters = {
        "type": "object",
        "$defs": {"Opt": {"enum": ["a", "b"]}},
        "properties": {
            "default": {"$ref": "#/$defs/Opt"},
            "examples": {"type": "array", "items": {"$ref": "#/$defs/Opt"}},
            "self": {"$ref": "#"},
            "named": {"$ref": "#opt"},
        },
        "default": {"$ref": "#/not/a/schema"},  # a value: left as it is
    }
    got = _rebased(parameters, "#/properties/arguments")
    assert got["properties"]["default"] == {"$ref": "#/properties/arguments/$defs/Opt"}
    assert got["properties"]["examples"]["items"] == {"$ref": "#/properties/arguments/$defs/Opt"}
    assert got["properties"]["self"] == {"$ref": "#/properties/arguments"}
    assert got["properties"]["named"] == {"$ref": "#opt"}
    assert got["default"] == {"$ref": "#/not/a/schema"}


# -- the vocabulary read as the server starts -------------------------------------------------
def constrained_body():
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    schema["additionalProperties"] = False
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    return {"prompt": "x", "max_tokens": 20, "temperature": 0, "response_format": fmt}


def test_the_server_reads_the_vocabulary_as_it_starts_and_a_plain_request_does_not_wait(
    tokenizer, monkeypatch
):
    """The grammar engine's vocabulary is read in the background as the app starts, with no
    request asking for it (before, the first constrained request read it); a plain request
    and /health are answered while it is being read, and a constrained one waits for it."""
    from gptkiln.serve import constrain

    started, release = threading.Event(), threading.Event()
    real = constrain._Vocabulary

    def slow(*args):  # a vocabulary that takes as long as the test says
        started.set()
        release.wait(60)
        return real(*args)

    monkeypatch.setattr(constrain, "_Vocabulary", slow)
    app = create_app(untied_model(tokenizer), tokenizer, model_name="m", max_batch=2)
    with ServerThread(app) as url:
        assert started.wait(10)  # begun at startup: no request made
        plain = {"prompt": "x", "max_tokens": 3, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=plain, timeout=60)
        assert r.status_code == 200 and httpx.get(f"{url}/health").status_code == 200
        assert not release.is_set()  # both answered while the vocabulary was being read
        threading.Timer(0.5, release.set).start()
        r = httpx.post(f"{url}/v1/completions", json=constrained_body(), timeout=60)
    assert r.status_code == 200 and json.loads(r.json()["choices"][0]["text"])["a"] in (1, 2)


def test_a_vocabulary_that_fails_as_the_server_starts_is_the_first_constrained_requests_400():
    """A tokenizer without an end-of-text token: the background read fails quietly, the server
    answers, and the first constrained request says why, as it did when it read it first."""
    from gptkiln.tokenizers import build_char_tokenizer

    plain_tokenizer = build_char_tokenizer(['x{}"a:12, '], with_eot=False)
    grammars = Grammars(plain_tokenizer)
    with pytest.raises(GrammarError) as said:
        grammars.constraint(grammars.json_schema({"type": "object"}))
    app = create_app(untied_model(plain_tokenizer), plain_tokenizer, model_name="m")
    with ServerThread(app) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        r = httpx.post(f"{url}/v1/completions", json=constrained_body(), timeout=60)
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 400 and str(said.value) in r.json()["error"]["message"]
    assert ok.status_code == 200


def test_a_server_stopped_while_it_reads_the_vocabulary_waits_for_the_read(tokenizer, monkeypatch):
    """The app's shutdown waits for the background read (`Grammars.build_soon`): a process that
    ended with it running in its daemon thread (llguidance's native code as the interpreter
    finalised) crashed with a segfault, about one `gptkiln serve` in five stopped (Ctrl-C)
    within its first 0.3 s."""
    from gptkiln.serve import constrain

    started, release = threading.Event(), threading.Event()
    real = constrain._Vocabulary

    def slow(*args):
        started.set()
        release.wait(60)
        return real(*args)

    monkeypatch.setattr(constrain, "_Vocabulary", slow)
    app = create_app(untied_model(tokenizer), tokenizer, model_name="m", max_batch=2)
    with ServerThread(app):
        assert started.wait(10)
        threading.Timer(1.0, release.set).start()  # read on for a second after the stop
    reading = [t for t in threading.enumerate() if t.name == "gptkiln-vocabulary"]
    assert release.is_set() and not reading  # shut down only once the read had ended


def test_a_schema_nested_past_the_checked_depth_is_refused_at_any_stack_depth():
    """How deep a schema may nest is counted, not left to the recursion of jsonschema's check,
    which passed or failed by the depth of the stack it began from (a 150-deep ``not`` chain
    was a 400 for its tools in one process and went on to the context check in another)."""
    from gptkiln.serve.constrain import MAX_SCHEMA_DEPTH, GrammarError, check_schema

    def chain(n: int) -> dict:
        schema: dict = {"type": "object"}
        for _ in range(n - 1):
            schema = {"not": schema}
        return schema

    def nested(depth_left: int, schema: dict) -> None:  # the check begins from a deep stack
        if depth_left:
            return nested(depth_left - 1, schema)
        check_schema(schema)

    check_schema(chain(MAX_SCHEMA_DEPTH))
    for stack in (0, 400):
        with pytest.raises(GrammarError, match=f"nests {MAX_SCHEMA_DEPTH + 1} levels deep"):
            nested(stack, chain(MAX_SCHEMA_DEPTH + 1))
