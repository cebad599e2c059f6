"""Reading and writing: checkpoints as stored, the Hub, the output protocol, exported merges, model
cards, what a merge inherits from its first model, content fingerprints and the offline zoo."""
