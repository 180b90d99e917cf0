"""`python -m manager.cli`: how tests and the embedded stack start the command."""

import sys

from manager.cli import main

sys.exit(main())
