"""chatcli: a terminal chat with a local LLM whose conversation state persists."""

__version__ = "0.1.0"
