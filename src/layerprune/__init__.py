"""layerprune: make decoder-only LLMs shallower and measure what it costs."""

__version__ = "0.1.0"
