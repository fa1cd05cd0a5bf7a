"""Continuous batching in `microspec serve`: many sequences share one batched forward pass, and
each still gets exactly its single-stream output.

One server (SmolLM2, speculative self-drafting configured, 16 slots, prompt pieces of 24 tokens
per step so long prompts are prefilled across many steps while others decode, and a draft policy
that lets speculative sequences draft at any load: their trees are verified inside the batched
forward pass, together with the other sequences' rows). 16 clients start
together with mixed prompt lengths and settings: greedy plain ("spec": "none"), greedy
speculative, seeded sampling, a stop string, a small max_tokens, streamed and not, and one
streaming client that disconnects after a few chunks. Every answer that runs to its end must
equal `microspec generate` (the CLI, one sequence alone) for its prompt and settings, token for
token: a sequence that leaves the batch (its limit, its stop string, its client gone) must not
disturb the others. The server's counters prove that speculative sequences drafted trees that were
verified in a forward pass shared with other sequences. A second round of four speculative clients
at once (the same server) proves their trees are drafted together too: one draft forward per tree
level over all of them, each answer still its single-stream output. A small server of its own
with `--spec draft` shows the slots sharing one draft model and drafting together as well. A last
small server (4 slots, 96 tokens of context) shows a sequence that fills its context leaving the
batch without disturbing the others, and SIGTERM mid-batch ending every stream cleanly after a
prefix of its single-stream output. The prefix cache: sixteen three-turn conversations of mixed
kinds at once, with the cache and then with `cache_prompt: false`, give the same answers (and
log-probabilities) turn for turn, every later turn served its earlier prompt from the cache.
"""
import json
import threading

import openai
import pytest
import requests

from server_helpers import SMOLLM2, SPEC_ARGS, ServerProcess, cli_generate, http, metrics, wait_for

N_TOKENS = 24
LONG = ("Speculative decoding drafts several tokens cheaply and verifies them with the large model in one "
        "pass; continuous batching lets many requests share each pass over the weights. ") * 6
PROMPTS = [
    "Name a color.",
    "What is 2 + 2?",
    "Write a haiku about rain.",
    LONG + "Summarise the text above in one sentence.",
    "Say hello in French.",
    "List three prime numbers.",
    LONG + "What does continuous batching share?",
    "Give me one word that rhymes with cat.",
]
SPEC_OFF = {"microspec": {"spec": "none"}}
SAMPLING = {"temperature": 0.8, "top_p": 0.95}
SEEDS = [11, 22, 33]


def cli_sampled(prompt, seed):
    args = ["--temp", "0.8", "--top-p", "0.95", "--top-k", "40", "--seed", str(seed)]
    return cli_generate(SMOLLM2, [prompt], N_TOKENS, chat=True, extra=args)[0]["text"]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(SMOLLM2, *SPEC_ARGS, "--parallel", "16", "--queue", "8", "-c", "1024",
                      "--prefill-chunk", "24", "--spec-max-batch", "16")
    yield s
    assert s.terminate() == 0, s.stderr_text()


def test_sixteen_mixed_clients_get_their_single_stream_outputs(server):
    greedy = [r["text"] for r in cli_generate(SMOLLM2, PROMPTS, N_TOKENS, chat=True)]
    short = cli_generate(SMOLLM2, [PROMPTS[2]], 5, chat=True)[0]["text"]
    # A stop string taken from the middle of a greedy answer: the answer ends just before it.
    stop_prompt = 5
    stop = greedy[stop_prompt][len(greedy[stop_prompt]) // 2:][:6]
    assert stop.strip(), greedy[stop_prompt]
    stopped_text = greedy[stop_prompt][:greedy[stop_prompt].index(stop)]

    # (prompt index, request extras, expected text or None for the leaving client, stream)
    cases = []
    for i in range(8):  # every prompt greedy and plain, half of them streamed
        cases.append((i, {"extra_body": SPEC_OFF}, greedy[i], i % 2 == 0))
    for i in (0, 3, 6):  # greedy through the speculative decoder (long prompts included)
        cases.append((i, {}, greedy[i], i % 2 == 1))
    for k, seed in enumerate(SEEDS):  # seeded sampling, plain
        p = (2 * k + 1) % len(PROMPTS)
        cases.append((p, {"seed": seed, "extra_body": SPEC_OFF, **SAMPLING}, cli_sampled(PROMPTS[p], seed), k == 0))
    cases.append((stop_prompt, {"stop": [stop], "extra_body": SPEC_OFF}, stopped_text, True))
    cases.append((2, {"max_tokens": 5, "extra_body": SPEC_OFF}, short, False))
    assert len(cases) == 16

    before = metrics(server)
    results = [None] * len(cases)
    leaver_chunks = []
    barrier = threading.Barrier(len(cases) + 2)  # the cases, the leaver, this thread

    def run(k, prompt, extras, stream):
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300)
        kw = {"model": "m", "messages": [{"role": "user", "content": PROMPTS[prompt]}], "max_tokens": N_TOKENS,
              "temperature": 0, **extras}
        barrier.wait()
        try:
            if stream:
                text, finish = "", None
                for chunk in client.chat.completions.create(stream=True, **kw):
                    if chunk.choices and chunk.choices[0].delta.content:
                        text += chunk.choices[0].delta.content
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                results[k] = (text, finish)
            else:
                r = client.chat.completions.create(**kw)
                results[k] = (r.choices[0].message.content, r.choices[0].finish_reason)
        except Exception as e:  # reported below with the case
            results[k] = ("error: %r" % e, None)
        finally:
            client.close()

    def leaver():
        # A streaming client with a long answer that closes its connection after three chunks.
        body = {"model": "m", "messages": [{"role": "user", "content": PROMPTS[3]}], "max_tokens": 200,
                "temperature": 0, "stream": True, **SPEC_OFF}
        barrier.wait()
        with requests.post(server.url("/v1/chat/completions"), json=body, stream=True, timeout=300) as r:
            for line in r.iter_lines():
                if line:
                    leaver_chunks.append(line)
                if len(leaver_chunks) >= 3:
                    break  # leaving the with-block closes the connection mid-generation

    threads = [threading.Thread(target=run, args=(k, p, e, s)) for k, (p, e, _, s) in enumerate(cases)]
    threads.append(threading.Thread(target=leaver))
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join()

    wrong = []
    for k, ((p, extras, expected, _), (text, finish)) in enumerate(zip(cases, results)):
        if text != expected:
            wrong.append((k, PROMPTS[p][:40], extras, expected, text))
    assert not wrong, wrong
    assert results[-2][1] == "stop" and results[-1][1] == "length"
    assert len(leaver_chunks) == 3

    # The leaving client's generation was stopped (counted as cancelled), every other one completed.
    after = wait_for(lambda: (lambda m: m if m["microspec_slots_busy"] == 0 else None)(metrics(server)))
    assert after, "slots still busy"

    def delta(name):
        return after[name] - before.get(name, 0)

    assert delta('microspec_generations_total{outcome="completed"}') == len(cases)
    assert delta('microspec_generations_total{outcome="cancelled"}') == 1
    assert delta("microspec_spec_generations_total") == 3
    # Speculation stayed on under load: trees drafted and verified together with other sequences.
    assert delta("microspec_spec_shared_drafting_steps_total") > 0
    assert delta("microspec_spec_accepted_tokens_total") > 0
    # Every step is counted under who drafted it (here the self-draft, or nobody: a plain step).
    by = {d: delta(f'microspec_spec_steps_by_drafter_total{{drafter="{d}"}}') for d in ("plain", "n-gram", "model")}
    assert sum(by.values()) == delta("microspec_spec_steps_total") and by["model"] > 0 and by["n-gram"] == 0, by
    log = server.stderr_text()
    assert "one batch" in log


def greedy_at_once(server, chosen):
    """Greedy chat completions of PROMPTS[i] for i in chosen, all sent at once (every other one
    streamed); returns their texts in order."""
    results = [None] * len(chosen)
    barrier = threading.Barrier(len(chosen))

    def run(k, prompt):
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300)
        kw = {"model": "m", "messages": [{"role": "user", "content": PROMPTS[prompt]}], "max_tokens": N_TOKENS,
              "temperature": 0}
        barrier.wait()
        try:
            if k % 2:
                results[k] = "".join(c.choices[0].delta.content or "" for c in
                                     client.chat.completions.create(stream=True, **kw) if c.choices)
            else:
                results[k] = client.chat.completions.create(**kw).choices[0].message.content
        except Exception as e:  # reported by the caller's comparison
            results[k] = "error: %r" % e
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(k, p)) for k, p in enumerate(chosen)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def drafted_together(server, before, n_generations):
    """Once the server is idle: n_generations more speculative generations since `before`, and how
    many tree levels they drafted in one forward call with other sequences' draft rows."""
    after = wait_for(lambda: (lambda m: m if m["microspec_slots_busy"] == 0 else None)(metrics(server)))
    assert after, "slots still busy"
    assert after["microspec_spec_generations_total"] - before.get("microspec_spec_generations_total", 0) == n_generations
    return after["microspec_spec_shared_draft_forwards_total"] - before.get("microspec_spec_shared_draft_forwards_total", 0)


def test_speculative_clients_draft_together_and_get_their_single_stream_outputs(server):
    """Four speculative greedy clients at once (two long prompts, two short; two streamed): their
    trees are drafted together, one draft forward per tree level over all of them, each with its own
    MicroSpec window; every answer equals the single-stream CLI's."""
    greedy = [r["text"] for r in cli_generate(SMOLLM2, PROMPTS, N_TOKENS, chat=True)]
    chosen = [1, 3, 4, 6]
    before = metrics(server)
    assert greedy_at_once(server, chosen) == [greedy[p] for p in chosen]
    assert drafted_together(server, before, len(chosen)) > 0


# The prefix cache: 16 three-turn conversations at once, of mixed kinds (plain and speculative,
# greedy, seeded sampling, penalties, two choices, streamed and not, log-probabilities).
FOLLOW_UPS = ["Tell me more about that.", "Now say it in one short sentence."]
CONVERSATION_KINDS = [
    {"extra_body": SPEC_OFF},
    {},
    {"seed": 5, "extra_body": SPEC_OFF, **SAMPLING},
    {"seed": 6, **SAMPLING},
    {"presence_penalty": 0.6, "frequency_penalty": 0.3},
    {"n": 2, "seed": 7, "extra_body": SPEC_OFF, **SAMPLING},
    {"logprobs": True, "top_logprobs": 2},
    {"extra_body": {"microspec": {"spec": "none"}, "repeat_penalty": 1.2}},
]


def converse(server, k, cache_prompt, barrier, out):
    """Conversation k: three turns, each continuing the conversation with the first choice's answer.
    out[k]: per turn, (the choices' texts, logprobs or None, prompt_tokens, cached_tokens)."""
    kind = CONVERSATION_KINDS[k % len(CONVERSATION_KINDS)]
    extra_body = {**kind.get("extra_body", {}), "cache_prompt": cache_prompt}
    stream = k % 3 == 0
    messages = [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}]
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300)
    turns = []
    barrier.wait()
    try:
        for turn in range(3):
            kw = {"model": "m", "messages": messages, "max_tokens": N_TOKENS, "temperature": 0,
                  **{key: v for key, v in kind.items() if key != "extra_body"}, "extra_body": extra_body}
            if stream:
                texts, usage = {}, None
                for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
                    for c in chunk.choices:
                        texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                    usage = chunk.usage or usage
                texts, logprobs = [texts[i] for i in sorted(texts)], None
            else:
                r = client.chat.completions.create(**kw)
                texts, usage = [c.message.content for c in r.choices], r.usage
                logprobs = ([(t.token, t.logprob) for t in r.choices[0].logprobs.content]
                            if r.choices[0].logprobs else None)
            turns.append((texts, logprobs, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
            messages = messages + [{"role": "assistant", "content": texts[0]},
                                   {"role": "user", "content": FOLLOW_UPS[min(turn, 1)]}]
        out[k] = turns
    except Exception as e:  # reported by the comparison
        out[k] = "error: %r" % e
    finally:
        client.close()


def conversations_at_once(server, cache_prompt):
    out = [None] * 16
    barrier = threading.Barrier(len(out))
    threads = [threading.Thread(target=converse, args=(server, k, cache_prompt, barrier, out)) for k in range(len(out))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_prompt_cache_on_equals_off_across_sixteen_mixed_conversations(server):
    """Sixteen clients hold three-turn conversations at once, with the prefix cache and then with
    cache_prompt: false: every turn's answers (and log-probabilities) are the same token for token.
    With the cache each later turn was served its conversation's earlier prompt from the slot that
    holds it (usage.prompt_tokens_details.cached_tokens, /metrics); without, nothing."""
    before = metrics(server)
    cached = conversations_at_once(server, cache_prompt=True)
    middle = metrics(server)
    fresh = conversations_at_once(server, cache_prompt=False)
    assert all(isinstance(turns, list) for turns in cached + fresh), (cached, fresh)
    answers = lambda turns: [turn[:3] for turn in turns]  # texts, logprobs, prompt_tokens
    assert [answers(t) for t in cached] == [answers(t) for t in fresh]
    for turns in fresh:
        assert all(cached_tokens == 0 for *_, cached_tokens in turns)
    for turns in cached:
        for previous, now in zip(turns, turns[1:]):
            # The previous turn's whole prompt at least (a speculative decoder's statistics cover that).
            assert now[3] >= previous[2], turns
    served = sum(turn[3] for turns in cached for turn in turns)
    assert served > 0
    assert middle["microspec_prompt_tokens_cached_total"] - before["microspec_prompt_tokens_cached_total"] >= served


def test_draft_model_slots_share_one_draft_model_and_draft_together():
    """--spec draft (SmolLM2 drafting for itself): every slot runs on one copy of the draft model, so
    three clients' tree levels are drafted in one forward call; answers equal the CLI's."""
    s = ServerProcess(SMOLLM2, "--spec", "draft", "--draft-model", SMOLLM2, "--draft-vocab", "dynamic",
                      "--parallel", "3", "-c", "1024", "--spec-max-batch", "16")
    try:
        greedy = [r["text"] for r in cli_generate(SMOLLM2, PROMPTS, N_TOKENS, chat=True)]
        chosen = [0, 3, 5]
        before = metrics(s)
        assert greedy_at_once(s, chosen) == [greedy[p] for p in chosen]
        assert drafted_together(s, before, len(chosen)) > 0
    finally:
        assert s.terminate() == 0, s.stderr_text()


@pytest.mark.parametrize("spec", ["ngram", "head+ngram"])
def test_ngram_and_head_drafters_in_the_batch_give_single_stream_outputs(spec):
    """The drafters without a level-wise backbone (prompt lookup; the EAGLE-3 head beside the model,
    with n-gram matches first) propose each sequence's tree whole inside the batched step: four
    clients at once get the CLI's plain greedy answers, and drafts were accepted."""
    s = ServerProcess(SMOLLM2, "--spec", spec, "--draft-vocab", "dynamic", "--parallel", "4", "-c", "1024",
                      "--spec-max-batch", "16")
    try:
        greedy = [r["text"] for r in cli_generate(SMOLLM2, PROMPTS, N_TOKENS, chat=True)]
        chosen = [0, 3, 5, 6]
        before = metrics(s)
        assert greedy_at_once(s, chosen) == [greedy[p] for p in chosen]
        after = wait_for(lambda: (lambda m: m if m["microspec_slots_busy"] == 0 else None)(metrics(s)))
        assert after, "slots still busy"
        assert after["microspec_spec_generations_total"] - before.get("microspec_spec_generations_total", 0) == 4
        assert after["microspec_spec_accepted_tokens_total"] > before.get("microspec_spec_accepted_tokens_total", 0)
        if spec == "ngram":  # log-probabilities: the verification rows are plain decoding's, bit for bit
            assert logprobs_of(s, spec=True) == logprobs_of(s, spec=False)
    finally:
        assert s.terminate() == 0, s.stderr_text()


def logprobs_of(server, spec):
    """A greedy chat answer's logprobs.content (5 alternatives each), speculative or plain."""
    body = {"messages": [{"role": "user", "content": "Repeat after me: one two three, one two three."}],
            "max_tokens": 32, "temperature": 0, "logprobs": True, "top_logprobs": 5}
    if not spec:
        body["microspec"] = {"spec": "none"}
    status, _, answer = http(server, "POST", "/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["usage"]["microspec"]["speculative"] is spec
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"] > 0
    return content


def stream_chat(server, prompt, events_before):
    """Starts a streamed greedy chat completion (no max_tokens: the context is the limit) over a
    plain connection; returns the response once `events_before` chunks with text have arrived, and
    the text so far."""
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "temperature": 0, "stream": True}
    r = requests.post(server.url("/v1/chat/completions"), json=body, stream=True, timeout=120)
    assert r.status_code == 200, r.text
    lines = r.iter_lines()
    text, seen = "", 0
    while seen < events_before:
        line = next(lines)
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                text, seen = text + delta, seen + 1
    return r, lines, text


def rest_of_stream(lines, text):
    """Reads a stream to its end: (text, finish_reason, error code or None, [DONE] seen last)."""
    finish, error, done = None, None, False
    for line in lines:
        if not line.startswith(b"data: "):
            continue
        done = line == b"data: [DONE]"
        if done:
            continue
        event = json.loads(line[6:])
        if "error" in event:
            error = event["error"]["code"]
            continue
        choice = event["choices"][0]
        text += choice["delta"].get("content") or ""
        finish = choice.get("finish_reason") or finish
    return text, finish, error, done


def test_context_limit_and_sigterm_mid_batch_leave_the_other_sequences_correct():
    """A sequence that fills its context leaves the batch ("length") without disturbing the others,
    and SIGTERM with several sequences in the batch ends every stream cleanly (an error event
    saying why, then [DONE]) after text that is a prefix of its single-stream output."""
    n_ctx = 96
    long_answer = "Explain in detail how a car engine works."
    short = [PROMPTS[0], PROMPTS[1], PROMPTS[4]]
    unlimited = cli_generate(SMOLLM2, [long_answer] + short, 200, chat=True)
    s = ServerProcess(SMOLLM2, *SPEC_ARGS, "--parallel", "4", "-c", str(n_ctx), "--spec-max-batch", "4")
    try:
        # Round 1: the long_answer answer runs into the end of its 96-token context while three short
        # answers (plain and speculative) run beside it.
        expected_short = [r["text"] for r in cli_generate(SMOLLM2, short, N_TOKENS, chat=True)]
        results = [None] * 4
        barrier = threading.Barrier(4)

        def run(k):
            client = openai.OpenAI(base_url=s.url("/v1"), api_key="unused", max_retries=0, timeout=120)
            prompt = long_answer if k == 0 else short[k - 1]
            kw = {"model": "m", "messages": [{"role": "user", "content": prompt}], "temperature": 0}
            if k:
                kw["max_tokens"] = N_TOKENS
            if k == 2:
                kw["extra_body"] = SPEC_OFF
            barrier.wait()
            try:
                r = client.chat.completions.create(**kw)
                results[k] = (r.choices[0].message.content, r.choices[0].finish_reason, r.usage)
            except Exception as e:  # reported by the comparison below
                results[k] = ("error: %r" % e, None, None)
            finally:
                client.close()

        threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        text, finish, usage = results[0]
        assert finish == "length", results[0]
        assert usage.prompt_tokens + usage.completion_tokens >= n_ctx - 1, usage
        # Greedy alone it goes on well past the context: the limit, not the end of the answer, stopped it.
        assert len(unlimited[0]["text"]) > len(text) and unlimited[0]["text"].startswith(text), (text, unlimited[0])
        assert [r[0] for r in results[1:]] == expected_short

        # Round 2: four streams in the batch (one speculative), SIGTERM once each has 3 chunks.
        opened = [stream_chat(s, p, 3) for p in [long_answer] + short]
        s.proc.send_signal(15)
        for k, ((response, lines, so_far), want) in enumerate(zip(opened, unlimited)):
            text, finish, error, done = rest_of_stream(lines, so_far)
            response.close()
            assert want["text"].startswith(text), (text, want["text"])
            # Each stream either ended on its own just before the signal or was told why it stops;
            # the long answer cannot have ended on its own.
            assert done and (error == "server_shutting_down" or finish is not None), (error, finish)
            if k == 0:
                assert error == "server_shutting_down" and len(text) < len(want["text"]), (error, text)
        assert s.terminate(timeout=30) == 0, s.stderr_text()
        assert "SIGTERM" in s.stderr_text()
    finally:
        s.terminate(timeout=30)
