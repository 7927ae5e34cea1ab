"""`python -m batchserve.runner`: serve one runner process on its own."""

from batchserve.runner.server import main

raise SystemExit(main())
