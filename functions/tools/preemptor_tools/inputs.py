"""Files a user hands the CLI: read, parsed and validated, or refused in one line.

A wrong file gets one line naming the file and, where one is at fault, the field
(`scenario.yaml: field pools.0: pool 'p5' needs 'instances' or 'gpus'`), never a
traceback; `preemptor` prints it on stderr and exits 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, TypeVar

import yaml
from preemptor.config import first_problem
from pydantic import ValidationError

T = TypeVar("T")


class InputFileError(Exception):
    """A file the user gave cannot be used; the message is one line: `path: what is wrong`."""

    def __init__(self, path: Path | str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


class _DuplicateKey(ValueError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML itself says keys
    are unique; PyYAML keeps the last and says nothing, so a typo'd override is lost)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    document: dict = {}
    for key, value in pairs:
        if key in document:
            raise _DuplicateKey(key)
        document[key] = value
    return document


def read_document(path: Path, what: str) -> Any:
    """The file's JSON document (YAML too for `.yaml` / `.yml`), or InputFileError. A key
    given twice in one object is refused (the last would silently win). A byte-order mark,
    as some editors write, is allowed."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise InputFileError(path, f"the {what} is not UTF-8 text") from None
    except OSError as e:
        raise InputFileError(path, f"cannot read the {what}: {e.strerror or e}") from None
    if Path(path).suffix.lower() in (".yaml", ".yml"):
        try:
            return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise InputFileError(path, f"the {what} is not valid YAML{where}: {problem}") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise InputFileError(path, f"the {what} gives the key {e.args[0]!r} twice in one object") from None
    except json.JSONDecodeError as e:
        raise InputFileError(path, f"the {what} is not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None


def validated(path: Path, what: str, build: Callable[[], T]) -> T:
    """`build()` (a pydantic validation, a loader), with its refusal as InputFileError naming
    the first field at fault and how many more there are."""
    try:
        return build()
    except ValidationError as e:
        raise InputFileError(path, f"{what}: {first_problem(e, whole='(the whole document)')}") from None
    except (ValueError, TypeError, KeyError) as e:
        detail = str(e).strip("'\"") or type(e).__name__
        raise InputFileError(path, f"{what}: {detail}") from None


def load(path: Path, what: str, build: Callable[[Any], T]) -> T:
    """Read `path` and build the `what` from its document, refusing in one line."""
    document = read_document(path, what)
    return validated(path, what, lambda: build(document))
