from unicron.cli import entrypoint

entrypoint()
