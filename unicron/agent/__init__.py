"""The per-node agent: spawns, logs, supervises and reaps the workers of one node."""
