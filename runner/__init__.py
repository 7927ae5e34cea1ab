"""The runner tier: one process per model that batches calls and runs the model on them.

This folder owns the runner process itself (`server`, `dispatcher`, `batching`, `models`,
`metrics`, `status`, and the bundled models `bundled` and `text_model`); `core/` holds what the
API tier shares with it, `policy/` the pure batching policies and latency model, and `sim/` the
discrete-event simulator that drives those policies on a virtual clock. It never imports
`batchserve.api`.

A call passes through `server` (after the handshake of `core/handshake.py`, framed by
`core/wire.py`, checked by `core/signature.py`), `dispatcher`, the policy (`policy/`),
`batching` (and `core/ragged.py`), `models`, then back the same way.
"""
