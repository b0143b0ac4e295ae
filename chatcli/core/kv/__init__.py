"""The KV state that outlives the process: the state file, the state log, the persona prefix cache, the budget."""
