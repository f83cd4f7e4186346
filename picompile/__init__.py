"""picompile: a compiler for ReLU-sparse decoder LLMs (PowerInfer's method as passes)."""

__version__ = "0.1.0"
