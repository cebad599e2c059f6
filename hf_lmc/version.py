"""The package's version, in a module of its own: what records and cards name, importable from any
layer without the package's face."""

__version__ = "0.1.0"
