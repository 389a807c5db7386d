"""Every `--flag` the docs and the chart name is a flag some command of the project has.

The rule: a `--flag` token in README.md, docs/ or charts/kvasir/ is valid when one of the
project's command-line parsers lists it (what its `--help` shows): `kvasir-engine serve` and
`generate`, `kvasir-gateway`, `kvasir-operator run`, `kvasir-fetch`, or a bench script (read
from its source: the benches build their parsers inside `main`, beside heavy imports), or when
it belongs to a foreign tool the docs show a command line of (`FOREIGN_FLAGS`, each with its
tool). A line often holds several commands (`bench/serving.py --server "kvasir-engine serve
--port ..."`), so a flag is not pinned to one command: what this catches is a flag that no
command has, the way docs drift when a flag is renamed or was only ever planned.

The gateway's and the operator's own messages and docstrings are held to the same rule: a
config error naming a flag that does not exist sends its reader looking for nothing.
"""

from __future__ import annotations

import argparse
import ast
import re
from collections.abc import Iterator
from pathlib import Path

import kvasir_engine.main
import kvasir_gateway.config
import kvasir_operator.fetch.cli
import kvasir_operator.main

ROOT = Path(__file__).parents[1]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*")
# Flags of other programs, shown on their own command lines in the docs.
FOREIGN_FLAGS = {
    "--set": "helm install (docs/gateway.md, docs/operator.md)",
    "--create-namespace": "helm install (docs/operator.md)",
    "--model_args": "lm-eval's lm_eval run (docs/api.md)",
    "--tasks": "lm-eval's lm_eval run (docs/api.md)",
    "--batch_size": "lm-eval's lm_eval run (docs/api.md)",
    "--include_path": "lm-eval's task directory option (docs/api.md)",
    "--nonblocking": "py-spy record (docs/performance.md)",
    "--idle": "py-spy record (docs/performance.md)",
    "--native": "py-spy record (docs/performance.md)",
    "--no-repack": "llama.cpp's llama-server, a bench baseline (docs/performance.md)",
    "--no-webui": "llama.cpp's llama-server, a bench baseline (docs/performance.md)",
    "--isolation": "buildah bud/run (docs/images.md)",
    "--variant": "mmdebstrap (docs/images.md)",
    "--find-links": "pip install in the engine's Dockerfile (docs/images.md)",
    "--build-arg": "docker/buildah build (docs/images.md)",
}
# The HTTP server's, the gateway's and the operator's messages and docstrings name flags too.
SOURCE_PACKAGES = ("engine/kvasir_engine/server", "gateway/kvasir_gateway",
                   "operator/kvasir_operator")


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    flags: set[str] = set()
    for action in parser._actions:
        flags.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= parser_flags(sub)
    return flags


def bench_flags() -> set[str]:
    flags: set[str] = set()
    for path in (ROOT / "bench").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument"):
                continue
            names = [a.value for a in node.args
                     if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            negatable = any(k.arg == "action" and isinstance(k.value, ast.Attribute)
                            and k.value.attr == "BooleanOptionalAction" for k in node.keywords)
            for name in names:
                if name.startswith("--"):
                    flags.add(name)
                    if negatable:
                        flags.add("--no-" + name[2:])
    return flags


def project_flags() -> set[str]:
    parsers = [kvasir_engine.main.build_parser(), kvasir_gateway.config.build_parser(),
               kvasir_operator.main.build_parser(), kvasir_operator.fetch.cli.build_parser()]
    return set().union(*(parser_flags(p) for p in parsers)) | bench_flags()


def doc_files() -> list[Path]:
    docs = [p for p in (ROOT / "docs").rglob("*") if p.suffix in (".md", ".yaml", ".yml")]
    chart = [p for p in (ROOT / "charts" / "kvasir").rglob("*")
             if p.is_file() and p.suffix in (".md", ".txt", ".yaml", ".yml", ".tpl")]
    return [ROOT / "README.md", *sorted(docs), *sorted(chart)]


def doc_flags() -> Iterator[tuple[str, str]]:
    """(file:line, flag) of every flag token in the docs."""
    for path in doc_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for match in FLAG.finditer(line):
                yield f"{path.relative_to(ROOT)}:{number}", match.group()


def source_flags() -> Iterator[tuple[str, str]]:
    """(file:line, flag) of every flag token in the string literals of `SOURCE_PACKAGES`."""
    for package in SOURCE_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    for match in FLAG.finditer(node.value):
                        yield f"{path.relative_to(ROOT)}:{node.lineno}", match.group()


def test_every_flag_in_the_docs_exists() -> None:
    known = project_flags() | FOREIGN_FLAGS.keys()
    unknown = [f"{where}: {flag}" for where, flag in doc_flags() if flag not in known]
    assert unknown == [], "flags no command has:\n" + "\n".join(unknown)


def test_every_flag_the_gateway_and_operator_name_exists() -> None:
    known = project_flags()
    unknown = [f"{where}: {flag}" for where, flag in source_flags() if flag not in known]
    assert unknown == [], "messages naming flags no command has:\n" + "\n".join(unknown)


def test_foreign_flags_are_foreign_and_still_shown() -> None:
    shown = {flag for _, flag in doc_flags()}
    assert FOREIGN_FLAGS.keys() & project_flags() == set()  # ours: not foreign
    assert FOREIGN_FLAGS.keys() - shown == set()  # no longer in the docs: drop it
