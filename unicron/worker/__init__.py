"""Code that runs inside every worker: boot, hooks, channel to the agent, State snapshots, faults.

Importing this package is cheap (no torch, no zmq): ``boot`` installs ``hooks`` and runs the
user's script; ``state`` (imported on first use of ``unicron.State``) needs torch.
"""
