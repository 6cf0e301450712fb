"""Constrained decoding: a grammar per row of the batch, applied as a mask over the logits.

A request that asks for JSON (``response_format``) or for a tool call it must make
(``tool_choice`` ``required`` or a named function) gets a `Constraint`: an llguidance matcher
over the model's own vocabulary. At each of the row's steps the batcher asks it for the tokens
the grammar allows next (a bitmask, `fill`), forbids the others in that row's logits
(`gptkiln.logits_processors.apply_token_bitmask`), samples as usual and hands it the token
(`consume`).
The other rows of the batch are untouched: a mask is a row's own, so constrained and free rows
decode together. When the grammar is complete the matcher stops and the row ends (``stop``).

Why llguidance (bench/README.md has the figures): its per-token cost at batch 1 and 8 on this
CPU is that of xgrammar and well under outlines-core's at batch 8, it compiles a schema lazily
(no seconds-long ahead-of-time build per schema), it refuses the JSON-schema keywords it cannot
enforce by name (so an unenforceable schema is a 400, never unconstrained text), it takes Lark
grammars that wrap a schema in a template's tool-call tags, and it is one 8 MB wheel with no
dependencies (xgrammar pulls in triton and transformers).
"""

from __future__ import annotations

import collections
import functools
import threading
import urllib.parse
from typing import Any

from gptkiln.errors import GptkilnError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How a constrained answer lays out its JSON: OpenAI's ``{"a": 1, "b": [2, 3]}``, with no other
whitespace (a free choice of whitespace lets a weak model pad forever)."""

MAX_CACHED_GRAMMARS = 64


class GrammarError(GptkilnError):
    """A schema or grammar the engine cannot enforce; the message says which part and why."""


class Constraint:
    """One row's grammar state (an llguidance matcher of its own)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def fill(self, bitmask_row) -> None:
        """Write the allowed next tokens into ``bitmask_row`` (ceil(V/32),) int32, CPU."""
        import llguidance.numpy as lln  # not .torch: see `fill_masks`

        lln.fill_next_token_bitmask(self.matcher, bitmask_row.unsqueeze(0).numpy(), 0)

    def consume(self, token: int) -> None:
        """Advance past the chosen token (it was allowed, so this cannot fail)."""
        if not self.matcher.consume_token(token):
            said = (self.matcher.get_error() or "").strip().splitlines()  # the engine's state
            why = said[0][:200] if said else "no reason given"  # follows its first line
            raise GptkilnError(f"the grammar refused token {token}: {why}")

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but the end may follow."""
        return self.matcher.is_stopped()


class Grammars:
    """The grammar engine for one tokenizer: its vocabulary read once (~0.3 s for GPT-2's; the
    server begins it in the background as it starts, `build_soon`, so the first constrained
    request waits at most for what is left of it), and compiled grammars cached by their
    text, so a schema sent again costs a copy of its matcher.

    Args:
        tokenizer: gptkiln's tokenizer (``token_bytes``, ``stop_ids``, ``vocab_size``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._lltok = None
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None  # `build_soon`'s
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()

    @staticmethod
    def available() -> bool:
        try:
            import llguidance  # noqa: F401
        except ImportError:
            return False
        return True

    def build_soon(self) -> None:
        """Read the vocabulary in a thread of its own, so that the first constrained request
        waits only for what is left of it (`_vocabulary` holds the lock while it reads); a
        failure there is left for that request, which reads it again and says why, as it
        would have without this. `wait_for_reading` waits for the thread as the app stops."""
        self._reader = threading.Thread(
            target=self._read_quietly, name="gptkiln-vocabulary", daemon=True
        )
        self._reader.start()

    def wait_for_reading(self) -> None:
        """Wait for `build_soon`'s read to end: a process must not end while it runs (a daemon
        thread in llguidance's native code as the interpreter finalised crashed the process, a
        segfault in about one server in five stopped within its first 0.3 s)."""
        if self._reader is not None:
            self._reader.join()

    def _read_quietly(self) -> None:
        try:
            self._vocabulary()
        except Exception:  # the first constrained request meets it again and answers it
            pass

    def _vocabulary(self):
        """llguidance's view of the vocabulary: each id's bytes, the stop ids as its end."""
        import llguidance

        with self._lock:
            if self._lltok is None:
                stops = list(self.tokenizer.stop_ids)
                if not stops:
                    raise GrammarError(
                        "this model's tokenizer has no end-of-text token, so a constrained "
                        "answer could not end; serve a run whose tokenizer has one"
                    )
                wrapped = llguidance.TokenizerWrapper(_Vocabulary(self.tokenizer, stops))
                self._lltok = llguidance.LLTokenizer(
                    wrapped, n_vocab=self.tokenizer.vocab_size, eos_token=stops
                )
            return self._lltok

    def json_schema(self, schema: Any) -> str:
        """The grammar text of a JSON schema (``{"type": "object"}`` for any object; ``true``,
        as ``{}``, any JSON value; ``false`` none, which is refused)."""
        import llguidance

        if schema is False:
            raise GrammarError("the schema false accepts no value; send one an answer can meet")
        if schema is True:
            schema = {}  # the same schema as an object, which takes llguidance's options
        check_finite(schema)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"not a JSON schema: {e}") from None

    def lark(self, source: str) -> str:
        """The grammar text of a Lark grammar (``%json {...}`` embeds a schema)."""
        import llguidance

        return llguidance.LLMatcher.grammar_from_lark(source)

    def constraint(self, grammar: str) -> Constraint:
        """A fresh row state for ``grammar``; the first use of a grammar compiles and checks
        it (`GrammarError` naming what the engine cannot enforce), later ones copy it."""
        import llguidance

        with self._lock:
            proto = self._cache.get(grammar)
            if proto is not None:
                self._cache.move_to_end(grammar)
                return Constraint(proto.deep_copy())
        vocabulary = self._vocabulary()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, vocabulary)
        if failed:
            raise GrammarError(messages[0].strip().replace("\n", " "))
        proto = llguidance.LLMatcher(vocabulary, grammar, log_level=0)
        if proto.is_error():
            raise GrammarError(proto.get_error().strip().replace("\n", " "))
        with self._lock:
            self._cache[grammar] = proto
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return Constraint(proto.deep_copy())


def check_schema(schema: Any) -> None:
    """Refuse what is not a JSON schema by its meta-schema (jsonschema's check: a type no JSON
    value has, ``required`` not a list, ...) in a `GrammarError` naming where; what no grammar
    could enforce (a look-ahead ``pattern``, a remote ``$ref``, an unknown format) passes, for a
    schema only shown to the model (a tool's parameters under ``tool_choice`` ``auto``)."""
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for

    if isinstance(schema, bool):
        return
    if not isinstance(schema.get("$schema", ""), str):
        raise GrammarError("its $schema is not a string (the URI of a JSON Schema draft)")
    if (depth := _depth(schema)) > MAX_SCHEMA_DEPTH:  # before a check whose recursion could
        raise GrammarError(  # pass or fail by the depth of the stack it starts from
            f"it nests {depth} levels deep, past the {MAX_SCHEMA_DEPTH} checked; send a "
            "flatter schema"
        )
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise GrammarError(f"{e.message}" + (f" (at {where})" if where else "")) from None
    except RecursionError:
        raise GrammarError("it nests too deep to be checked; send a flatter schema") from None


MAX_SCHEMA_DEPTH = 100
"""The deepest nesting of objects and arrays `check_schema` takes in a schema (a real one nests a
few tens); deeper is refused, whatever the depth of the stack the check would start from."""


def _depth(value: Any) -> int:
    """How deep ``value``'s objects and arrays nest (a scalar: 0), without recursion."""
    deepest, level = 0, [(value, 1)]
    while level:
        item, depth = level.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        )
        if children is None:
            continue
        deepest = max(deepest, depth)
        level.extend((child, depth + 1) for child in children)
    return deepest


FINITE_CHECK_STEPS = 20_000
"""`check_finite` looks at most this many subschemas (a schema of many alternatives that refer to
one another); past them it refuses nothing."""


def check_finite(schema: Any) -> None:
    """Refuse (`GrammarError`) a schema that no finite JSON value meets by its shape: a ``$ref``
    that leads only back to itself (the engine's grammar of it is empty: it lets the end of
    text through at once, or halfway), or a property that is required and whose schema requires
    another of its own kind inside it, with no way out (the grammar never ends). A way out is
    any alternative (``anyOf``, ``oneOf``, ``type`` lists, an untyped schema, which a string
    meets) or a recursion that is not required (an optional property, an array that may be
    empty). What the check cannot resolve (a remote ``$ref``) it leaves to the engine."""
    try:
        finite = _finite(schema, schema, set(), [FINITE_CHECK_STEPS])
    except RecursionError:  # a chain of $refs deeper than Python's stack: left to the engine
        finite = True
    if not finite:
        raise GrammarError(
            "no finite JSON value meets it: a $ref leads back to itself before a value is "
            "written, or a required property needs another of its own kind inside it; make the "
            "recursion optional (leave it out of required, let it be null or an empty array)"
        )


def _finite(root: Any, node: Any, stack: set[int], budget: list[int]) -> bool:
    """Whether some finite value meets ``node`` by its shape (True where unsure); ``stack``: the
    subschemas being looked into above it (one of them again: no way out along this path)."""
    if not isinstance(node, dict):
        return node is not False
    if budget[0] <= 0:
        return True
    budget[0] -= 1
    if id(node) in stack:
        return False
    stack.add(id(node))
    try:
        return _finite_here(root, node, stack, budget)
    finally:
        stack.discard(id(node))


def _finite_here(root: Any, node: dict, stack: set[int], budget: list[int]) -> bool:
    def finite(sub: Any) -> bool:
        return _finite(root, sub, stack, budget)

    if "const" in node or "enum" in node:
        return True  # the values listed (what else it says narrows them, no more)
    ref = node.get("$ref")
    if isinstance(ref, str) and not finite(_pointer(root, ref)):
        return False
    if isinstance(all_of := node.get("allOf"), list) and not all(finite(s) for s in all_of):
        return False
    for key in ("anyOf", "oneOf"):
        subs = node.get(key)
        if isinstance(subs, list) and subs and not any(finite(s) for s in subs):
            return False
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list):
        return True  # untyped: a string meets its object and array keywords
    return any(_finite_of_type(node, t, finite) for t in types)


def _finite_of_type(node: dict, kind: Any, finite) -> bool:
    if kind == "object":
        properties = node.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        other = node.get("additionalProperties", True)
        if node.get("patternProperties"):
            other = True  # a name it does not list may match a pattern: unsure, so allowed
        required = node.get("required")
        names = required if isinstance(required, list) else []
        return all(finite(properties.get(n, other)) for n in names if isinstance(n, str))
    if kind == "array":
        least = node.get("minItems", 0)
        least = least if isinstance(least, int) else 0
        prefix = node.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        if not all(finite(s) for s in prefix[:least]):
            return False
        items = node.get("items", True)
        return least <= len(prefix) or isinstance(items, list) or finite(items)
    return True


def _pointer(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` (``#``, ``#/$defs/x``) names; True (anything: left to the
    engine) for one this cannot follow."""
    if not ref.startswith("#"):
        return True
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return True
    return node


class _Vocabulary:
    """llguidance's tokenizer protocol (``TokenizerWrapper``'s) over gptkiln's tokenizer: every
    id's bytes; the stop ids and the added special tokens marked special, so no grammar spells
    ``<|im_start|>`` as text."""

    def __init__(self, tokenizer: Any, stops: list[int]) -> None:
        self._tokenizer = tokenizer
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.eos_token_id, self.bos_token_id = stops[0], None
        special = set(stops)
        hf = getattr(tokenizer, "_hf", None)  # a Hugging Face tokenizers.Tokenizer (bpe, hf)
        if hf is not None:
            special |= {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        self.special_token_ids = sorted(i for i in special if i < len(self.tokens))

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        # no BOS added: llguidance tokenizes the text a grammar forces, which must stay text
        return self._tokenizer.encode_templated(text)


@functools.cache
def _executor():
    """llguidance's thread pool for filling many rows' masks at once, made at first use."""
    import llguidance

    return llguidance.LLExecutor()


def fill_masks(constraints: list[Constraint], bitmask) -> None:
    """Each constraint's allowed tokens into its row of ``bitmask`` (N, ceil(V/32)) int32,
    CPU, the rows in parallel on llguidance's threads. Through llguidance's NumPy functions
    over the tensor's memory (the same pointer calls as its torch ones): importing
    ``llguidance.torch`` compiles a kernel gptkiln does not use with ``torch.compile``, ~2.6 s
    that the first constrained request of a process paid."""
    import llguidance.numpy as lln

    matchers = [(c.matcher, i) for i, c in enumerate(constraints)]
    lln.fill_next_token_bitmask_par(_executor(), matchers, bitmask.numpy())
