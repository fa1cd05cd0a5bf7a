"""The chat page of `microspec serve` in headless Chromium (Debian's `chromium`, driven by the
`playwright` package with executable_path; no browser download).

Types a prompt, waits for the streamed answer, and requires: the reply text equals the CLI's greedy
answer for that prompt, the text grew over several updates (streamed, not one block), and the final
statistics line shows tok/s, acceptance length and active vocabulary from the server's usage
extension. Saves a screenshot to tests/artifacts/chat_page.png.
"""
import os
import shutil

import pytest
from playwright import sync_api as playwright_api  # scripts/requirements.txt

from server_helpers import ARTIFACTS, SMOLLM2, SPEC_ARGS, ServerProcess, cli_generate

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
PROMPT = "Write a haiku about rain."
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(SMOLLM2, *SPEC_ARGS)
    yield s
    assert s.terminate() == 0, s.stderr_text()


def test_chat_page(server):
    assert os.path.exists(CHROMIUM), "Debian's chromium is not installed (scripts/setup.sh installs it)"
    want = cli_generate(SMOLLM2, [PROMPT], MAX_TOKENS, chat=True)[0]["text"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 700})
            page.goto(server.url("/"))
            page.wait_for_function("document.getElementById('model').textContent.includes('smollm2')")
            assert "spec self" in page.inner_text("#model")
            page.fill("#max_tokens", str(MAX_TOKENS))
            # Record every change of the reply's text, to see it arrive in pieces.
            page.evaluate("""() => {
                window.__updates = [];
                new MutationObserver(() => {
                    const t = document.querySelector('.msg.assistant .text');
                    if (t) window.__updates.push(t.textContent);
                }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
            }""")
            page.fill("#prompt", PROMPT)
            page.press("#prompt", "Enter")
            page.wait_for_selector(".msg.assistant .stats[data-final='true']", timeout=60000)
            reply = page.inner_text(".msg.assistant .text")
            stats_el = page.query_selector(".msg.assistant .stats")
            stats = stats_el.inner_text()
            tps = float(stats_el.get_attribute("data-tps"))
            acceptance = float(stats_el.get_attribute("data-acceptance"))
            vocab = float(stats_el.get_attribute("data-vocab"))
            updates = page.evaluate("window.__updates")
            page.screenshot(path=str(ARTIFACTS / "chat_page.png"), full_page=True)
        finally:
            browser.close()
    assert reply == want
    distinct = [u for i, u in enumerate(updates) if u and (i == 0 or u != updates[i - 1])]
    assert len(distinct) >= 5, updates  # streamed: many partial texts before the final one
    assert all(want.startswith(u) for u in distinct)
    assert tps > 0 and acceptance >= 1.0 and 0 < vocab < 49152
    assert "tok/s" in stats and "acceptance" in stats and "active vocab" in stats
    print("\nchat page stats: " + stats)
