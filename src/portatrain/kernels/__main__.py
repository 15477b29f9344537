"""``python -m portatrain.kernels list|check``."""

import sys

from portatrain.kernels.cli import main

sys.exit(main(sys.argv[1:]))
