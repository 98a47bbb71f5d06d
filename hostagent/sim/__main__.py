"""Entry point: ``python -m hostagent.sim KIND ARGS``."""

import sys

from hostagent.sim.server import main

sys.exit(main(sys.argv[1:]))
