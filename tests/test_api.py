"""The public API re-exported lazily by `specheads/__init__.py` resolves: every name in
`__all__` names a real object in the module it points at (a moved module breaks it only
at first use otherwise)."""

import importlib

import specheads


def test_every_public_name_resolves():
    for name in specheads.__all__:
        assert getattr(specheads, name) is not None, name


def test_the_exports_point_at_the_defining_modules():
    for name, module in specheads._EXPORTS.items():
        assert getattr(importlib.import_module(module), name).__module__ == module, name
