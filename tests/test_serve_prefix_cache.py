"""Prefix caching: a prompt that shares a cached prefix prefills only the rest and says the
same greedy text as without the cache; the blocks stay within their bytes, the least recently
used (a prefix's later blocks first) going first; /metrics counts the hits."""

import asyncio
import copy

import httpx
import pytest
import torch
from serving import ServerThread

from gptkiln.config import GPTConfig, SampleConfig
from gptkiln.model import GPT
from gptkiln.serve.app import create_app
from gptkiln.serve.batcher import Batcher
from gptkiln.serve.events import Done, Sequence, Token
from gptkiln.serve.prefix_cache import PrefixCache
from gptkiln.tokenizers import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("gpt2")


@pytest.fixture(scope="module")
def model(tokenizer) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig.from_name(
        "tiny", vocab_size=tokenizer.vocab_size, context_length=256, tie_embeddings=False
    )
    return GPT(config).eval()


SYSTEM = list(range(1000, 1100))  # 100 shared tokens: three blocks of 32 reused
GREEDY = SampleConfig(max_new_tokens=12, temperature=0)


def generate_one_by_one(model, tokenizer, prompts, **options):
    """Each prompt through the batcher after the one before finished: (texts, the batcher)."""
    batcher = Batcher(copy.deepcopy(model), tokenizer, max_batch=2, **options)

    async def main():
        await batcher.start()
        texts = []
        try:
            for prompt in prompts:
                seq = Sequence(prompt, GREEDY, asyncio.Queue())
                batcher.submit([seq])
                ids = []
                while not isinstance(event := await seq.events.get(), Done):
                    assert isinstance(event, Token), event
                    ids.append(event.id)
                texts.append(ids)
        finally:
            await batcher.stop()
        return texts

    return asyncio.run(main()), batcher


def test_a_shared_prefix_is_reused_and_the_text_is_the_same(model, tokenizer):
    prompts = [SYSTEM + [5, 6, 7], SYSTEM + [8, 9], SYSTEM[:40] + [1, 2], SYSTEM + [5, 6, 7]]
    cached, batcher = generate_one_by_one(model, tokenizer, prompts)
    plain, off = generate_one_by_one(model, tokenizer, prompts, prefix_cache_bytes=0)
    assert cached == plain
    cache = batcher.prefix_cache
    # the 2nd and 4th reuse 96 tokens, the 3rd its first block; the first finds nothing
    assert (cache.lookups, cache.hits, cache.hit_tokens) == (4, 3, 96 + 32 + 96)
    assert off.prefix_cache.hits == 0


def test_the_blocks_stay_within_their_bytes_and_old_ones_go_first(model):
    m = copy.deepcopy(model)
    m.setup_cache(1, 256)
    one_block = PrefixCache(m, block_tokens=32, max_bytes=1 << 30)
    one_block.store(0, list(range(33)))
    size = one_block.bytes  # one block's keys and values
    cache = PrefixCache(m, block_tokens=32, max_bytes=3 * size)
    cache.store(0, list(range(97)))  # three blocks: full
    assert cache.bytes == 3 * size and cache.load(0, list(range(97))) == 96
    cache.store(0, [7] * 65)  # two more: the first prompt's two later blocks go
    assert cache.bytes <= 3 * size
    assert cache.load(0, list(range(97))) == 32  # its first block stays: it was used last
    assert cache.load(0, [7] * 65) == 64
    with torch.no_grad():  # what load copied in is what store copied out
        row = [c.k[0, :, :32].clone() for c in (b.attn.kv_cache for b in m.h)]
        for c in (b.attn.kv_cache for b in m.h):
            c.k.zero_()
        assert cache.load(0, list(range(33))) == 32
        for before, c in zip(row, (b.attn.kv_cache for b in m.h)):
            torch.testing.assert_close(c.k[0, :, :32], before)
    m.clear_cache()


def test_metrics_count_the_hits(model, tokenizer):
    app = create_app(copy.deepcopy(model), tokenizer, model_name="m", max_batch=2)
    with ServerThread(app) as url:
        for _ in range(2):
            body = {"prompt": SYSTEM + [1], "max_tokens": 2, "temperature": 0}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        text = httpx.get(f"{url}/metrics").text
    assert "gptkiln_prefix_cache_hits_total 1.0" in text
    assert "gptkiln_prefix_cache_hit_tokens_total 96.0" in text
