"""Coordinator: membership and job state (pure) and the ZeroMQ server (shell)."""
