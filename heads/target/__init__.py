"""The frozen target: its adapter, GGUF files and the CPU and GPU fast paths."""
