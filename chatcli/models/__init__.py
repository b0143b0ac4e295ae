"""Finding and reading GGUF model files."""
