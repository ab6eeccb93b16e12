"""`python -m asyncserve`: the command line (see asyncserve.cli)."""

import sys

from asyncserve.cli import main

sys.exit(main())
