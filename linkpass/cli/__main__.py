"""``python -m linkpass.cli ...``: the same as the ``linkpass`` command."""

import sys

from linkpass.cli.app import main

sys.exit(main())
