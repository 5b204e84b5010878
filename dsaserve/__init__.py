"""dsaserve: serving DeepSeek-Sparse-Attention models on long agentic contexts."""

__version__ = "0.1.0"
