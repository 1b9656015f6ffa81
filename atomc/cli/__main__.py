"""`python -m atomc.cli`: the `atomc` command (the tests and bench start it so)."""

import sys

from atomc.cli import main

sys.exit(main())
