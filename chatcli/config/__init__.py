"""Settings and personas."""
