"""Tokenizer conformance: `microspec tokenize` against llama.cpp (llama-cpp-python) on both model files.

Every corpus text (tokenizer_texts.json, plus a ~4k-token long text) is encoded with and without BOS
and with and without special-token parsing; ids must be identical. Token pieces are compared for the
whole vocabulary, decoding must round-trip, the end-of-generation set must agree, and the chat
formats (microspec's built-in Jinja templates) must render exactly as the file's own Jinja template
(SmolLM2) or llama.cpp's built-in formats (Gemma, ChatML, Llama 3) do.

Needs the `llama_cpp` module; without it the tests fail, unless MICROSPEC_ALLOW_MISSING_LLAMA_CPP=1.
All requests for one model go to one `microspec tokenize --batch-jsonl` process.
"""
import base64
import ctypes
import json
import os
import pathlib
import random
import struct
import subprocess
import tempfile

import pytest

from repo_paths import MODELS, REPO  # noqa: E402
CORPUS = json.loads((pathlib.Path(__file__).parent / "tokenizer_texts.json").read_text(encoding="utf-8"))["texts"]


def text_bytes(entry):
    return bytes.fromhex(entry["hex"]) if "hex" in entry else entry["text"].encode("utf-8")


def is_valid_utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def long_text():
    """About 4-5k tokens of mixed prose, code and scripts, built from the corpus."""
    parts = [text_bytes(e) for e in CORPUS if "text" in e and not e["name"].startswith("special")]
    return b"\n\n".join(parts) * 6


RANDOM_ALPHABET = (
    list("abcXYZ019 '\t\n\r.,!?-_/\\\"<>|()[]{}$+=^~`@#%&*:;")
    + ["  ", "   ", "\n\n", " \n", "'s", "'LL", "'re", "\u00e9", "\u00df", "\u4e2d\u6587", "\u65e5\u672c",
       "\ud55c\uad6d", "\u041f\u0440\u0438", "\u0645\u0631\u062d", "\u0928\u092e", "\u0e44\u0e17\u0e22",
       "\u00a0", "\u3000", "\u2003", "\u0085", "\u2028", "\u200d", "\ufe0f", "\u0301", "\U0001F600",
       "\U0001FAE8", "\u2581", "\u00b2", "\u0663", "\uff11", "\u216b", "\ue000", "\u0378", "\x00", "\x1b", "\ufffd"]
    + ["<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<bos>", "<eos>",
       "[multimodal]", "<unused5>", "</s>", "<repo_name>", "<file_sep>"]
)
RANDOM_BAD_BYTES = [b"\xff", b"\x80", b"\xc3", b"\xe2\x82", b"\xf0\x9f", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8"]


def random_texts(n, seed=1234):
    """Seeded random mixes of scripts, whitespace, digits, special-token strings and invalid bytes."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 25)):
            r = rng.random()
            if r < 0.08:
                parts.append(rng.choice(RANDOM_BAD_BYTES))
            elif r < 0.15:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))).encode())
            else:
                parts.append(rng.choice(RANDOM_ALPHABET).encode())
        texts.append(b"".join(parts))
    return texts


def vocab_variant(src, dst, pre):
    """Writes src's metadata without tensors and with tokenizer.ggml.pre replaced: a vocabulary-only
    file that exercises another pre-tokenizer on a real vocabulary and merge list."""
    data = pathlib.Path(src).read_bytes()
    magic, version, _, n_kv = struct.unpack_from("<4sIQQ", data, 0)
    assert magic == b"GGUF" and version >= 2
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip_value(p, vtype):
        if vtype == 8:
            return p + 8 + struct.unpack_from("<Q", data, p)[0]
        if vtype == 9:
            etype, count = struct.unpack_from("<IQ", data, p)
            p += 12
            if etype != 8:
                return p + count * sizes[etype]
            for _ in range(count):
                p += 8 + struct.unpack_from("<Q", data, p)[0]
            return p
        return p + sizes[vtype]

    out = [struct.pack("<4sIQQ", b"GGUF", version, 0, n_kv)]
    pos = 24
    for _ in range(n_kv):
        (klen,) = struct.unpack_from("<Q", data, pos)
        key = data[pos + 8 : pos + 8 + klen]
        (vtype,) = struct.unpack_from("<I", data, pos + 8 + klen)
        end = skip_value(pos + 12 + klen, vtype)
        if key == b"tokenizer.ggml.pre":
            out.append(data[pos : pos + 12 + klen] + struct.pack("<Q", len(pre)) + pre.encode())
        else:
            out.append(data[pos:end])
        pos = end
    pathlib.Path(dst).write_bytes(b"".join(out))


def llama_cpp_module():
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        if os.environ.get("MICROSPEC_ALLOW_MISSING_LLAMA_CPP") == "1":
            pytest.skip("llama_cpp missing and MICROSPEC_ALLOW_MISSING_LLAMA_CPP=1")
        pytest.fail(
            "the llama_cpp module (llama-cpp-python, the reference tokenizer) is not importable: "
            f"{e}. Install it with scripts/install_llama_cpp.sh, or set MICROSPEC_ALLOW_MISSING_LLAMA_CPP=1 "
            "to skip these tests."
        )
    return llama_cpp


def microspec_bin():
    path = pathlib.Path(os.environ.get("MICROSPEC_BIN", REPO / "build" / "microspec"))
    if not path.exists():
        pytest.fail(f"microspec binary not found at {path}; build it or set MICROSPEC_BIN")
    return path


class Peer:
    """llama.cpp's tokenizer for one model file."""

    def __init__(self, llama_cpp, model_path):
        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=False)
        self.vocab = self.llm._model.vocab
        self.buf = ctypes.create_string_buffer(1024)

    def tokenize(self, b, add_bos, special):
        return self.llm.tokenize(b, add_bos=add_bos, special=special)

    def piece(self, token, special):
        n = self.lib.llama_token_to_piece(self.vocab, token, self.buf, len(self.buf), 0, special)
        assert n >= 0, f"piece of token {token} longer than the buffer"
        return self.buf.raw[:n]

    def n_vocab(self):
        return self.lib.llama_vocab_n_tokens(self.vocab)


def run_batch(model_path, requests):
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False, encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r) + "\n")
        path = f.name
    try:
        proc = subprocess.run(
            [str(microspec_bin()), "tokenize", "-m", str(model_path), "--batch-jsonl", path],
            capture_output=True,
            timeout=300,
        )
    finally:
        os.unlink(path)
    assert proc.returncode == 0, f"microspec tokenize failed: {proc.stderr.decode(errors='replace')}"
    replies = [json.loads(line) for line in proc.stdout.decode("utf-8").splitlines()]
    assert len(replies) == len(requests)
    return replies


def encode_request(b, add_bos, special):
    r = {"op": "encode", "text_b64": base64.b64encode(b).decode(), "special": special}
    if not add_bos:
        r["add_bos"] = False  # absent: the file's rule, which is what llama.cpp's add_special applies
    return r


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    llama_cpp = llama_cpp_module()
    path = MODELS[request.param]
    if not path.exists():
        pytest.fail(f"model file missing: {path} (run scripts/fetch_models.sh)")
    return request.param, path, Peer(llama_cpp, path)


def corpus_for(name):
    cases = [(e["name"], text_bytes(e)) for e in CORPUS if not (name == "smollm2" and e.get("llama_aborts_bpe"))]
    cases.append(("long_text", long_text()))
    return cases


def test_encode_matches_llama_cpp(model):
    name, path, peer = model
    cases = corpus_for(name)
    variants = [(add_bos, special) for add_bos in (True, False) for special in (True, False)]
    requests = [encode_request(b, a, s) for _, b in cases for a, s in variants]
    replies = run_batch(path, requests)
    mismatches, total, i = [], 0, 0
    for case_name, b in cases:
        for add_bos, special in variants:
            expected = peer.tokenize(b, add_bos, special)
            got = replies[i]["ids"]
            i += 1
            total += 1
            if got != expected:
                mismatches.append(f"{case_name} add_bos={add_bos} special={special}: ours {got[:40]} llama.cpp {expected[:40]}")
    print(f"\n{name}: encode agreement {total - len(mismatches)}/{total}")
    assert not mismatches, "\n".join(mismatches[:20])
    long_ids = peer.tokenize(long_text(), False, False)
    assert len(long_ids) >= 3500, f"long text is only {len(long_ids)} tokens"


def test_random_texts_match_llama_cpp(model):
    name, path, peer = model
    texts = random_texts(600)
    requests = [encode_request(b, a, s) for b in texts for a, s in ((True, True), (False, False))]
    replies = run_batch(path, requests)
    mismatches = []
    for k, b in enumerate(texts):
        for j, (a, s) in enumerate(((True, True), (False, False))):
            expected = peer.tokenize(b, a, s)
            if replies[2 * k + j]["ids"] != expected:
                mismatches.append(f"{b!r} add_bos={a} special={s}: ours {replies[2 * k + j]['ids']} llama.cpp {expected}")
    print(f"\n{name}: random-text agreement {len(requests) - len(mismatches)}/{len(requests)}")
    assert not mismatches, "\n".join(mismatches[:10])


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2", "default"])
def test_other_pre_tokenizers_match_llama_cpp(pre, tmp_path):
    """The Llama 3, Qwen2, GPT-2 and default splitters, run on SmolLM2's vocabulary and merges."""
    llama_cpp = llama_cpp_module()
    path = tmp_path / f"smollm2-vocab-{pre}.gguf"
    vocab_variant(MODELS["smollm2"], path, pre)
    peer = Peer(llama_cpp, path)
    texts = [b for _, b in corpus_for("smollm2")] + random_texts(300, seed=99)
    replies = run_batch(path, [encode_request(b, True, True) for b in texts])
    mismatches = []
    for b, reply in zip(texts, replies):
        expected = peer.tokenize(b, True, True)
        if reply["ids"] != expected:
            mismatches.append(f"{b[:80]!r}: ours {reply['ids'][:30]} llama.cpp {expected[:30]}")
    print(f"\nsmollm2 vocabulary with pre={pre}: agreement {len(texts) - len(mismatches)}/{len(texts)}")
    assert not mismatches, "\n".join(mismatches[:10])


def test_special_strings_only_parsed_on_request(model):
    name, path, peer = model
    marker = "<end_of_turn>" if name == "gemma" else "<|im_end|>"
    marker_id = peer.tokenize(marker.encode(), False, True)
    assert len(marker_id) == 1
    with_special, without = run_batch(
        path, [encode_request(f"a{marker}b".encode(), False, True), encode_request(f"a{marker}b".encode(), False, False)]
    )
    assert marker_id[0] in with_special["ids"]
    assert marker_id[0] not in without["ids"]


def test_above_unicode_range_does_not_crash(model):
    # llama.cpp's byte-level BPE aborts on sequences decoding above U+10FFFF; microspec reads each
    # such sequence as one U+FFFD, so the ids equal llama.cpp's for the text with U+FFFD there.
    name, path, peer = model
    entries = [e for e in CORPUS if e.get("llama_aborts_bpe")]
    assert entries
    replies = run_batch(path, [encode_request(text_bytes(e), False, False) for e in entries])
    for e, reply in zip(entries, replies):
        b = text_bytes(e)
        if name == "smollm2":
            substituted = b.replace(b"\xf4\x90\x80\x80", "\ufffd".encode()).replace(b"\xf5\x80\x80\x80", "\ufffd".encode())
            assert reply["ids"] == peer.tokenize(substituted, False, False), e["name"]
        else:
            assert reply["ids"] == peer.tokenize(b, False, False), e["name"]


def test_pieces_match_for_whole_vocabulary(model):
    name, path, peer = model
    n = peer.n_vocab()
    ids = list(range(n))
    replies = run_batch(path, [{"op": "pieces", "ids": ids, "special": False}, {"op": "pieces", "ids": ids, "special": True}])
    mismatches = []
    for reply, special in zip(replies, (False, True)):
        ours = reply["pieces_b64"]
        assert len(ours) == n
        for t in ids:
            expected = peer.piece(t, special)
            got = base64.b64decode(ours[t])
            if got != expected:
                mismatches.append(f"token {t} special={special}: ours {got!r} llama.cpp {expected!r}")
    print(f"\n{name}: piece agreement {2 * n - len(mismatches)}/{2 * n}")
    assert not mismatches, "\n".join(mismatches[:20])


def test_decode_round_trip(model):
    name, path, peer = model
    cases = corpus_for(name)
    requests = []
    for _, b in cases:
        requests.append(encode_request(b, False, True))
    encoded = run_batch(path, requests)
    decode_requests = []
    for reply in encoded:
        decode_requests.append({"op": "decode", "ids": reply["ids"], "special": True})
        decode_requests.append({"op": "decode", "ids": reply["ids"], "special": False})
    decoded = run_batch(path, decode_requests)
    failures = []
    for k, (case_name, b) in enumerate(cases):
        ids = encoded[k]["ids"]
        ours_special = base64.b64decode(decoded[2 * k]["text_b64"])
        ours_plain = base64.b64decode(decoded[2 * k + 1]["text_b64"])
        if ours_special != b"".join(peer.piece(t, True) for t in ids):
            failures.append(f"{case_name}: decode(special) differs from llama.cpp")
        if ours_plain != b"".join(peer.piece(t, False) for t in ids):
            failures.append(f"{case_name}: decode differs from llama.cpp")
        # Exact round trip for valid UTF-8. Not for invalid input: byte-level BPE reads bad bytes as
        # U+FFFD, and the SentencePiece-style splitter lets a bad lead byte swallow part of an escaped space.
        if is_valid_utf8(b) and ours_special != b:
            failures.append(f"{case_name}: decode(encode(text)) != text: {ours_special[:60]!r} vs {b[:60]!r}")
    assert not failures, "\n".join(failures[:20])


def test_special_ids_and_end_of_generation(model):
    name, path, peer = model
    (info,) = run_batch(path, [{"op": "info"}])
    lib, vocab = peer.lib, peer.vocab
    assert info["n_vocab"] == peer.n_vocab()
    assert info["bos"] == lib.llama_vocab_bos(vocab)
    assert info["eos"] == lib.llama_vocab_eos(vocab)
    assert info["add_bos"] == lib.llama_vocab_get_add_bos(vocab)
    expected_eog = [t for t in range(peer.n_vocab()) if lib.llama_vocab_is_eog(vocab, t)]
    assert info["eog"] == expected_eog
    assert info["chat_format"] == ("gemma" if name == "gemma" else "chatml")


CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Tell me a joke.\nMake it short."},
    ],
    [
        {"role": "system", "content": "  Padded system.  "},
        {"role": "user", "content": "  padded user text \n"},
        {"role": "assistant", "content": "ok "},
        {"role": "user", "content": "again"},
    ],
    [],
]


def test_smollm2_chat_matches_file_template():
    llama_cpp = llama_cpp_module()
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    path = MODELS["smollm2"]
    peer = Peer(llama_cpp, path)
    template = peer.llm.metadata["tokenizer.chat_template"]
    requests, expected = [], []
    for conv in CONVERSATIONS:
        for gen in (True, False):
            fmt = Jinja2ChatFormatter(template=template, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                      add_generation_prompt=gen)
            expected.append(fmt(messages=conv).prompt)
            requests.append({"op": "chat", "messages": conv, "add_generation_prompt": gen})
    replies = run_batch(path, requests)
    for reply, want in zip(replies, expected):
        assert reply["format"] == "chatml"
        assert reply["text"] == want
    (info,) = run_batch(path, [{"op": "info"}])
    assert info["default_system"] == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.mark.parametrize("fmt,llama_name", [("gemma", b"gemma"), ("chatml", b"chatml"), ("llama3", b"llama3")])
def test_builtin_chat_formats_match_llama_cpp(fmt, llama_name):
    llama_cpp = llama_cpp_module()
    path = MODELS["gemma"]  # no chat template in this file, so no default system prompt interferes
    requests, expected = [], []
    for conv in CONVERSATIONS[:-1]:
        for gen in (True, False):
            msgs = (llama_cpp.llama_chat_message * len(conv))(
                *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in conv]
            )
            buf = ctypes.create_string_buffer(8192)
            n = llama_cpp.llama_chat_apply_template(llama_name, msgs, len(conv), gen, buf, len(buf))
            assert 0 < n <= len(buf)
            expected.append(buf.raw[:n].decode("utf-8"))
            requests.append({"op": "chat", "format": fmt, "messages": conv, "add_generation_prompt": gen})
    replies = run_batch(path, requests)
    for reply, want in zip(replies, expected):
        assert reply["format"] == fmt
        assert reply["text"] == want
    # The built-in template by name, through `microspec template`: the same text.
    contexts = "".join(json.dumps({k: r[k] for k in ("messages", "add_generation_prompt")}) + "\n" for r in requests)
    proc = subprocess.run([str(microspec_bin()), "template", "--template", fmt, "--batch-jsonl", "-"],
                          input=contexts.encode(), capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert [json.loads(line)["text"] for line in proc.stdout.decode().splitlines()] == expected


def run_cli(*args, stdin=None):
    proc = subprocess.run([str(microspec_bin()), "tokenize", *map(str, args)], input=stdin, capture_output=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr.decode(errors="replace")


def test_cli_modes(tmp_path):
    gemma = MODELS["gemma"]
    assert run_cli("-m", gemma, "-p", "Hello world") == (0, b"2 9259 1902\n", "")
    assert run_cli("-m", gemma, "-p", "Hello world", "--no-bos", "--ids")[1] == b"9259 1902\n"
    assert run_cli("-m", gemma, "-p", "Hello world", "--json")[1] == b"[2,9259,1902]\n"
    assert run_cli("-m", gemma, "-p", "Hi<end_of_turn>", "--no-bos")[1].split()[-1] == b"106"
    assert b"106" not in run_cli("-m", gemma, "-p", "Hi<end_of_turn>", "--no-bos", "--no-special")[1].split()
    assert run_cli("-m", gemma, "-p", "Hello world", "--pieces")[1] == b"2\t<bos>\n9259\tHello\n1902\t world\n"
    pieces_json = json.loads(run_cli("-m", gemma, "-p", "Hi\n", "--pieces", "--json")[1])
    assert pieces_json[-1] == {"id": 107, "piece": "\n"}

    # Text from a file or stdin keeps its bytes exactly, invalid UTF-8 included.
    raw = b"caf\xe9 \xff\xfe<|im_end|>\r\n\x00end"
    f = tmp_path / "raw.bin"
    f.write_bytes(raw)
    for name, path in MODELS.items():
        (batch,) = run_batch(path, [{"op": "encode", "text_b64": base64.b64encode(raw).decode()}])
        want = (" ".join(map(str, batch["ids"])) + "\n").encode()
        assert run_cli("-m", path, "-f", f)[1] == want, name
        assert run_cli("-m", path, "--stdin", stdin=raw)[1] == want, name

    rc, _, err = run_cli("-m", gemma, "-p", "x", "-f", f)
    assert rc != 0 and "exactly one" in err
    rc, _, err = run_cli("-m", tmp_path / "missing.gguf", "-p", "x")
    assert rc != 0 and "missing.gguf" in err
    rc, _, err = run_cli("-m", gemma, "--batch-jsonl", "-", stdin=b'{"op": "decode", "ids": [999999]}\n')
    assert rc != 0 and "line 1" in err and "out of range" in err
