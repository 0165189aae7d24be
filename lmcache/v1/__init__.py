"""Version-1 engine: config, keys, memory, storage tiers, copy connectors, engine."""
