"""``python -m stager COMMAND ...``"""

import sys

from stager.cli.entry import main

sys.exit(main())
