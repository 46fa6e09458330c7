"""``python -m vtprune``: the ``vtprune`` command line."""

from vtprune.cli import main

raise SystemExit(main())
