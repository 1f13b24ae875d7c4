"""An agentopd plugin env with multi-step tool use: `stock_lookup` (find a city's store, then count an item there)."""
