"""``python -m bubblefree serve ...``: the same as the ``bubblefree`` command."""

import sys

from bubblefree.server.cli import main

sys.exit(main())
