"""Serving: `kmix.export` writes a half-precision artifact, checked against float32 before it is kept."""

from kmix.serving.check import Comparison, ExportReport, NotFiniteError
from kmix.serving.pipeline import export
from kmix.serving.half_weights import HalfStoragePolicy

__all__ = ["Comparison", "ExportReport", "HalfStoragePolicy", "NotFiniteError", "export"]
