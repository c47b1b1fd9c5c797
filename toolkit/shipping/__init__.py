"""Shipping what a run trained: GGUF export for llama.cpp and Ollama, a server."""
