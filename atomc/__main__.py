import sys

from atomc.cli import main

sys.exit(main())
