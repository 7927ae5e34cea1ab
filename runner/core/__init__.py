"""What the runner and the API tier both use: the configuration, the wire and its handshake,
the input signature, the tensor types, trust (token and TLS) and timeouts. Imports nothing
outside this folder."""
