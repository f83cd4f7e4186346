"""picompile's thin runtime: loads an artifact and generates tokens.

It imports numpy and TVM's runtime/FFI only (never the compiler, torch, onnx or highspy), and for text
`tokenizers` and jinja2 (runtime/text.py), so an artifact plus this package run on a machine without the
compiler stack.
"""

from .artifact import ArtifactError, load_manifest
from .engine import Engine
from .sampling import GenerationStats, generate, generate_stream, sample

__all__ = ["ArtifactError", "Engine", "GenerationStats", "generate", "generate_stream", "load_manifest", "sample"]
