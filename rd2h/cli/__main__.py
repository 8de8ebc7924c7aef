"""``python -m rd2h.cli`` is the ``rd2h`` command."""

import sys

from rd2h.cli.main import main

sys.exit(main())
