"""The README and docs/ show commands that work.

- Every `microspec` command in README.md's and docs/*.md's code blocks (fenced or indented) and in
  their inline code spans (docs/RESULTS.md aside: it records commands as they were run) names a subcommand that exists, and every flag it names appears in
  `microspec <subcommand> --help` (or `microspec --help` for top-level flags such as --version).
- The README's first `build/microspec generate` command runs: shortened to 16 tokens, on the model
  it names, it exits 0 and its statistics line on stderr reports the mean acceptance length and
  the decode speed (the command is the README's main job: a chat prompt with speculation).
- Every relative link in README.md and docs/*.md points to an existing file.
"""
import functools
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from repo_paths import BIN, REPO  # noqa: E402

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
SHELL_LANGS = {"", "sh", "bash", "shell", "console"}
FLAG = re.compile(r"^--?[A-Za-z][A-Za-z0-9_+-]*$")
SEPARATORS = {"&&", "||", ";", "|", "&"}


def code_lines(text):
    """(line number, command) for every shell line of the fenced and indented code blocks, with
    backslash continuations joined."""
    out = []
    in_fence, fence_lang, prev_blank_or_code = False, "", True
    pending, pending_no = "", 0
    for no, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            in_fence = not in_fence
            fence_lang = stripped[3:].strip().lower() if in_fence else ""
            prev_blank_or_code = False
            continue
        indented_code = not in_fence and line.startswith("    ") and prev_blank_or_code and stripped != ""
        if (in_fence and fence_lang in SHELL_LANGS) or indented_code:
            if not pending:
                pending_no = no
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                prev_blank_or_code = True
                continue
            out.append((pending_no, pending + stripped))
            pending = ""
        prev_blank_or_code = stripped == "" or indented_code or in_fence
    return out


def inline_commands(text):
    """(line number, command) for inline code spans that start with the binary's name."""
    out = []
    for no, line in enumerate(text.splitlines(), 1):
        if line.startswith("    ") or line.strip().startswith("```"):
            continue
        for m in re.finditer(r"`((?:build/)?microspec [^`]+)`", line):
            out.append((no, m.group(1)))
    return out


def invocations(command):
    """Each `microspec ...` segment of a shell line, as (args after the binary)."""
    try:
        lex = shlex.shlex(command, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        tokens = list(lex)
    except ValueError:
        tokens = command.split()
    segments, current = [], []
    for t in tokens:
        if t in SEPARATORS:
            segments.append(current)
            current = []
        else:
            current.append(t)
    segments.append(current)
    out = []
    for seg in segments:
        while seg and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", seg[0]):  # VAR=value prefixes
            seg = seg[1:]
        if seg and (seg[0] in ("microspec", "build/microspec") or seg[0].endswith("/bin/microspec")):
            out.append(seg[1:])
    return out


def subcommand_and_flags(args):
    words = [a.strip("[]") for a in args]
    sub = None
    if words and not words[0].startswith("-"):
        sub = words[0]
        words = words[1:]
    flags = []
    for w in words:
        if w.startswith("-"):
            name = w.split("=", 1)[0]
            if FLAG.match(name):
                flags.append(name)
    return sub, flags


@functools.lru_cache(maxsize=None)
def help_text(sub):
    args = [BIN] + ([sub] if sub else []) + ["--help"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout + p.stderr


def help_flags(sub):
    _, text = help_text(sub)
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][A-Za-z0-9_+-]*)", text))


def documented_commands():
    """(file:line, command) over the README and docs/. docs/RESULTS.md is left out: it records
    commands as they were run, with the flag names of their day."""
    out = []
    for path in [README, *[d for d in DOCS if d.name != "RESULTS.md"]]:
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(REPO)
        for no, cmd in code_lines(text) + inline_commands(text):
            for args in invocations(cmd):
                out.append((f"{rel}:{no}", args))
    return out


def check_invocation(args):
    """Problems with one invocation: an unknown subcommand or flags missing from its --help."""
    if any(a in ("...", "…") or "<" in a for a in args[:1]):
        return []
    sub, flags = subcommand_and_flags(args)
    if sub is not None and not re.match(r"^[a-z][a-z0-9-]*$", sub):
        return []  # a placeholder such as COMMAND
    rc, text = help_text(sub)
    if rc != 0:
        return [f"subcommand '{sub}' does not exist ({text.strip().splitlines()[-1] if text.strip() else rc})"]
    known = help_flags(sub)
    return [f"'{sub or 'microspec'}' has no flag {f}" for f in flags if f not in known and f not in ("-h", "--help")]


def binary_or_skip():
    if not pathlib.Path(BIN).exists():
        pytest.skip(f"no microspec binary at {BIN}")


def test_documented_commands_name_existing_subcommands_and_flags():
    binary_or_skip()
    commands = documented_commands()
    assert any(where.startswith("README.md") for where, _ in commands), "no microspec command found in README.md"
    problems = []
    for where, args in commands:
        problems += [f"{where}: {p}" for p in check_invocation(args)]
    assert not problems, "documented commands that the binary does not take:\n" + "\n".join(problems)


def first_readme_generate():
    for _, cmd in code_lines(README.read_text(encoding="utf-8")):
        for args in invocations(cmd):
            if args and args[0] == "generate":
                return args
    return None


def test_readme_first_command_runs_and_reports_acceptance():
    binary_or_skip()
    args = first_readme_generate()
    assert args is not None, "README.md shows no `build/microspec generate` command"
    assert "--spec" not in args or args[args.index("--spec") + 1] == "auto", \
        "the README's first generate command should run the default, --spec auto"
    model = REPO / args[args.index("-m") + 1]
    if not model.exists():
        pytest.skip(f"{model} missing (scripts/setup.sh fetches it)")
    args = list(args)
    for flag in ("-n", "--n-predict"):
        if flag in args:
            args[args.index(flag) + 1] = "16"
    if "-n" not in args and "--n-predict" not in args:
        args += ["-n", "16"]
    p = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert re.search(r"mean acceptance length [0-9.]+", p.stderr), p.stderr
    assert "speculative (auto: " in p.stderr, p.stderr
    assert re.search(r"steps by drafter: plain \d+ .*, n-gram \d+ .*, model \d+ ", p.stderr), p.stderr
    assert re.search(r"decode:? [0-9.]+ tok/s", p.stderr), p.stderr


def relative_links(path):
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code are not links
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        yield target.split("#", 1)[0]


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_to_existing_files(path):
    missing = [t for t in relative_links(path) if not (path.parent / t).exists()]
    assert not missing, f"{path.relative_to(REPO)} links to missing files: {missing}"


def test_the_checks_catch_a_made_up_flag():
    # The parser must see a flag in a README-style line, and the check must refuse one no
    # subcommand has; otherwise the test above could pass on anything.
    binary_or_skip()
    (args,) = invocations('build/microspec generate -m m.gguf --chat -p "x y" --no-such-flag 3')
    assert subcommand_and_flags(args) == ("generate", ["-m", "--chat", "-p", "--no-such-flag"])
    assert check_invocation(args) == ["'generate' has no flag --no-such-flag"]
    assert check_invocation(["no-such-subcommand"])
