"""`python -m batchserve.runner`: serve one runner process on its own."""

from .server import main

raise SystemExit(main())
