"""``python -m loadgen run ...``: see ``loadgen.cli``."""

import sys

from loadgen.cli import main

sys.exit(main())
