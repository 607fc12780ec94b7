"""resilrun: a torchrun-compatible launcher for distributed PyTorch training that survives failures.

Importing this package is cheap (no torch): the worker bootstrap and the CLI both rely on that.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
