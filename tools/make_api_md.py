"""Writes docs/api.md from the docstrings of every public kmix name.

    python tools/make_api_md.py
"""

import importlib
import inspect
import pathlib

import kmix

SECTIONS = [
    ("kmix", "Top level", [n for n in kmix.__all__ if n not in ("__version__", "callbacks", "distribute", "layers", "ops", "schedules")]),
    ("kmix.layers", "Layers", None),
    ("kmix.optimizers", "Optimizers", None),
    ("kmix.ops", "Ops", None),
    ("kmix.callbacks", "Callbacks", None),
    ("kmix.distribute", "Distribution", None),
    ("kmix.schedules", "Schedules", None),
    ("kmix.policy", "Policy helpers", None),
]


def signature(obj):
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


def render():
    lines = [
        "# kmix API",
        "",
        "Generated from the docstrings by `python tools/make_api_md.py`; "
        "`tests/test_api.py` fails when a public name is missing here.",
        "",
    ]
    seen = set()
    for package, title, names in SECTIONS:
        module = importlib.import_module(package)
        names = names if names is not None else module.__all__
        lines += [f"## {title} (`{package}`)", ""]
        for name in names:
            obj = getattr(module, name)
            if id(obj) in seen:
                lines += [f"### `{package}.{name}`", "", f"The same object as `kmix.{name}`.", ""]
                continue
            seen.add(id(obj))
            lines += [f"### `{package}.{name}{signature(obj)}`", "", inspect.getdoc(obj) or "", ""]
            if isinstance(obj, type):
                members = {}  # the class's own, and those of kmix mixins it inherits (counters)
                for klass in reversed(obj.__mro__):
                    if klass is obj or klass.__module__.startswith("kmix."):
                        members.update(vars(klass))
                for attr, member in sorted(members.items()):
                    if attr.startswith("_") or attr in ("call", "build", "get_config", "from_config"):
                        continue
                    if isinstance(member, property) or inspect.isfunction(member) or isinstance(member, classmethod):
                        doc = inspect.getdoc(getattr(obj, attr))
                        if doc:
                            sig = "" if isinstance(member, property) else signature(getattr(obj, attr))
                            lines += [f"- `{attr}{sig}`: {doc.splitlines()[0]}"]
                lines.append("")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    path = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.md"
    path.write_text(render())
    print(f"wrote {path}")
