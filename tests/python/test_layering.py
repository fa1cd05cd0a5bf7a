"""The folders under src/ form a layered graph: each folder is one concern, and no folder reaches
back, through any chain of `#include "folder/..."` lines, to a folder that includes it. The CUDA
backend (src/cuda) may use any CPU folder, but the CPU folders reach it only through the engine's
device generator (src/engine/cuda_generator.cpp) and `microspec --version`'s device line
(src/cli/version.cpp), each behind MICROSPEC_HAS_CUDA.

Run as a script (python3 tests/python/test_layering.py) it prints the folder graph and any cycle."""
import collections
import pathlib
import re
import sys

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([A-Za-z0-9_]+)/[^"]+"', re.MULTILINE)
SOURCE_SUFFIXES = {".h", ".hpp", ".cpp", ".cu", ".cuh"}
CUDA_GATES = {pathlib.Path("engine/cuda_generator.cpp"), pathlib.Path("cli/version.cpp")}  # include cuda/


def folder_edges(src=SRC):
    """folder -> {included folder: [files that include it]}, self-includes left out."""
    edges = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in sorted(src.rglob("*")):
        if path.suffix not in SOURCE_SUFFIXES or not path.is_file():
            continue
        rel = path.relative_to(src)
        folder = rel.parts[0]
        for target in INCLUDE.findall(path.read_text(encoding="utf-8", errors="replace")):
            if target != folder and (src / target).is_dir():
                if str(rel) not in edges[folder][target]:
                    edges[folder][target].append(str(rel))
    return edges


def cycles(edges):
    """Every strongly connected set of two or more folders (Tarjan), each as a sorted list."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    nodes = sorted(set(edges) | {t for targets in edges.values() for t in targets})

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in nodes:
        if node not in index:
            visit(node)
    return found


def describe(edges, component):
    members = set(component)
    return "; ".join(f"{a} -> {b} ({', '.join(files)})" for a in component
                     for b, files in sorted(edges.get(a, {}).items()) if b in members)


def test_no_cycle_between_folders():
    edges = folder_edges()
    assert edges, "no #include lines found under src/"
    found = cycles(edges)
    assert not found, "folder cycles: " + " | ".join(describe(edges, c) for c in found)


def test_cpu_folders_reach_cuda_only_through_the_gates():
    edges = folder_edges()
    leaks = [f for folder, targets in edges.items() if folder != "cuda"
             for f in targets.get("cuda", []) if pathlib.Path(f) not in CUDA_GATES]
    assert not leaks, f"CPU files that include cuda/: {leaks}"


def test_cycle_finder_sees_a_cycle():
    # The checker itself must be able to fail: a two-folder loop and a three-folder loop.
    edges = {"a": {"b": ["a/x.h"]}, "b": {"a": ["b/y.cpp"]},
             "c": {"d": ["c/z.h"]}, "d": {"e": ["d/w.h"]}, "e": {"c": ["e/v.h"]}, "f": {"a": ["f/u.h"]}}
    assert sorted(cycles(edges)) == [["a", "b"], ["c", "d", "e"]]


if __name__ == "__main__":
    graph = folder_edges()
    for folder in sorted(graph):
        print(f"{folder:12} -> {' '.join(sorted(graph[folder]))}")
    problems = cycles(graph)
    for component in problems:
        print("CYCLE:", describe(graph, component))
    print("no cycles" if not problems else f"{len(problems)} cycle(s)")
    sys.exit(1 if problems else 0)
