"""Model files' own weight formats: what each stored type is, how its bytes read, and which picompile weight
format keeps it (`ggml`: llama.cpp's GGUF tensor types)."""
