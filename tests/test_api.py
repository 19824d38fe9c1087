"""Every public name imports, has a docstring, and is documented in docs/api.md."""

import importlib
import inspect
import pathlib
import re
import types

import pytest

import kmix

# Keras's layer/callback protocol, documented by Keras itself.
KERAS_PROTOCOL = {"call", "build", "compute_output_shape", "compute_output_spec", "get_config",
                  "from_config", "quantized_call"}
SUBPACKAGES = ["kmix.callbacks", "kmix.distribute", "kmix.layers", "kmix.ops", "kmix.schedules", "kmix.policy", "kmix.optimizers"]
API_MD = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.md"


def public_names():
    """(qualified name, object) for kmix.__all__ and every subpackage's __all__."""
    names = [(f"kmix.{n}", getattr(kmix, n)) for n in kmix.__all__ if n != "__version__"]
    for package in SUBPACKAGES:
        module = importlib.import_module(package)
        names += [(f"{package}.{n}", getattr(module, n)) for n in module.__all__]
    return names


def test_every_name_in_all_imports():
    for name in kmix.__all__:
        assert hasattr(kmix, name), name
        exec(f"from kmix import {name}", {})
    assert isinstance(kmix.__version__, str) and kmix.__version__.count(".") == 2


@pytest.mark.parametrize("qualname, obj", public_names(), ids=[n for n, _ in public_names()])
def test_every_public_name_has_a_docstring(qualname, obj):
    doc = inspect.getdoc(obj)
    assert doc and doc.strip(), f"{qualname} has no docstring"
    if isinstance(obj, type):
        for attr, member in vars(obj).items():
            if attr.startswith("_") or attr in KERAS_PROTOCOL or attr.startswith("on_"):
                continue
            if not callable(member) and not isinstance(member, property):
                continue
            assert inspect.getdoc(getattr(obj, attr)), f"{qualname}.{attr} has no docstring"


def test_every_public_name_is_in_api_md():
    text = API_MD.read_text()
    missing = [
        n for n, obj in public_names()
        if not isinstance(obj, types.ModuleType)
        and not re.search(rf"`(?:[\w.]+\.)?{re.escape(n.split('.')[-1])}[`(]", text)
    ]
    assert not missing, f"docs/api.md does not document: {missing}"
