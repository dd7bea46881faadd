from unicron.console import entrypoint

entrypoint()
