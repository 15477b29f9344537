"""``python -m portatrain.audit PATH...``: the audit without the portatrain CLI around it."""

import sys

from portatrain.audit.cli import main

sys.exit(main(prog="python -m portatrain.audit"))
