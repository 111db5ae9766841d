"""sinkflow: optimal-transport and flow-based generative models that run right the first time."""

__version__ = "0.1.0"
