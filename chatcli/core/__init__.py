"""The conversation core: turns, transcript, state log, store. Never prints; imports no UI or HTTP code."""
