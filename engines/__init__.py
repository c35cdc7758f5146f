"""Heads for serving engines: export to and import from the layouts vLLM, SGLang and the original EAGLE /
Medusa code read (`export.py`), those layouts and their validators (`formats.py`), and the vLLM server command
and its metrics (`serving.py`)."""

from engines.export import FORMATS, export_head, import_head, validate_export

__all__ = ["FORMATS", "export_head", "import_head", "validate_export"]
