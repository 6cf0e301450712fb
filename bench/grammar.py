"""The three JSON-schema grammar engines over GPT-2's vocabulary, on this CPU: what constraining
costs per token at batch 1 and 8, and what compiling a schema costs.

Each engine gets GPT-2's 50,257 token byte strings (gptkiln's own tokenizer) and one schema (an
object of a short string, a bounded integer, an enum and a short list of short strings, so
that noise ends within the tokens given). A decode step is what the
server's batcher does for each constrained row: the engine fills the row's bitmask, the mask is
applied to the row's logits (`gptkiln.logits_processors.apply_token_bitmask`, the same for all
three),
the token is chosen (greedy over noise logits: a random model's), and the engine consumes it.
The figure is the time of those steps, per token, against the unconstrained step (noise logits,
greedy pick) on the same logits, alternating engines each round so a busy host spreads over all.

    PYTHONPATH=src python bench/grammar.py [--rounds 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from gptkiln.logits_processors import apply_token_bitmask
from gptkiln.tokenizers import GPT2Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "colour", "tags"],
    "additionalProperties": False,
}


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokens: list[bytes], eos: int) -> None:
        import llguidance
        import llguidance.torch as llt

        self.llg, self.llt = llguidance, llt
        t0 = time.perf_counter()
        wrapped = llguidance.TokenizerWrapper(_Wrapper(tokens, eos))
        self.tok = llguidance.LLTokenizer(wrapped, n_vocab=len(tokens))
        self.setup = time.perf_counter() - t0
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        return grammar

    def matcher(self, grammar):
        m = self.llg.LLMatcher(self.tok, grammar)
        assert not m.is_error(), m.get_error()
        return m

    def fill(self, rows, bitmask) -> None:
        if len(rows) == 1:
            self.llt.fill_next_token_bitmask(rows[0][1], bitmask, rows[0][0])
        else:
            self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in rows], bitmask)

    def consume(self, m, token: int) -> bool:
        return m.consume_token(token) and not m.is_stopped()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokens: list[bytes], eos: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.setup = time.perf_counter() - t0

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True)

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, rows, bitmask) -> None:
        for i, m in rows:
            m.fill_next_token_bitmask(bitmask, i)

    def consume(self, m, token: int) -> bool:
        return m.accept_token(token) and not m.is_terminated()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokens: list[bytes], eos: int) -> None:
        import outlines_core as oc

        self.oc = oc
        t0 = time.perf_counter()
        vocab: dict[bytes, list[int]] = {}
        for i, b in enumerate(tokens):
            if i != eos:
                vocab.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(eos, vocab)
        self.setup = time.perf_counter() - t0

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocab)

    def matcher(self, index):
        return self.oc.Guide(index)

    def fill(self, rows, bitmask) -> None:
        for i, g in rows:
            row = bitmask[i]
            g.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def consume(self, g, token: int) -> bool:
        g.advance(token)
        return not g.is_finished()


class _Wrapper:
    """llguidance's tokenizer protocol over a list of token byte strings."""

    def __init__(self, tokens: list[bytes], eos: int) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, None
        self.special_token_ids = [eos]
        self._gpt2 = GPT2Tokenizer()

    def __call__(self, text):
        text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        return self._gpt2.encode(text)


def run_engine(engine, grammar, batch: int, tokens: int, vocab: int, decode):
    """Seconds per token constrained and unconstrained (the same noise logits), and how many
    rows ended with text that parses as JSON."""
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(tokens, batch, vocab, generator=gen)
    matchers = [engine.matcher(grammar) for _ in range(batch)]
    bitmask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)
    alive = [True] * batch
    made: list[list[int]] = [[] for _ in range(batch)]
    t0 = time.perf_counter()
    for step in range(tokens):
        logits = noise[step].clone()
        engine.fill([(i, m) for i, m in enumerate(matchers) if alive[i]], bitmask)
        apply_token_bitmask(logits, bitmask)
        chosen = logits.argmax(-1).tolist()
        for i, m in enumerate(matchers):
            if alive[i]:
                alive[i] = engine.consume(m, chosen[i])
                made[i].append(chosen[i])
        if not any(alive):
            break
    constrained = (time.perf_counter() - t0) / (step + 1)
    t0 = time.perf_counter()
    for s in range(step + 1):
        noise[s].clone().argmax(-1).tolist()
    free = (time.perf_counter() - t0) / (step + 1)
    parsed = 0
    for ids in made:
        try:
            json.loads(decode([t for t in ids if t != vocab - 1]))
            parsed += 1
        except ValueError:
            pass
    return constrained, free, parsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = GPT2Tokenizer()
    vocab = tok.vocab_size
    tokens = [tok.token_bytes(i) for i in range(vocab)]
    engines = [cls(tokens, tok.eot_id) for cls in (LLGuidance, XGrammar, OutlinesCore)]
    cpu = _cpu_name()
    print(f"# bench/grammar.py on {cpu}, torch threads 1, GPT-2 vocab {vocab}")
    compiled = {}
    for e in engines:
        t0 = time.perf_counter()
        compiled[e.name] = e.compile(SCHEMA)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        e.matcher(compiled[e.name])
        matcher = time.perf_counter() - t0
        print(
            f"{e.name:14s} tokenizer setup {e.setup * 1e3:8.1f} ms, schema compile "
            f"{first * 1e3:8.1f} ms, a matcher {matcher * 1e3:6.2f} ms"
        )
    per: dict[tuple[str, int], list[float]] = {}
    parsed: dict[tuple[str, int], int] = {}
    for _ in range(args.rounds):
        for batch in (1, 8):
            for e in engines:
                c, f, ok = run_engine(e, compiled[e.name], batch, args.tokens, vocab, tok.decode)
                per.setdefault((e.name, batch), []).append((c - f) / batch)
                parsed[e.name, batch] = parsed.get((e.name, batch), 0) + ok
    for (name, batch), values in per.items():
        print(
            f"{name:14s} batch {batch}: +{statistics.median(values) * 1e6:8.1f} us per row-token "
            f"(median of {len(values)}; min {min(values) * 1e6:.1f}); rows that parse: "
            f"{parsed[name, batch]}/{len(values) * batch}"
        )


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
