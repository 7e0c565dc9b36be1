"""export: a pruned or recovered model directory as one GGUF file that llama.cpp and Ollama run."""

from layerprune.export.api import ExportReport, export_gguf

__all__ = ["ExportReport", "export_gguf"]
