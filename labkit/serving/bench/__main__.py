"""``python -m labkit.serving.bench``: the same as ``labkit bench``."""

import sys

from labkit.serving.bench.cli import main

sys.exit(main())
