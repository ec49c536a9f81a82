"""FAST's version: one place, read by the package (`fast.__version__`), its build (pyproject.toml) and its archives."""

__version__ = "0.1.0"
