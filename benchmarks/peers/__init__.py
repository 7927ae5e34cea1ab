"""The servers a user would pick instead of batchserve, measured beside it with one client.

One module per server (``batchserve_mlp``, ``mosec_mlp``, ...) holds a :class:`Peer`: how to
start it, the URL path and JSON body of one row of the bundled MLP, and where the 16 floats
are in its answer. Run as a script inside that server's own venv, the same module is the
server. ``python -m benchmarks.peers`` sweeps them all; see ``docs/benchmarks.md``.
"""
