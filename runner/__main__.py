"""`python -m runner`: serve one runner process on its own."""

from runner.server import main

raise SystemExit(main())
