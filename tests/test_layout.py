"""The layout's rules, checked: no import cycles in the library or the benchmarks (imports inside
functions count), and benchmark scripts share code only through the benchmarks' shared modules,
never by importing one another, and run as modules without editing sys.path."""
import ast
import os

import pytest

import torch_grnnd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where each package's modules are read from: the library as it is imported (the checkout, or an
# installed wheel's copy when .ci/wheel runs the suite), the benchmarks from the checkout.
FOLDERS = {"torch_grnnd": os.path.dirname(os.path.abspath(torch_grnnd.__file__)),
           "benchmarks": os.path.join(ROOT, "benchmarks")}
# What the benchmark scripts may import from each other: the modules made to be shared.
SHARED_BENCHMARK_MODULES = {"report", "datasets", "common", "baselines"}


def imports(package: str) -> dict:
    """Module -> the modules of the same package it imports, anywhere in its code."""
    folder = FOLDERS[package]
    found = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(folder, name)).read())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    deps.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
                elif node.module == package:
                    deps.update(a.name for a in node.names)
                elif node.module and node.module.startswith(package + "."):
                    deps.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[1] for a in node.names if a.name.startswith(package + "."))
        found[name[:-3]] = deps
    return found


def cycles(graph: dict) -> list:
    out = []
    for start in graph:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for dep in graph.get(node, ()):
                if dep == start:
                    out.append(" -> ".join(path + [dep]))
                elif dep not in path and dep in graph:
                    stack.append((dep, path + [dep]))
    return out


@pytest.mark.parametrize("package", ["torch_grnnd", "benchmarks"])
def test_no_import_cycles(package):
    graph = imports(package)
    graph.pop("__init__", None)  # the package's names: it imports everything, nothing imports it back
    assert cycles(graph) == []


def test_the_raw_ops_import_nothing_above_them():
    assert imports("torch_grnnd")["ops"] <= {"codes", "memory", "params", "progress"}


def test_benchmark_scripts_share_code_through_the_shared_modules_only():
    for module, deps in imports("benchmarks").items():
        assert deps <= SHARED_BENCHMARK_MODULES, (module, deps - SHARED_BENCHMARK_MODULES)


def test_benchmark_scripts_leave_sys_path_alone():
    # They run as modules from the repository's root (python -m benchmarks.NAME), which puts the
    # root on the path for them.
    folder = FOLDERS["benchmarks"]
    editing = [name for name in sorted(os.listdir(folder))
               if name.endswith(".py") and "sys.path" in open(os.path.join(folder, name)).read()]
    assert editing == []
