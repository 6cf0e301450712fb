"""The playground page in a real headless Chromium (Debian's chromium and chromium-driver;
the ``browser`` fixture, conftest.py): type a prompt, Generate, and the page shows exactly the
greedy text; Stop ends a stream; served a run like the README's first (context 64), the first
click generates, and a Max tokens past the context is refused before anything is sent."""

import re

import pytest
import torch
from browser import fill, wait_for
from conftest import plays_text
from serving import ServerThread

from gptkiln.api import generate_text
from gptkiln.checkpoint import save_model
from gptkiln.config import GPTConfig, SampleConfig
from gptkiln.inspect import inspect_prompt
from gptkiln.loading import load_run
from gptkiln.model import GPT
from gptkiln.serve.app import create_app
from gptkiln.tokenizers import build_char_tokenizer, train_bpe_tokenizer

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny char-level model (random weights, no end-of-text: it writes all it is asked for)
    with a long context, so a stream lasts long enough to be stopped."""
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer([TEXT], with_eot=False)
    config = GPTConfig.from_name(
        "tiny", vocab_size=tokenizer.vocab_size, context_length=1024, tie_embeddings=False
    )
    return save_model(GPT(config), tmp_path_factory.mktemp("run") / "bard", tokenizer=tokenizer)


@pytest.fixture(scope="module")
def url(run_dir):
    model, tokenizer, _ = load_run(run_dir)
    with ServerThread(create_app(model, tokenizer, model_name="bard")) as url:
        yield url


def state(driver) -> str:
    return driver.find_element("id", "status").get_attribute("data-state")


def test_the_page_streams_exactly_the_greedy_text(browser, url, run_dir, tmp_path):
    prompt = "whether 'tis nobler"
    greedy = generate_text(run_dir, prompt, SampleConfig(max_new_tokens=60, temperature=0))
    browser.get(url)
    wait_for(lambda: "bard" in browser.find_element("id", "model-info").text)
    fill(browser, "prompt", prompt)
    fill(browser, "max-tokens", "60")
    fill(browser, "temperature", "0")
    browser.find_element("id", "generate").click()
    wait_for(lambda: state(browser) == "done")
    shown = browser.find_element("id", "completion").get_property("textContent")
    assert shown == greedy[len(prompt) :]
    assert browser.find_element("id", "output-prompt").get_property("textContent") == prompt
    assert browser.find_element("id", "tokens").text == "60"
    rate = browser.find_element("id", "rate")  # tokens/s once 0.2 s is timed after the first
    basis = re.fullmatch(
        r"(\d+) tokens in (\d+\.\d{3}) s after the first( \(the server's timings\))?",
        rate.get_attribute("title"),
    )
    assert basis and int(basis[1]) == 59, rate.get_attribute("title")  # the server's, at the end
    assert basis[3] == " (the server's timings)"
    assert float(rate.text) == pytest.approx(59 / float(basis[2]), rel=0.01)
    assert browser.find_element("id", "error").text == ""
    browser.save_screenshot(str(tmp_path / "playground.png"))

    browser.set_window_size(390, 844)  # a phone
    width = browser.execute_script("return document.documentElement.scrollWidth")
    assert width <= browser.execute_script("return window.innerWidth")  # no sideways scroll
    assert browser.find_element("id", "generate").is_displayed()
    browser.save_screenshot(str(tmp_path / "playground-phone.png"))
    print(f"screenshots: {tmp_path / 'playground.png'}, {tmp_path / 'playground-phone.png'}")


def test_stop_ends_a_stream_and_frees_its_row(browser, url):
    import httpx

    browser.get(url)
    fill(browser, "prompt", "To be")
    fill(browser, "max-tokens", "1000")
    browser.find_element("id", "generate").click()
    wait_for(lambda: int(browser.find_element("id", "tokens").text or 0) > 5)
    browser.find_element("id", "stop").click()
    wait_for(lambda: state(browser) == "stopped")
    assert int(browser.find_element("id", "tokens").text) < 1000
    wait_for(lambda: httpx.get(f"{url}/health").json()["active"] == 0, timeout=10)


def test_an_error_is_shown_on_the_page(browser, url):
    browser.get(url)
    fill(browser, "prompt", "To be")
    fill(browser, "temperature", "5")
    browser.find_element("id", "generate").click()
    wait_for(lambda: state(browser) == "error")
    assert "temperature" in browser.find_element("id", "error").text


# -- a run like the README's first: `gptkiln train` (qwen3-baby, context 64, a BPE), then serve --
@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """`qwen3-baby`'s shape (context 64) at a BPE of the plays, random weights."""
    torch.manual_seed(0)
    tokenizer = train_bpe_tokenizer([plays_text(20_000)], 512)
    config = GPTConfig.from_name("qwen3-baby", vocab_size=tokenizer.vocab_size)
    assert config.context_length == 64
    return save_model(GPT(config), tmp_path_factory.mktemp("run") / "default", tokenizer=tokenizer)


@pytest.fixture(scope="module")
def default_url(default_run):
    model, tokenizer, _ = load_run(default_run)
    with ServerThread(create_app(model, tokenizer, model_name="default")) as url:
        yield url


def completions_answered(url: str) -> float:
    """How many POST /v1/completions the server has answered, from its /metrics."""
    import httpx

    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("gptkiln_requests_total") and 'route="/v1/completions"' in line
    )


def test_the_first_click_on_a_64_token_model_generates(browser, default_url, default_run):
    import httpx

    prompt = "ROMEO:"
    count = httpx.post(f"{default_url}/v1/tokenize", json={"prompt": prompt}).json()
    assert count["max_model_len"] == 64
    browser.get(default_url)
    wait_for(lambda: "context 64" in browser.find_element("id", "model-info").text)
    fill(browser, "prompt", prompt)  # Max tokens untouched, as a new user leaves it
    browser.find_element("id", "generate").click()
    wait_for(lambda: state(browser) in ("done", "error"))
    assert browser.find_element("id", "error").text == ""
    assert state(browser) == "done"
    room = 64 - count["count"]
    assert browser.find_element("id", "max-tokens").get_attribute("value") == str(room)
    assert browser.find_element("id", "max-tokens-room").text == f"≤ {room}"
    assert int(browser.find_element("id", "tokens").text) > 0  # tokens arrived
    assert browser.find_element("id", "completion").get_property("textContent")


def test_max_tokens_past_the_context_is_refused_before_it_is_sent(browser, default_url):
    import httpx

    prompt = "ROMEO:"
    room = 64 - httpx.post(f"{default_url}/v1/tokenize", json={"prompt": prompt}).json()["count"]
    browser.get(default_url)
    wait_for(lambda: "context 64" in browser.find_element("id", "model-info").text)
    fill(browser, "prompt", prompt)
    fill(browser, "max-tokens", "100")
    sent = completions_answered(default_url)
    browser.find_element("id", "generate").click()
    wait_for(lambda: state(browser) == "error")
    error = browser.find_element("id", "error").text
    assert "Max tokens 100 exceed the model's context of 64" in error
    assert f"at most {room}" in error
    assert completions_answered(default_url) == sent  # the page said it; the server never heard


# -- the Inspect view ------------------------------------------------------------------------------
PIXEL = """
const [q, k] = arguments, canvas = document.getElementById("heatmap");
const c = +canvas.dataset.cell, m = +canvas.dataset.margin, r = window.devicePixelRatio || 1;
const x = Math.floor((m + (k + 0.5) * c) * r), y = Math.floor((m + (q + 0.5) * c) * r);
return Array.from(canvas.getContext("2d").getImageData(x, y, 1, 1).data.slice(0, 3));
"""


def rgb(driver, weight: float) -> list[int]:
    """The colour the page gives a weight (its viridis ramp), as [r, g, b]."""
    css = driver.execute_script("return colour(arguments[0])", weight)
    return [int(v) for v in css[4:-1].split(",")]


def shown_view(driver) -> str:
    return driver.find_element("id", "heatmap").get_attribute("data-view") or ""


def test_the_inspect_view_draws_the_map_and_a_hover_changes_it(browser, url, run_dir, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import Select

    prompt = "To be, or not to be"
    model, tokenizer, _ = load_run(run_dir)
    want = inspect_prompt(model, tokenizer, prompt, top_k=5, max_tokens=32)
    T, layer, head = len(want.ids), 1, 1
    weights = want.attention[layer, head]  # (T, T)
    browser.get(url)
    wait_for(lambda: "bard" in browser.find_element("id", "model-info").text)
    browser.find_element("id", "tab-inspect").click()
    assert not browser.find_element("id", "view-generate").is_displayed()
    fill(browser, "inspect-prompt", prompt)
    browser.find_element("id", "inspect-run").click()
    wait_for(
        lambda: browser.find_element("id", "inspect-status").get_attribute("data-state") == "done"
    )
    Select(browser.find_element("id", "layer")).select_by_value(str(layer))
    Select(browser.find_element("id", "head")).select_by_value(str(head))
    assert shown_view(browser) == f"{layer}/{head}/{T - 1}"  # the last token's row at first

    # The map is drawn: each cell has its weight's colour, the future is grey.
    for q, k in [(T - 1, 0), (T - 1, T - 1), (3, 1), (7, 7)]:
        got = browser.execute_script(PIXEL, q, k)
        assert got == pytest.approx(rgb(browser, float(weights[q, k])), abs=2), (q, k)
    assert browser.execute_script(PIXEL, 0, T - 1) == [228, 228, 228]
    chips = browser.find_elements("css selector", "#token-strip .tok")
    assert [c.get_property("textContent") for c in chips] == want.labels

    # Hovering a token shows what it attends to: its row outlined, its keys lit, its top-k.
    before = browser.execute_script("return document.getElementById('heatmap').toDataURL()")
    ActionChains(browser).move_to_element(chips[3]).perform()
    wait_for(lambda: shown_view(browser) == f"{layer}/{head}/3")
    after = browser.execute_script("return document.getElementById('heatmap').toDataURL()")
    assert after != before
    lit = [float(c.get_attribute("data-weight")) for c in chips]
    assert lit[:4] == pytest.approx(weights[3, :4].tolist(), abs=1e-4)
    assert lit[4:] == [0.0] * (T - 4) and sum(lit) == pytest.approx(1, abs=1e-3)
    bars = browser.find_elements("css selector", "#topk li:not(.hint) .label")
    assert [b.get_property("textContent") for b in bars] == [
        c.label for c in want.positions[3].top_k
    ]
    assert want.labels[3] in browser.find_element("id", "topk-title").text

    # Hovering a row of the map selects that query too. (An offset counts from the centre of
    # the element's part in view: the whole map is scrolled into view first.)
    canvas = browser.find_element("id", "heatmap")
    browser.execute_script("arguments[0].scrollIntoView({block: 'end'})", canvas)
    cell, margin = (float(canvas.get_attribute(a)) for a in ("data-cell", "data-margin"))
    size = canvas.size
    ActionChains(browser).move_to_element_with_offset(
        canvas,
        int(margin + 0.5 * cell - size["width"] / 2),
        int(margin + 5.5 * cell - size["height"] / 2),
    ).perform()
    wait_for(lambda: shown_view(browser) == f"{layer}/{head}/5")
    assert "→" in browser.find_element("id", "cell-info").text
    browser.set_window_size(1280, 1300)  # the whole view, bars included
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(str(tmp_path / "inspect.png"))

    browser.set_window_size(390, 844)  # a phone
    width = browser.execute_script("return document.documentElement.scrollWidth")
    assert width <= browser.execute_script("return window.innerWidth")
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(str(tmp_path / "inspect-phone.png"))
    print(f"screenshots: {tmp_path / 'inspect.png'}, {tmp_path / 'inspect-phone.png'}")


def test_an_inspect_error_is_shown_on_the_page(browser, url):
    browser.get(url)
    wait_for(lambda: "bard" in browser.find_element("id", "model-info").text)
    browser.find_element("id", "tab-inspect").click()
    fill(browser, "inspect-prompt", "To be")
    fill(browser, "inspect-max-tokens", "500")
    browser.find_element("id", "inspect-run").click()
    wait_for(
        lambda: browser.find_element("id", "inspect-status").get_attribute("data-state") == "error"
    )
    assert "1 to 64" in browser.find_element("id", "inspect-error").text
    fill(browser, "inspect-max-tokens", "20")
    fill(browser, "inspect-prompt", "")  # an empty prompt: the server's own error, shown
    browser.find_element("id", "inspect-run").click()
    wait_for(
        lambda: browser.find_element("id", "inspect-status").get_attribute("data-state") == "error"
    )
    assert "prompt is empty" in browser.find_element("id", "inspect-error").text


def sent_bodies(driver, route: str) -> list[dict]:
    """The JSON bodies the page has sent to ``route`` since `record_requests`."""
    import json

    return [json.loads(b) for u, b in driver.execute_script("return window.sent") if route in u]


def record_requests(driver) -> None:
    driver.execute_script(
        "window.sent = []; const fetched = window.fetch;"
        "window.fetch = function (u, o) { window.sent.push([String(u), o && o.body]);"
        " return fetched.apply(this, arguments); };"
    )


def test_a_number_is_sent_as_typed_never_cut_to_its_leading_digits(browser, url):
    """A number field holds what the person typed ("1e2", "2.5"), and the page sends that
    number: parseInt read "1e2" as 1 and "2.5" as 2, so 1e2 Max tokens generated one token."""
    browser.get(url)
    wait_for(lambda: "bard" in browser.find_element("id", "model-info").text)
    record_requests(browser)
    fill(browser, "prompt", "To be")
    fill(browser, "max-tokens", "1e2")
    fill(browser, "seed", "1e1")
    browser.find_element("id", "generate").click()
    wait_for(lambda: state(browser) in ("done", "error"))
    assert browser.find_element("id", "tokens").text == "100"
    (body,) = sent_bodies(browser, "/v1/completions")
    assert (body["max_tokens"], body["seed"]) == (100, 10)

    fill(browser, "max-tokens", "2.5")  # not a whole number: refused, not sent as 2
    browser.find_element("id", "generate").click()
    wait_for(lambda: state(browser) == "error")
    assert "max_tokens must be a whole number" in browser.find_element("id", "error").text

    browser.find_element("id", "tab-inspect").click()
    fill(browser, "inspect-prompt", "To be, or not to be, that is")
    fill(browser, "inspect-max-tokens", "1e1")
    browser.find_element("id", "inspect-run").click()
    status = browser.find_element("id", "inspect-status")
    wait_for(lambda: status.get_attribute("data-state") in ("done", "error"))
    assert sent_bodies(browser, "/v1/inspect")[-1]["max_tokens"] == 10
    assert browser.find_element("id", "inspect-tokens").text.startswith("10 of ")


def test_stop_pressed_before_the_request_is_sent_stops_it(browser, url):
    """Generate counts the prompt (POST /v1/tokenize) before it sends the request, with Stop
    already on: a Stop then was ignored and the whole completion streamed."""
    browser.get(url)
    wait_for(lambda: "bard" in browser.find_element("id", "model-info").text)
    fill(browser, "prompt", "To be")
    fill(browser, "max-tokens", "1000")
    browser.execute_script(
        "document.getElementById('generate').click();"
        "document.getElementById('stop').click();"  # on, while the prompt is counted
    )
    wait_for(lambda: state(browser) != "running")
    assert state(browser) == "stopped"
    assert int(browser.find_element("id", "tokens").text) < 1000


def test_a_seed_is_sent_with_all_its_digits(browser, url):
    """A seed goes up to 2^63 - 1, past what a JavaScript number holds exactly: the page sent
    the documented maximum 9223372036854775807 as 9223372036854776000, which was refused."""
    import httpx

    top = 2**63 - 1
    browser.get(url)
    wait_for(lambda: "bard" in browser.find_element("id", "model-info").text)
    record_requests(browser)
    fill(browser, "prompt", "To be")
    fill(browser, "max-tokens", "8")
    fill(browser, "seed", str(top))
    browser.find_element("id", "generate").click()
    wait_for(lambda: state(browser) in ("done", "error"))
    assert browser.find_element("id", "error").text == ""
    assert sent_bodies(browser, "/v1/completions")[-1]["seed"] == top
    api = httpx.post(
        f"{url}/v1/completions", json={"prompt": "To be", "max_tokens": 8, "seed": top}
    )
    shown = browser.find_element("id", "completion").get_property("textContent")
    assert shown == api.json()["choices"][0]["text"]

    fill(browser, "seed", "0012345678901234567890")  # past the range: the server's words
    browser.find_element("id", "generate").click()
    wait_for(lambda: state(browser) == "error")
    assert sent_bodies(browser, "/v1/completions")[-1]["seed"] == 12345678901234567890
    assert "12345678901234567890" in browser.find_element("id", "error").text


def test_a_stop_string_can_hold_a_newline(browser, url):
    """The box takes one stop string a line, so a newline (the commonest stop) needs its
    escape: \\n, with \\t and \\\\; an empty line is still none."""
    browser.get(url)
    wait_for(lambda: "bard" in browser.find_element("id", "model-info").text)
    record_requests(browser)
    fill(browser, "prompt", "To be")
    fill(browser, "max-tokens", "4")
    fill(browser, "stop-strings", "\\n\n\na\\tb\nx\\\\n")
    browser.find_element("id", "generate").click()
    wait_for(lambda: state(browser) in ("done", "error"))
    assert browser.find_element("id", "error").text == ""
    assert sent_bodies(browser, "/v1/completions")[-1]["stop"] == ["\n", "a\tb", "x\\n"]
    assert "\\n" in browser.find_element("id", "stop-strings").get_attribute("placeholder")


@pytest.fixture(scope="module")
def keyed_url(default_run):
    """The README's first run served with --api-key sekrit and --max-body-bytes 4096."""
    model, tokenizer, _ = load_run(default_run)
    app = create_app(model, tokenizer, model_name="keyed", api_key="sekrit", max_body_bytes=4096)
    with ServerThread(app) as url:
        yield url


def room_shown(driver) -> str:
    return driver.find_element("id", "max-tokens-room").text


def test_an_api_key_entered_on_the_page_takes_at_once(browser, keyed_url):
    """Without the key the page says where to enter it and sizes nothing it cannot count; once
    it is entered the header, Max tokens and Generate follow, with no reload."""
    import httpx

    auth = {"Authorization": "Bearer sekrit"}
    count = httpx.post(f"{keyed_url}/v1/tokenize", json={"prompt": "ROMEO:"}, headers=auth)
    room = 64 - count.json()["count"]
    browser.get(keyed_url)
    wait_for(lambda: "API key needed" in browser.find_element("id", "model-info").text)
    fill(browser, "prompt", "ROMEO:")
    wait_for(lambda: room_shown(browser) == "(key needed)")  # not "≤ 63", a 1-token prompt's
    fields = [browser.find_element("id", i).rect for i in ("max-tokens", "temperature")]
    assert fields[0]["y"] == fields[1]["y"]  # a label on two lines: its field still in line
    browser.find_element("id", "generate").click()
    wait_for(lambda: state(browser) == "error")
    error = browser.find_element("id", "error").text
    assert "enter it in API key, in the Generate view's Sampling panel" in error
    assert "Authorization" not in error  # the header is the API's business, not the page's

    fill(browser, "api-key", "wrong")
    wait_for(lambda: "API key refused" in browser.find_element("id", "model-info").text)
    wait_for(lambda: room_shown(browser) == "(key refused)")  # as the header: not "needed"
    fill(browser, "api-key", "sekrit")
    wait_for(lambda: browser.find_element("id", "model-info").text == "keyed · context 64")
    wait_for(lambda: room_shown(browser) == f"≤ {room}")
    assert browser.find_element("id", "max-tokens").get_attribute("value") == str(room)
    browser.find_element("id", "generate").click()
    wait_for(lambda: state(browser) in ("done", "error"))
    assert browser.find_element("id", "error").text == ""

    fill(browser, "prompt", "x" * 5000)  # past --max-body-bytes: uncounted, and why
    wait_for(lambda: room_shown(browser) == "(prompt too large)")
    browser.find_element("id", "generate").click()
    wait_for(lambda: state(browser) == "error")
    assert "over 4,096 bytes" in browser.find_element("id", "error").text


STREAM = r"""
const [reads, wait, timings] = arguments;  // each read's token texts; the first token's wait
// (ms); the usage chunk's timings (null: none)
let clock = 0;  // performance.now: still but for the wait and 10 ms before each later read
performance.now = () => clock;
const fetched = window.fetch;
window.fetch = function (u, o) {
  if (!String(u).includes("/v1/completions")) return fetched.apply(this, arguments);
  clock += wait;
  const event = (chunk) => `data: ${JSON.stringify(chunk)}\n\n`;
  const texts = reads.map((texts) =>
    texts.map((text) => event({ choices: [{ index: 0, text, finish_reason: null }] })).join(""));
  const tokens = reads.flat().length, usage = { completion_tokens: tokens };
  texts.push(event({ choices: [{ index: 0, text: "", finish_reason: "length" }] })
    + event({ choices: [], usage, ...(timings ? { timings } : {}) }) + "data: [DONE]\n\n");
  window.shownRates = [];  // every figure the page shows as it comes
  const shown = (records) => records.forEach((r) => r.addedNodes.forEach(
    (n) => shownRates.push(n.textContent)));
  new MutationObserver(shown).observe(document.getElementById("rate"), { childList: true });
  let n = 0;
  const body = new ReadableStream({
    pull(controller) {  // one read at a time (highWaterMark 0), each 10 ms after the last
      if (n > 0) clock += 10;
      if (n === texts.length) return controller.close();
      controller.enqueue(new TextEncoder().encode(texts[n++]));
    },
  }, { highWaterMark: 0 });
  return Promise.resolve(new Response(body, { headers: { "Content-Type": "text/event-stream" } }));
};
"""


def stream_rates(
    browser, url, reads: list[list[str]], wait_ms: int, timings: dict | None = None
) -> list[str]:
    """Generate on the page against a stream of ``reads`` (each read's token texts), its first
    token after ``wait_ms`` and each later read 10 ms after the one before (a still clock
    otherwise), the usage chunk with ``timings``; the tokens/s figures the page showed as they
    came."""
    browser.get(url)
    wait_for(lambda: "bard" in browser.find_element("id", "model-info").text)
    browser.execute_script(STREAM, reads, wait_ms, timings)
    fill(browser, "prompt", "To be")
    browser.find_element("id", "generate").click()
    wait_for(lambda: state(browser) == "done")
    assert browser.find_element("id", "completion").get_property("textContent") == "".join(
        sum(reads, [])
    )
    assert browser.find_element("id", "tokens").text == str(len(sum(reads, [])))
    return browser.execute_script("return window.shownRates")


def test_tokens_per_second_is_not_timed_over_one_burst(browser, url):
    """Four tokens read in one go were timed over the microseconds between their chunks:
    tokens/s showed thousands. Tokens read with the first took none of the time after it, and a
    span that short times nothing: the rate is "–", not a figure over the whole request (as
    it was: 66.7, 100.0, 133.3, then 80.0)."""
    rates = stream_rates(browser, url, [["To", " be", ",", " or"]], wait_ms=30)
    assert browser.find_element("id", "rate").text == "–"
    assert set(rates) <= {"–"}
    assert browser.find_element("id", "ttft").text == "0.03 s"


def test_tokens_per_second_is_the_decode_rate_after_the_first_token(browser, url):
    """A 2 s wait for the first token (a long prompt's prefill), three tokens in its read, then
    a token every 10 ms: tokens/s is 100, the tokens after the first read over the time since
    it, and "–" until that is 0.2 s; the wait is the first token's figure. Before, it showed
    the whole request's rate until then (1.0, 1.5, ... 10.0, the wait in it), then counted the
    burst's tokens as come after the first (110.0 ... 106.7)."""
    reads = [["To", " be", ","]] + [[" or"]] * 30
    rates = stream_rates(browser, url, reads, wait_ms=2000)
    assert browser.find_element("id", "ttft").text == "2.00 s"
    assert browser.find_element("id", "rate").text == "100.0"
    assert browser.find_element("id", "rate").get_attribute("title") == (
        "30 tokens in 0.300 s after the first"
    )
    assert rates == ["–"] * 19 + ["100.0"] * 11  # 19 reads short of 0.2 s, then 100 each


def test_tokens_per_second_ends_as_the_servers_own_timing(browser, url):
    """The usage chunk's ``timings`` (the server's, llama.cpp's fields) are the figure at the
    end: an answer too short to time on the page gets one, a longer one the server's over the
    page's; timings without a rate (one token) leave the page's as it was."""
    timings = {"predicted_n": 4, "predicted_ms": 12.5, "predicted_per_second": 240.0}
    rates = stream_rates(browser, url, [["To", " be", ",", " or"]], 30, timings)
    assert rates[-1] == "240.0" and set(rates[:-1]) <= {"–"}
    assert browser.find_element("id", "rate").get_attribute("title") == (
        "3 tokens in 0.013 s after the first (the server's timings)"
    )
    reads = [["To", " be", ","]] + [[" or"]] * 30
    timings = {"predicted_n": 33, "predicted_ms": 336.8, "predicted_per_second": 95.0}
    rates = stream_rates(browser, url, reads, 2000, timings)
    assert rates[-2:] == ["100.0", "95.0"]  # the page's figure, then the server's
    timings = {"predicted_n": 1, "predicted_ms": 0.0, "predicted_per_second": None}
    stream_rates(browser, url, [["To"]], 30, timings)
    assert browser.find_element("id", "rate").text == "–"


def test_an_inspect_error_stands_alone_not_beside_the_last_inspection(browser, url):
    """A refused Inspect showed its error under the previous prompt's tokens, loss, map and
    bars, as though they were its own."""
    browser.get(url)
    wait_for(lambda: "bard" in browser.find_element("id", "model-info").text)
    browser.find_element("id", "tab-inspect").click()
    fill(browser, "inspect-prompt", "To be, or not")
    status = browser.find_element("id", "inspect-status")
    browser.find_element("id", "inspect-run").click()
    wait_for(lambda: status.get_attribute("data-state") == "done")
    assert browser.find_element("id", "inspect-tokens").text == "13"
    fill(browser, "inspect-top-k", "0")  # the server refuses it
    browser.find_element("id", "inspect-run").click()
    wait_for(lambda: status.get_attribute("data-state") == "error")
    assert "top_k" in browser.find_element("id", "inspect-error").text
    for stat in ("inspect-tokens", "inspect-loss", "inspect-ppl"):
        assert browser.find_element("id", stat).text == "–", stat
    for shown in ("#token-strip .tok", "#topk li"):
        assert browser.find_elements("css selector", shown) == [], shown
    assert browser.find_element("id", "heatmap").get_attribute("width") == "0"


def not_found(url: str) -> float:
    """How many requests the server has answered 404 (a path it does not serve), from /metrics."""
    import httpx

    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("gptkiln_requests_total") and 'status="404"' in line
    )


def test_the_page_asks_for_no_favicon_it_cannot_have(browser, url):
    """The page's icon is inline: the browser asked for /favicon.ico on every load, a 404 and
    the one error in the console of a clean page."""
    import time

    before = not_found(url)
    browser.get(url)
    wait_for(lambda: "bard" in browser.find_element("id", "model-info").text)
    time.sleep(0.5)  # the browser asks for the icon after the page has loaded
    assert not_found(url) == before
    icon = browser.find_element("css selector", "link[rel=icon]").get_attribute("href")
    assert icon.startswith("data:image/svg+xml")
