"""The data directory on disk: conversation folders, durable writes, format versions."""
